"""The routes: map HTTP to `Gateway` calls and their results (or errors) back to HTTP.

A blueprint, so it mounts on any Flask app, under any prefix (gateway.extension): its error
handlers answer its own routes only, and its replies do not depend on the app's JSON settings.
"""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from typing import cast
from urllib.parse import quote

from flask import Blueprint, Response, current_app, request
from werkzeug.exceptions import HTTPException
from werkzeug.wrappers import Response as WerkzeugResponse

from gateway.flow.passthrough import ROUTES, Route
from gateway.flow.reply import Reply
from gateway.front import anthropic
from gateway.front.admission import BodyHold
from gateway.front.auth import check_admin
from gateway.parse import CHAT, COMPLETIONS
from gateway.responses.items import RESPONSES
from gateway.responses.route import Responses, responses_of
from gateway.service import Arrival, Gateway
from gateway.support import logs, metrics
from gateway.support.errors import (
    BadRequest,
    ClientGone,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    Overloaded,
    PayloadTooLarge,
    json_response,
)

log = logging.getLogger(__name__)
_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_QUERY_SAFE = "=&%+;/?:@,$!*'()~[]"  # what a query keeps as it came (quote adds -._~)


READ_CHUNK = 1 << 16  # the body budget counts a body as it arrives, 64 KiB at a time


def _read_body(limit: int, hold: BodyHold) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= limit:
            chunk = request.stream.read(min(READ_CHUNK, limit + 1 - size))
            if not chunk:
                break
            hold.add(len(chunk))  # 429 beyond the worker's body budget
            chunks.append(chunk)
            size += len(chunk)
    except (OSError, ValueError, HTTPException) as exc:
        if _stalled(exc):
            raise _body_stalled() from exc
        if isinstance(exc, HTTPException):  # e.g. the host app's MAX_CONTENT_LENGTH
            raise GatewayError.from_http(exc) from exc
        # gunicorn's NoMoreData, werkzeug's ClientDisconnected: a cut body
        raise BadRequest("Request body ended before it was complete") from exc
    if _stalled(None):
        raise _body_stalled()
    if size > limit:
        raise PayloadTooLarge(f"Request body is larger than {limit} bytes")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _body_stalled() -> GatewayError:
    return GatewayError(
        "The request body did not arrive in time: it stopped for the client "
        "timeout, or all of it took longer than the request timeout",
        status=408,
    )


def _stalled(exc: BaseException | None) -> bool:
    """Did the client stop sending for the client timeout? gateway.workers' sockets then read
    as ended and say so (`pd_stalled`); others raise the timeout, maybe wrapped (werkzeug
    reports a failed read of the body as ClientDisconnected)."""
    if getattr(request.environ.get("gunicorn.socket"), "pd_stalled", False):
        return True
    while exc is not None:
        if isinstance(exc, TimeoutError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


BLUEPRINT = "pd_gateway"
_NOT_SERVED = f"{BLUEPRINT}.not_served"  # the route of unknown paths under a prefix
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]  # its methods (HEAD, OPTIONS: Flask's)
_UNSENT = "pd_gateway.stream_response"


class _StreamResponse(Response):
    """A streamed reply that knows whether the WSGI server took it, and whose chunks go to the
    server as they are (`direct_passthrough`: werkzeug wraps each event in two generators of
    its own otherwise) unless a host app read them or asked to be called on close."""

    served = False
    _host_closes = False  # a host app asked to be called on close

    def call_on_close(self, func):
        self._host_closes = True
        return super().call_on_close(func)

    def get_data(self, as_text: bool = False):
        # A host reads the body (`data` and `json` come here too): werkzeug then iterates it,
        # which it refuses to do for a body passed through. Until then a host that asks
        # `direct_passthrough` is told the truth: a stream, better left unread.
        self.direct_passthrough = False
        return super().get_data(True) if as_text else super().get_data(False)

    def __call__(self, environ, start_response):
        # Decided when served: a host's after_request may have read the body (get_data makes
        # it a list) or asked to be called on close, which werkzeug's wrapper does.
        self.direct_passthrough = not self._host_closes and type(self.response) is _Chunks
        app_iter = super().__call__(environ, start_response)  # start_response may raise
        self.served = True
        return app_iter


