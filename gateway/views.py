"""Thin routes: read the request, hand it to the gateway, shape the response."""
from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING

from flask import Blueprint, Response, jsonify, request

from . import metrics
from .conversation import identify, root_key
from .errors import (BadRequest, ClientGone, GatewayError, NotFound, PayloadTooLarge,
                     Unauthorized, envelope)
from .parse import CHAT, COMPLETIONS, parse

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def error_response(error: GatewayError, request_id: str | None = None) -> Response:
    response = jsonify(error.envelope())
    response.status_code = error.status
    if request_id:
        response.headers["X-Request-Id"] = request_id
    return response


def _read_body(limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    try:
        raw = request.stream.read(limit + 1)
    except (OSError, ValueError) as exc:      # gunicorn's NoMoreData: a cut chunked body
        raise BadRequest("Request body ended before it was complete") from exc
    if len(raw) > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return raw


def create_blueprint(gateway: Gateway) -> Blueprint:
    """The gateway's routes; mount it on any Flask app."""
    bp = Blueprint("pd_gateway", __name__)

    def complete(path: str) -> Response:
        given = request.headers.get("X-Request-Id", "")
        request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        try:
            # The whole body first: bytes still unread in the socket would look to the
            # disconnect watcher like a pipelined next request, and it would stop watching.
            raw = _read_body(gateway.settings.max_body_bytes)
        except GatewayError as exc:
            return _failed(exc, request_id)
        total = gateway.settings.total_timeout
        watch = gateway.upstream.watch(request.environ.get("gunicorn.socket"),
                                       time.monotonic() + total if total else None)
        try:
            response = _complete(path, raw, request_id)
        except BaseException:
            watch.stop()
            raise
        if response.is_streamed:
            response.call_on_close(watch.stop)     # the stream outlives this function
        else:
            watch.stop()
        return response

    def _failed(exc: GatewayError, request_id: str) -> Response:
        if isinstance(exc, ClientGone):
            metrics.DISCONNECTS.inc()      # nobody reads the reply
        else:
            log.info("request %s failed with %d: %s", request_id, exc.status, exc.message)
            metrics.ERRORS.labels("request", str(exc.status)).inc()
        return error_response(exc, request_id)

    def _complete(path: str, raw: bytes, request_id: str) -> Response:
        try:
            client_request = parse(path, raw)
            id_args = (client_request.body, request.headers, client_request.conversation_id)
            if gateway.affinity.may_forward(request.environ):
                owner = gateway.affinity.forward_to(root_key(*id_args))
                if owner is not None:
                    try:
                        forwarded = gateway.affinity.forward(owner, path, raw, request.headers)
                    except GatewayError:
                        metrics.FORWARDED.labels("failed").inc()   # client gone, deadline
                        raise
                    metrics.FORWARDED.labels("away" if forwarded is None else "sent").inc()
                    if forwarded is not None:
                        status, headers, body = forwarded
                        return Response(body, status=status, headers=headers)
            identity = identify(*id_args)
            headers = gateway.upstream.headers(request_id, request.headers.get("Authorization"))
            reply = gateway.disagg.run(client_request, identity, headers)
        except GatewayError as exc:
            return _failed(exc, request_id)
        if reply.stream is not None:
            response = Response(reply.stream, content_type=reply.content_type)
        else:
            response = jsonify(reply.body)
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
        try:
            return jsonify(gateway.models())
        except GatewayError as exc:
            return error_response(exc)

    @bp.get("/health")
    def health() -> Response:
        """For load balancers and Kubernetes probes: status only, nothing about the engines."""
        ok = gateway.healthy()
        response = jsonify({"status": "ok" if ok else "degraded"})
        response.status_code = 200 if ok else 503
        return response

    @bp.get("/admin/status")
    def status() -> Response:
        token = gateway.settings.admin_token
        if not token:
            raise NotFound("Not Found")
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise Unauthorized("the admin report needs Authorization: Bearer <admin token>")
        # debug=1 walks the heap for live greenlets: only for the operator who asked.
        report = gateway.status(debug=request.args.get("debug") == "1")
        response = jsonify(report)
        response.status_code = 200 if report["status"] == "ok" else 503
        return response

    @bp.get("/metrics")
    def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, content_type=content_type)

    @bp.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        if isinstance(exc, GatewayError):
            return error_response(exc)
        status = getattr(exc, "code", None)
        if isinstance(status, int) and 400 <= status < 500:   # werkzeug's HTTPExceptions
            response = jsonify(envelope(status, getattr(exc, "description", str(exc)),
                                        "invalid_request_error"))
            response.status_code = status
            return response
        log.exception("unexpected error")
        response = jsonify(envelope(500, "Internal gateway error", "internal_error"))
        response.status_code = 500
        return response

    return bp
