"""The gateway's own gunicorn config: its GATEWAY_* settings as gunicorn settings, then
pd-gateway's hooks, added as any host's config adds them (`install(globals())`, last).

`pd-gateway` runs gunicorn with `-c python:gateway.standalone_conf`; the top-level
`gunicorn.conf.py` imports it, so `gunicorn -c gunicorn.conf.py` works from a checkout.
"""

from gateway.config import Settings
from gateway.gunicorn_conf import install

_settings = Settings.from_env()

wsgi_app = "gateway.wsgi:app"
bind = [f"{_settings.host}:{_settings.port}"]
workers = _settings.workers
# Streams last as long as decode does: a sync worker would be killed at `timeout` mid-stream.
# gevent serves thousands of idle streams per worker; gthread one thread per stream.
# gevent: gunicorn's worker, except that a graceful stop does not wait out idle keep-alives.
# Both with a deadline on clients that stall (--client-timeout).
worker_class = (
    "gateway.workers.GeventWorker"
    if _settings.worker_class == "gevent"
    else "gateway.workers.ThreadWorker"
)
threads = _settings.threads
worker_connections = _settings.worker_connections
# The worker heartbeat, not a request limit: streams may run much longer than this.
timeout = 60
graceful_timeout = int(_settings.graceful_timeout)
# Above a fronting proxy's idle timeout, so it never reuses a connection we are closing.
keepalive = _settings.keepalive
# Recycling a worker wipes its conversation cache.
max_requests = 0
loglevel = _settings.log_level
accesslog = None
# gunicorn 25.1+ opens a control socket at one fixed path per user; several gateways on one
# machine (tests, benchmarks) would fight over it, and nothing here uses it.
control_socket_disable = True

# Worker slots, private listeners, the metrics directory; gevent patched before the app loads.
install(globals())