class _Chunks:
    """A stream's bytes whose `close` (what a WSGI server calls) releases the whole reply."""

    def __init__(self, chunks: Iterator[bytes], close: Callable[[], None]) -> None:
        self._chunks = chunks
        self.close = close

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks


def _forget_request_id() -> None:
    logs.REQUEST_ID.set("-")  # this thread's (or greenlet's) next lines belong to no request


def _failed(
    exc: GatewayError,
    request_id: str,
    model: str,
    completion: bool,
    envelope: Envelope | None = None,
) -> WerkzeugResponse:
    if isinstance(exc, ClientGone):
        metrics.DISCONNECTS.inc()  # nobody reads the reply
    else:
        # A refusal under overload is counted (pd_gateway_admissions_total), not logged: at
        # hundreds a second the log lines would cost more than the refusals themselves.
        log.log(
            logging.DEBUG if isinstance(exc, Overloaded) else logging.INFO,
            "request %s failed with %d: %s",
            request_id,
            exc.status,
            exc.message,
        )
        if completion:  # (a passed route's are in pd_gateway_passed_total)
            metrics.ERRORS.labels("request", str(exc.status), model).inc()
    return exc.response(request_id, envelope)


def _instance_args() -> tuple[object, object, object]:
    body = request.get_json(silent=True) if request.content_length else None
    if body is None:
        body = request.args
    elif not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object with role and url (and model)")
    return body.get("role"), body.get("url"), body.get("model")


def health_response(gateway: Gateway) -> WerkzeugResponse:
    """For load balancers and Kubernetes probes: status only, nothing about the engines.
    503 when no model can be served; with several models, "degraded" and 200 while some
    can (taking the gateway out would not help the others)."""
    return json_response({"status": gateway.health()}, 200 if gateway.healthy() else 503)


def metrics_response(gateway: Gateway) -> WerkzeugResponse:
    """Every metric, summed over the workers, this worker's view of the engines published first."""
    gateway.publish()
    body, content_type = metrics.exposition()
    return Response(body, content_type=content_type)


Run = Callable[[Gateway, bytes, Arrival, str, Callable[[], None]], Reply]
Envelope = Callable[[GatewayError], dict]


def unknown_route() -> GatewayError:
    """The answer to a request for a path the gateway does not serve (vLLM's engine-internal
    and admin routes among them: docs/routes.md): 404, naming what it serves, as the client
    would call it (the app's prefix included); 405 for a method a route of its does not take."""
    rules = [
        rule
        for rule in current_app.url_map.iter_rules()
        if rule.endpoint.startswith(f"{BLUEPRINT}.") and rule.endpoint != _NOT_SERVED
    ]
    allowed = sorted(
        {
            m
            for rule in rules
            if rule.rule == request.path
            for m in rule.methods or ()
            if m not in ("HEAD", "OPTIONS")
        }
    )
    where = request.script_root + request.path
    if allowed:
        return MethodNotAllowed(
            f"{request.method} is not allowed for {where}: {', '.join(allowed)}", allowed
        )
    served = sorted(
        {request.script_root + rule.rule for rule in rules if "/admin/" not in rule.rule}
    )  # (the admin's are the operator's)
    return NotFound(
        f"{request.method} {where} is not a route of this gateway. It serves {', '.join(served)}"
    )


def _headers() -> Mapping[str, str]:
    """The request's headers, as the gateway reads them: get, [] and items, case-insensitive."""
    # why: werkzeug's Headers is no Mapping (its iteration yields pairs, not names), but it has
    # all the gateway calls on headers; a copy would cost every request.
    return cast(Mapping[str, str], request.headers)


