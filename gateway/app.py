"""`create_app(settings)`: the Flask app, and the `Gateway` object its routes share."""
from __future__ import annotations

import logging
import os
import threading
import time

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from .affinity import Affinity
from .config import Settings
from .disagg import Disagg
from .errors import BadGateway, GatewayError, envelope
from .exactness import Exactness
from .store import ConversationStore, create_store
from .upstream import Policy, Pool, Prober, Upstream
from .views import create_blueprint


class Gateway:
    """Everything one worker process shares between requests; build it after fork."""

    def __init__(self, settings: Settings, store: ConversationStore | None = None) -> None:
        self.settings = settings
        self.store = store if store is not None else create_store(settings)
        concurrency = (settings.threads if settings.worker_class == "gthread"
                       else settings.worker_connections)
        self.upstream = Upstream(settings.connect_timeout, settings.read_timeout,
                                 pool_size=concurrency, api_key=settings.upstream_api_key,
                                 hosts=len(settings.prefill) + len(settings.decode)
                                 + settings.workers + 4)
        policy = Policy(routing=settings.routing, overload_factor=settings.overload_factor,
                        breaker_failures=settings.breaker_failures,
                        breaker_cooldown=settings.breaker_cooldown)
        self.prefill = Pool("prefill", settings.prefill, policy)
        self.decode = Pool("decode", settings.decode, policy)
        self.prober = Prober(self.upstream, [self.prefill, self.decode], settings.probe_interval)
        self.prefill.on_down = self.decode.on_down = self.prober.wake
        self.affinity = Affinity(settings, self.upstream)
        self.disagg = Disagg(self.store, self.upstream, self.prefill, self.decode,
                             attempts=settings.attempts,
                             exactness=Exactness(settings.verify_reuse))

    def close(self) -> None:
        """Stop the background prober and close pooled engine connections (for embedders and
        tests; a gunicorn worker just exits)."""
        self.prober.stop()
        self.upstream.session.close()

    MODELS_TIMEOUT = 5.0   # /v1/models is a metadata call: no engine should take longer

    def models(self) -> dict:
        """The model list of the first D that answers, healthy ones first."""
        now = time.monotonic()
        for instance in sorted(self.decode.instances, key=lambda i: not i.available(now)):
            try:
                return self.upstream.get_json(instance, "/v1/models",
                                              min(self.MODELS_TIMEOUT, self.settings.read_timeout))
            except GatewayError:
                continue
        raise BadGateway("no decode instance answered /v1/models")

    def healthy(self) -> bool:
        """Can this worker serve a turn: some P and some D not marked down?"""
        return all(any(not i.down for i in pool.instances) for pool in (self.prefill, self.decode))

    def status(self, debug: bool = False) -> dict:
        """The detailed report (GET /admin/status): engines, breakers, store, this worker."""
        pools = {pool.role: pool.report() for pool in (self.prefill, self.decode)}
        return {"status": "ok" if self.healthy() else "degraded", "worker": self.affinity.slot,
                "pid": os.getpid(), "affinity": self.affinity.enabled,
                # Besides gthread's request pool (which grows with concurrency and stays):
                # the main thread, the prober, request watchers. Under gevent, greenlets.
                "threads": sum(not t.name.startswith("ThreadPoolExecutor")
                               for t in threading.enumerate()),
                "watchers": sum(t.name == "pd-gateway-watch" for t in threading.enumerate()),
                **self.store.report(), **pools,
                **({"greenlets": _greenlets()} if debug else {})}


def _greenlets() -> int:
    """Live greenlets (gevent workers' requests and watchers); walks the heap, so only on ask."""
    import gc

    from greenlet import greenlet
    return sum(isinstance(o, greenlet) and not o.dead for o in gc.get_objects())


def create_app(settings: Settings | None = None, store: ConversationStore | None = None) -> Flask:
    """Build the gateway app; `settings` default to the GATEWAY_* environment."""
    settings = settings if settings is not None else Settings.from_env()
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    app = Flask(__name__)
    app.json.compact = True          # one-line JSON bodies, as vLLM sends them
    app.json.sort_keys = False
    gateway = Gateway(settings, store)
    app.extensions["pd_gateway"] = gateway
    app.register_blueprint(create_blueprint(gateway))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        response = jsonify(envelope(exc.code or 500, exc.description or exc.name,
                                    "invalid_request_error" if (exc.code or 500) < 500
                                    else "internal_error"))
        response.status_code = exc.code or 500
        return response

    return app
