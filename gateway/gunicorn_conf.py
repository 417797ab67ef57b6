"""gunicorn settings for pd-gateway, read from the same GATEWAY_* settings as the app.

`pd-gateway` runs gunicorn with `-c python:gateway.gunicorn_conf`; the top-level
`gunicorn.conf.py` imports this so `gunicorn -c gunicorn.conf.py` works from a checkout.
"""
from gateway.config import Settings

_settings = Settings.from_env()

if _settings.worker_class == "gevent":
    # Patch before anything imports ssl/urllib3; gunicorn's own patching comes too late
    # for modules the master already imported (gunicorn #2177, gevent #1016).
    from gevent import monkey

    monkey.patch_all()

wsgi_app = "gateway.wsgi:app"
bind = [f"{_settings.host}:{_settings.port}"]
workers = _settings.workers
# Streams last as long as decode does: a sync worker would be killed at `timeout` mid-stream.
# gevent serves thousands of idle streams per worker; gthread one thread per stream.
worker_class = _settings.worker_class
threads = _settings.threads
worker_connections = _settings.worker_connections
# The worker heartbeat, not a request limit: streams may run much longer than this.
timeout = 60
graceful_timeout = int(_settings.graceful_timeout)
# Above a fronting proxy's idle timeout, so it never reuses a connection we are closing.
keepalive = 75
# Recycling a worker wipes its conversation cache.
max_requests = 0
loglevel = _settings.log_level
accesslog = None
# gunicorn 25.1+ opens a control socket at one fixed path per user; several gateways on one
# machine (tests, benchmarks) would fight over it, and nothing here uses it.
control_socket_disable = True
