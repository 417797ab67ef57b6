"""The metrics listener (--metrics-port): GET /metrics and /health, open, on an address of the
operator's, answered in front of the app by whichever worker accepts the connection.

gateway.gunicorn_conf binds the listener in the master and hands it to every worker, as gunicorn
hands them its own: one listener per host, and any worker's /metrics is every worker's (the
multiprocess files). Why the workers answer it, not a server in the master: the master of a
gevent gateway is monkey-patched (install()), so a server thread there would be a greenlet, and
greenlets spawned before a fork run on in every child (gipc's docs: "Greenlets spawned before
forking are duplicated in the child"); a real thread in a process that forks may hold a lock
across the fork; and /health is a worker's own readiness (its probes of the engines), which the
master could only guess from the engine gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gateway.extension import MountedGateway
from gateway.support.errors import BadRequest, NotFound, clip
from gateway.views import health_response, metrics_response

ROUTES = ("/metrics", "/health")


class MetricsPort:
    """WSGI middleware: a request that came on the metrics listener is answered here (/metrics,
    /health; anything else 404), never by the app; any other request goes to the app."""

    def __init__(self, app: Callable, listener: tuple, mounted: MountedGateway) -> None:
        """`listener`: the metrics socket's own address (getsockname()), which gunicorn puts in
        SERVER_NAME and SERVER_PORT of each request that came on it (not the Host header)."""
        self.app = app
        self.listener = (str(listener[0]), str(listener[1]))
        self.mounted = mounted

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        if (environ.get("SERVER_NAME"), environ.get("SERVER_PORT")) != self.listener:
            return self.app(environ, start_response)
        return self.answer(environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", ""))(
            environ, start_response
        )

    def answer(self, method: str, path: str) -> Any:
        """The reply to `method path` on the metrics listener (a WSGI response)."""
        if path not in ROUTES:
            return NotFound(
                f"{clip(path)} is not served here: the metrics port serves {' and '.join(ROUTES)}"
            ).response()
        if method not in ("GET", "HEAD"):
            error = BadRequest(f"{path} answers GET", status=405)
            response = error.response()
            response.headers["Allow"] = "GET, HEAD"
            return response
        gateway = self.mounted.gateway
        return health_response(gateway) if path == "/health" else metrics_response(gateway)
