"""`create_app(settings)`: the Flask app, and the `Gateway` object its routes share."""
from __future__ import annotations

import logging

from flask import Flask, Response, jsonify
from werkzeug.exceptions import HTTPException

from .config import Settings
from .disagg import Disagg
from .errors import BadGateway, GatewayError, envelope
from .store import ConversationStore, LocalStore
from .upstream import Pool, Upstream
from .views import create_blueprint


class Gateway:
    """Everything one worker process shares between requests; build it after fork."""

    def __init__(self, settings: Settings, store: ConversationStore | None = None) -> None:
        self.settings = settings
        self.store = store if store is not None else LocalStore(settings.store_size,
                                                                settings.store_ttl)
        concurrency = (settings.threads if settings.worker_class == "gthread"
                       else settings.worker_connections)
        self.upstream = Upstream(settings.connect_timeout, settings.read_timeout,
                                 pool_size=concurrency, api_key=settings.upstream_api_key)
        self.prefill = Pool("prefill", settings.prefill)
        self.decode = Pool("decode", settings.decode)
        self.disagg = Disagg(self.store, self.upstream, self.prefill, self.decode)

    def models(self) -> dict:
        """The model list of the first D that answers."""
        for instance in self.decode.instances:
            try:
                return self.upstream.get_json(instance, "/v1/models")
            except GatewayError:
                continue
        raise BadGateway("no decode instance answered /v1/models")

    def health(self) -> dict:
        pools = {}
        for pool in (self.prefill, self.decode):
            pools[pool.role] = [{"name": i.name, "url": i.url,
                                 "healthy": self.upstream.probe(i), "inflight": i.inflight}
                                for i in pool.instances]
        ok = all(any(i["healthy"] for i in instances) for instances in pools.values())
        return {"status": "ok" if ok else "degraded", "conversations": len(self.store), **pools}


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