def create_blueprint(current: Callable[[], Gateway], unknown: bool = False) -> Blueprint:
    """The gateway's routes, each serving `current()`, this process's `Gateway`. With
    `unknown`, a route that answers any other path under the blueprint's prefix too
    (`unknown_route`): mounted under a prefix, paths outside it stay the host app's."""
    bp = Blueprint(BLUEPRINT, __name__)

    def complete(path: str) -> WerkzeugResponse:
        return serve(
            lambda gateway, raw, arrival, request_id, body_held: gateway.complete(
                path, raw, _headers(), arrival, request_id, body_held
            ),
            lambda model, status: metrics.RESPONSES.labels(path, model, status).inc(),
            completion=True,
        )

    def messages_route() -> WerkzeugResponse:
        # Anthropic's clients send their key as x-api-key: the gateway reads it as a bearer key.
        headers = anthropic.with_bearer(_headers())
        return serve(
            lambda gateway, raw, arrival, request_id, body_held: gateway.complete(
                CHAT, raw, headers, arrival, request_id, body_held, edge=anthropic.EDGE
            ),
            lambda model, status: metrics.RESPONSES.labels(anthropic.MESSAGES, model, status).inc(),
            completion=True,
            headers=headers,
            envelope=anthropic.envelope,
        )

    def pass_through(route: Route) -> WerkzeugResponse:
        # The path and query as they came (the engine's route, without the app's prefix); a
        # byte no URL may carry percent-encoded, as a server that let it in should have (else
        # http.client refuses it, and that would count against the engine).
        target = route.path + (
            f"?{quote(request.query_string, safe=_QUERY_SAFE)}" if request.query_string else ""
        )
        # Anthropic's count_tokens: its SDK's key (x-api-key) and its envelope, as /v1/messages.
        anthropic_route = route.path == anthropic.COUNT_TOKENS
        headers = anthropic.with_bearer(_headers()) if anthropic_route else _headers()
        return serve(
            lambda gateway, raw, arrival, request_id, body_held: gateway.pass_through(
                route, raw, headers, target, arrival, request_id, body_held
            ),
            lambda model, status: metrics.PASSED.labels(route.path, model, status).inc(),
            completion=False,
            headers=headers,
            envelope=anthropic.envelope if anthropic_route else None,
        )

    def serve(
        run: Run,
        count: Callable[[str, str], None],
        completion: bool,
        headers: Mapping[str, str] | None = None,
        envelope: Envelope | None = None,
    ) -> WerkzeugResponse:
        """One request whose reply `run` makes (of its body, read here, within the limits),
        counted by `count(model, status)`; its key read from `headers` (the request's), its
        errors in `envelope`'s shape (the OpenAI envelope)."""
        gateway = current()
        given = request.headers.get("X-Request-Id", "")
        request_id = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        logs.REQUEST_ID.set(request_id)  # this request's log lines, the relay's included
        environ = request.environ
        arrival = Arrival(
            route=environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", ""),
            port=environ.get("SERVER_PORT", ""),
            socket=environ.get("gunicorn.socket"),
        )
        status = 500  # unless it answers: an error the blueprint's handler answers
        try:
            response = answer(
                gateway,
                run,
                arrival,
                request_id,
                completion,
                _headers() if headers is None else headers,
                envelope,
            )
            status = response.status_code
        except HTTPException as exc:
            status = exc.code or 500
            raise
        except Exception:
            if completion:  # a bug: the handler answers 500 (and logs it)
                metrics.ERRORS.labels("request", "500", arrival.model).inc()
            raise
        finally:
            if not gateway.owners.forwarded(arrival.port):  # counted where its client is
                count(arrival.model, str(status))
        return response

    def answer(
        gateway: Gateway,
        run: Run,
        arrival: Arrival,
        request_id: str,
        completion: bool,
        headers: Mapping[str, str],
        envelope: Envelope | None,
    ) -> WerkzeugResponse:
        streaming = False
        try:
            gateway.api_keys.check(headers.get("Authorization"))  # before the body
            gateway.refuse_early(headers)  # a key whose requests are spent, too
            hold = gateway.bodies.hold()
            try:
                raw = _read_body(gateway.settings.max_body_bytes, hold)  # before the watcher
            except BaseException:
                hold.release()
                raise
            reply = run(gateway, raw, arrival, request_id, hold.release)
            response: WerkzeugResponse
            if isinstance(reply.body, bytes):  # an engine's, as it came
                response = Response(
                    reply.body, status=reply.status, content_type=reply.content_type
                )
            elif reply.stream is None:
                response = json_response(reply.body)
            else:
                # The server's close of the response is the reply's close: the whole chain,
                # run once, even if one step of it fails (werkzeug would skip its on-close
                # callbacks after a failing iterable close).
                closing = ExitStack()
                closing.callback(_forget_request_id)
                closing.callback(reply.close)
                response = _StreamResponse(
                    _Chunks(reply.stream, closing.close),
                    status=reply.status,
                    content_type=reply.content_type,
                    direct_passthrough=True,
                )
                request.environ[_UNSENT] = response  # until the server takes it (teardown)
                streaming = True  # the relay's lines carry the id until the stream ends
        except GatewayError as exc:
            return _failed(exc, request_id, arrival.model, completion, envelope)
        finally:
            if not streaming:
                _forget_request_id()
        response.headers.update(reply.headers)
        response.headers["X-Request-Id"] = request_id
        return response

    @bp.teardown_request
    def release_unsent(error: BaseException | None) -> None:
        # After the app chose its response, before the server iterates it: a stream the server
        # did not take because a host's after_request raised (Flask answered with an error
        # instead) is closed here, so D's count, its place and the watcher are released. Only
        # on an error: a host may wrap our stream in a response of its own and serve that.
        response = request.environ.pop(_UNSENT, None)
        if error is not None and response is not None and not response.served:
            response.close()

    @bp.post(CHAT)
    def chat_completions() -> WerkzeugResponse:
        return complete(CHAT)

    @bp.post(COMPLETIONS)
    def completions() -> WerkzeugResponse:
        return complete(COMPLETIONS)

    @bp.post(anthropic.MESSAGES)
    def messages() -> WerkzeugResponse:
        return messages_route()

    # OpenAI's Responses API, run as chat completions (gateway.responses.route).
    @bp.post(RESPONSES)
    def responses_create() -> WerkzeugResponse:
        return serve(
            lambda gateway, raw, arrival, request_id, body_held: responses_of(gateway).create(
                raw, _headers(), arrival, request_id, body_held
            ),
            lambda model, status: metrics.RESPONSES.labels(RESPONSES, model, status).inc(),
            completion=True,
        )

    def stored(action: Callable[..., dict], response_id: str) -> WerkzeugResponse:
        gateway = current()
        authorization = request.headers.get("Authorization")
        gateway.api_keys.check(authorization)
        responses = responses_of(gateway)
        relayed = responses.at_home(
            response_id,
            request.method,
            request.script_root + request.path,
            request.environ.get("SERVER_PORT", ""),
            authorization,
        )
        if relayed is not None:
            return Response(relayed[1], status=relayed[0], content_type="application/json")
        return json_response(action(responses, response_id, authorization))

    @bp.get(f"{RESPONSES}/<response_id>")
    def responses_get(response_id: str) -> WerkzeugResponse:
        return stored(Responses.retrieve, response_id)

    @bp.delete(f"{RESPONSES}/<response_id>")
    def responses_delete(response_id: str) -> WerkzeugResponse:
        return stored(Responses.delete, response_id)

    @bp.post(f"{RESPONSES}/<response_id>/cancel")
    def responses_cancel(response_id: str) -> WerkzeugResponse:
        return stored(Responses.cancel, response_id)

    @bp.get("/v1/models")
    def models() -> WerkzeugResponse:
        gateway = current()
        gateway.api_keys.check(request.headers.get("Authorization"))
        return json_response(gateway.models())

    # vLLM's other client routes, each passed to an engine (gateway.flow.passthrough).
    for route in ROUTES:
        bp.add_url_rule(
            route.path,
            f"passed {route.path}",
            functools.partial(pass_through, route),
            methods=[route.method],
        )

    # /ping: SageMaker's probe, vLLM's /health under another name (vLLM 0.33.0
    # entrypoints/serve/sagemaker/api_router.py L91-96): so here too, the gateway's own
    # readiness (a P and a D of some model answer) rather than one engine's, and open as
    # /health is (the prober sends no key).
    @bp.route("/ping", methods=["GET", "POST"])
    @bp.get("/health")
    def health() -> WerkzeugResponse:
        return health_response(current())

    def admin() -> Gateway:
        """This process's Gateway, for a caller with the admin token (404 when none is set)."""
        gateway = current()
        check_admin(
            gateway.settings.admin_token, request.headers.get("Authorization"), "the admin routes"
        )
        return gateway

    @bp.get("/admin/status")
    def status() -> WerkzeugResponse:
        gateway = admin()
        # debug=1 walks the heap for live greenlets: only for the operator who asked.
        report = gateway.status(debug=request.args.get("debug") == "1")
        return json_response(report, 200 if gateway.healthy() else 503)

    # Engines added and removed at run time, in every worker (gateway.engines.membership says how).
    # {"role": "prefill"|"decode", "url": "http://host:port"}, as JSON (or query arguments).
    @bp.get("/admin/instances")
    def instances() -> WerkzeugResponse:
        return json_response(admin().membership.report())

    @bp.post("/admin/instances")
    def add_instance() -> WerkzeugResponse:
        membership = admin().membership
        report, new = membership.add(*_instance_args())
        return json_response(report, 201 if new else 200)

    @bp.delete("/admin/instances")
    def remove_instance() -> WerkzeugResponse:
        membership = admin().membership
        return json_response(membership.remove(*_instance_args()))

    @bp.get("/metrics")
    def prometheus() -> WerkzeugResponse:
        gateway = current()
        if gateway.api_keys.enabled:  # clients authenticate: metrics are for the operator
            check_admin(
                gateway.settings.admin_token,
                request.headers.get("Authorization"),
                "/metrics (with API keys on)",
            )
        return metrics_response(gateway)

    if unknown:
        # Routing errors reach no blueprint's handler (no route matched, so no blueprint did):
        # a route of its own for every other path under the prefix is how they are the
        # gateway's to answer. Werkzeug tries it after every fixed route, so it only meets
        # a path none serves, or a method the one serving it does not take.
        @bp.route("/", defaults={"path": ""}, methods=_METHODS)
        @bp.route("/<path:path>", methods=_METHODS)
        def not_served(path: str) -> WerkzeugResponse:
            return unknown_route().response()

    # Blueprint-scoped: the app's own routes keep the app's handlers. HTTPException too, or an
    # app-wide handler for it would answer first (Flask looks for the most specific class).
    @bp.errorhandler(HTTPException)
    @bp.errorhandler(Exception)
    def unexpected(exc: Exception) -> WerkzeugResponse:
        rule = request.url_rule
        # The Messages route's errors in Anthropic's envelope, wherever they arose.
        shape = anthropic.envelope if rule is not None and rule.rule == anthropic.MESSAGES else None
        if isinstance(exc, GatewayError):
            return exc.response(envelope=shape)
        if isinstance(exc, HTTPException) and (exc.code or 500) < 500:
            return GatewayError.from_http(exc).response(envelope=shape)
        log.exception("unexpected error")
        return GatewayError("Internal gateway error").response(envelope=shape)

    return bp
