"""`create_app(settings)`: the gateway as an app of its own, the extension mounted at the root."""

from __future__ import annotations

from dataclasses import asdict

from flask import Flask
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response

from gateway.config import Settings
from gateway.engines.transport import EngineTransport
from gateway.extension import PDGateway
from gateway.reuse.store import ConversationStore
from gateway.support import logs
from gateway.support.errors import GatewayError
from gateway.views import unknown_route


def create_app(
    settings: Settings | None = None,
    store: ConversationStore | None = None,
    transport: EngineTransport | None = None,
) -> Flask:
    """Build the gateway app; `settings` default to the GATEWAY_* environment; `store` and
    `transport` replace the conversation store and the engine calls' transport (tests)."""
    settings = settings if settings is not None else Settings.from_env()
    logs.configure(settings.log_level, settings.log_format)
    app = Flask(__name__)
    PDGateway(app, conversation_store=store, transport=transport, **asdict(settings))

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        # Routing errors (404, 405) happen before any blueprint: the app answers them, and
        # here the whole app is the gateway's.
        if exc.code in (404, 405):
            return unknown_route().response()  # what the gateway serves, named
        response = GatewayError.from_http(exc).response()
        for name, value in exc.get_headers():
            if name.lower() != "content-type":  # e.g. 405's Allow
                response.headers[name] = value
        return response

    return app
