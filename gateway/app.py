"""`create_app(settings)`: a Flask app serving one worker's `Gateway` through its blueprint."""
from __future__ import annotations

import logging

from flask import Flask, Response
from werkzeug.exceptions import HTTPException

from .config import Settings
from .errors import GatewayError
from .service import Gateway
from .store import ConversationStore
from .views import create_blueprint


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
        # Routing errors (404, 405) happen before any blueprint: the app answers them.
        response = GatewayError.from_http(exc).response()
        for name, value in exc.get_headers():
            if name.lower() != "content-type":     # e.g. 405's Allow
                response.headers[name] = value
        return response

    return app
