"""The routes: map HTTP to `Gateway` calls and their results (or errors) back to HTTP.

A blueprint, so it mounts on any Flask app, under any prefix (gateway.extension): its error
handlers answer its own routes only, and its replies do not depend on the app's JSON settings.
"""
from __future__ import annotations

import hmac
import logging
import re
import uuid
from typing import Callable

from flask import Blueprint, Response, request
from werkzeug.exceptions import HTTPException

from . import logs, metrics
from .errors import (BadRequest, ClientGone, GatewayError, NotFound, PayloadTooLarge,
                     Unauthorized, json_response)
from .parse import CHAT, COMPLETIONS
from .service import Gateway

log = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _read_body(limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    try:
        raw = request.stream.read(limit + 1)
    except (OSError, ValueError) as exc:      # gunicorn's NoMoreData: a cut chunked body
        raise BadRequest("Request body ended before it was complete") from exc
    except HTTPException as exc:    # e.g. the host app's MAX_CONTENT_LENGTH: answered here
        raise GatewayError.from_http(exc) from exc
    if len(raw) > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return raw


def _failed(exc: GatewayError, request_id: str) -> Response:
    if isinstance(exc, ClientGone):
        metrics.DISCONNECTS.inc()      # nobody reads the reply
    else:
        log.info("request %s failed with %d: %s", request_id, exc.status, exc.message)
        metrics.ERRORS.labels("request", str(exc.status)).inc()
    return exc.response(request_id)


def _instance_args() -> tuple[object, object]:
    body = request.get_json(silent=True) if request.content_length else None
    if body is None:
        body = request.args
    elif not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with role and url")
    return body.get("role"), body.get("url")


def create_blueprint(current: Callable[[], Gateway]) -> Blueprint:
    """The gateway's routes, each serving `current()`, this process's `Gateway`."""
    bp = Blueprint("pd_gateway", __name__)

    def complete(path: str) -> Response:
        gateway = current()
        given = request.headers.get("X-Request-Id", "")
        request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        logs.REQUEST_ID.set(request_id)      # this request's log lines, the relay's included
        try:
            raw = _read_body(gateway.settings.max_body_bytes)   # whole, before the watcher
            reply = gateway.complete(path, raw, request.headers, request.environ, request_id)
        except GatewayError as exc:
            return _failed(exc, request_id)
        if reply.stream is not None:
            response = Response(reply.stream, status=reply.status,
                                content_type=reply.content_type)
            if reply.close is not None:
                response.call_on_close(reply.close)
        else:
            response = json_response(reply.body)
        response.headers.update(reply.headers)
        response.headers["X-Request-Id"] = request_id
        return response

    @bp.post(CHAT)
    def chat_completions() -> Response:
        return complete(CHAT)

    @bp.post(COMPLETIONS)
    def completions() -> Response:
        return complete(COMPLETIONS)

    @bp.get("/v1/models")
    def models() -> Response:
        return json_response(current().models())

    @bp.get("/health")
    def health() -> Response:
        """For load balancers and Kubernetes probes: status only, nothing about the engines."""
        ok = current().healthy()
        return json_response({"status": "ok" if ok else "degraded"}, 200 if ok else 503)

    def admin() -> Gateway:
        """This process's Gateway, for a caller with the admin token (404 when none is set)."""
        gateway = current()
        token = gateway.settings.admin_token
        if not token:
            raise NotFound("Not Found")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("the admin report needs Authorization: Bearer <admin token>")
        return gateway

    @bp.get("/admin/status")
    def status() -> Response:
        gateway = admin()
        # debug=1 walks the heap for live greenlets: only for the operator who asked.
        report = gateway.status(debug=request.args.get("debug") == "1")
        return json_response(report, 200 if report["status"] == "ok" else 503)

    # Engines added and removed at run time, in every worker (gateway.membership says how).
    # {"role": "prefill"|"decode", "url": "http://host:port"}, as JSON (or query arguments).
    @bp.get("/admin/instances")
    def instances() -> Response:
        return json_response(admin().membership.report())

    @bp.post("/admin/instances")
    def add_instance() -> Response:
        membership = admin().membership
        role, url = _instance_args()
        report, new = membership.add(role, url)
        return json_response(report, 201 if new else 200)

    @bp.delete("/admin/instances")
    def remove_instance() -> Response:
        membership = admin().membership
        return json_response(membership.remove(*_instance_args()))

    @bp.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, content_type=content_type)

    # Blueprint-scoped: the app's own routes keep the app's handlers. HTTPException too, or an
    # app-wide handler for it would answer first (Flask looks for the most specific class).
    @bp.errorhandler(HTTPException)
    @bp.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        if isinstance(exc, GatewayError):
            return exc.response()
        if isinstance(exc, HTTPException) and (exc.code or 500) < 500:
            return GatewayError.from_http(exc).response()
        log.exception("unexpected error")
        return GatewayError("Internal gateway error").response()

    return bp
