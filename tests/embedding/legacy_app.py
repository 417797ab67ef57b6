"""A legacy Flask service that mounts pd-gateway under /llm (docs/embedding.md shows it whole).

Its own routes (a /health of its own among them), error handlers, before/after_request hooks
and JSON style stay its own; the gateway's routes answer in the OpenAI way. Its gunicorn
config is gunicorn.conf.py beside it. Settings come from a config object, then from LEGACY_*
variables (`app.config.from_prefixed_env`), as many Flask services take theirs.
"""

from __future__ import annotations

import os

from flask import Flask, g, jsonify, request

from gateway.extension import PDGateway

pd_gateway = PDGateway(url_prefix="/llm")


class Config:
    API_KEYS = ["legacy-key"]
    # pd-gateway's settings: any field of gateway.config.Settings as PD_GATEWAY_<NAME>
    # (README "Settings"); a deployment sets LEGACY_PD_GATEWAY_PREFILL='["http://p1:8100"]'.
    PD_GATEWAY_PREFILL = ["http://127.0.0.1:8100"]
    PD_GATEWAY_DECODE = ["http://127.0.0.1:8200"]


def create_app() -> Flask:
    app = Flask(__name__)
    app.config.from_object(Config)
    app.config.from_prefixed_env("LEGACY")
    # The service's JSON style: sorted, indented. The gateway's replies stay compact, as vLLM's.
    app.json.sort_keys = True
    app.json.compact = False

    @app.before_request
    def authenticate():
        # The service's own API needs its key; the gateway's routes (/llm/...) take OpenAI
        # clients' bearer tokens and pass them on, so the hook leaves them alone.
        g.caller = request.headers.get("X-Api-Key")
        if request.path.startswith("/api/") and g.caller not in app.config["API_KEYS"]:
            return jsonify(error="unauthorized", service="legacy"), 401
        return None

    @app.after_request
    def stamp(response):
        # Headers only: a hook that read the body (get_data) would buffer the gateway's streams.
        response.headers["X-Legacy-Service"] = "1"
        return response

    @app.get("/health")
    def health():
        return jsonify(
            status="legacy-ok", pid=os.getpid(), post_fork=os.environ.get("LEGACY_POST_FORK", "")
        )

    @app.get("/api/items/<int:item_id>")
    def item(item_id: int):
        return jsonify(id=item_id, name=f"item {item_id}")

    @app.get("/api/boom")
    def boom():
        raise RuntimeError("the legacy service failed")

    @app.errorhandler(404)
    def not_found(exc):
        return jsonify(error="not found", service="legacy"), 404

    @app.errorhandler(500)
    def internal(exc):
        return jsonify(error="internal", service="legacy"), 500

    pd_gateway.init_app(app)
    return app
