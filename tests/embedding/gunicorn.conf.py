# The legacy service's gunicorn config: its own settings and hooks, then pd-gateway's, added
# by the one call at the end (docs/embedding.md).
import os

from gateway.gunicorn_conf import install

# workers: WEB_CONCURRENCY, gunicorn's own default for it, as the service's deployments set it.
# pd-gateway streams for as long as decode runs, so gevent or gthread, never sync (install()
# refuses it). gevent: the gateway's variant, which lets idle keep-alive connections go 2 s
# into a graceful stop instead of waiting out `keepalive`.
worker_class = os.environ.get("LEGACY_WORKER_CLASS", "gateway.workers.GeventWorker")
threads = 64  # gthread: the concurrent streams one worker serves
worker_connections = 1000  # gevent
preload_app = True  # the service loads its app once, in the master, then forks
timeout = 60  # the worker heartbeat, not a request limit
graceful_timeout = 30
keepalive = 75
accesslog = None
control_socket_disable = True  # gunicorn 25.1+: several test gunicorns share one machine


def on_starting(server):
    server.log.info("legacy service starting")


def post_fork(server, worker):
    # The service's own per-worker setup; pd-gateway's post_fork runs first, then this.
    os.environ["LEGACY_POST_FORK"] = f"slot {os.environ.get('PD_GATEWAY_WORKER_SLOT')}"


# Last: pd-gateway's hooks, chained before the ones above (worker slots, private listeners,
# the metrics directory; gevent patched before the app is preloaded).
install(globals())
