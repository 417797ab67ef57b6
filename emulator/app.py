"""The engine's HTTP API: OpenAI completions as vLLM streams them, plus health, models, stats and
faults.

A little over 300 lines because it is vLLM's completion surface in one place (both endpoints,
streamed and not, /tokenize, faults); split, each part would be read beside the others anyway.
vLLM's other routes (embeddings, scoring, audio, ...) are in other_routes.py.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace

import gevent.select
from flask import Flask, Response, request
from flask.json.provider import DefaultJSONProvider
from prometheus_client import CONTENT_TYPE_LATEST
from werkzeug.exceptions import HTTPException

from .anthropic import MessagesError, count_tokens, messages_call
from .engine import Engine, Turn
from .errors import (
    BadRequest,
    ClientGone,
    EngineError,
    InternalError,
    KVLoadError,
    MethodNotAllowed,
    NotFound,
    NotImplementedByEmulator,
    Unavailable,
)
from .faults import Fault
from .metrics import exposition
from .other_routes import add_routes
from .protocol import (
    AnyFramer,
    Call,
    CompletionRequest,
    ValidationError,
    chat_call,
    dumps,
    parse_tokenize,
)
from .responses import ResponseStore, responses_call
from .tokens import EOS, token_id, token_ids

log = logging.getLogger(__name__)

SSE = "text/event-stream; charset=utf-8"
SOCKET_KEY = "emulator.socket"  # set by the server's handler (cli.py); absent under a test client


def _json(payload: object, status: int = 200) -> Response:
    return Response(dumps(payload), status=status, content_type="application/json")


def _error(exc: EngineError) -> Response:
    return _json(exc.envelope(), exc.code)


def _cutter(environ: dict) -> Callable[[], None]:
    """A function that drops the client connection mid-response, as a crashing engine would."""
    sock = environ.get(SOCKET_KEY)

    def cut() -> None:
        if sock is None:
            raise ConnectionAbortedError("emulated fault: connection cut")
        try:
            sock.shutdown(
                socket.SHUT_RDWR
            )  # FIN now; the server's later writes fail quietly (EPIPE)
        except OSError:
            pass

    return cut


def _client_gone(environ: dict, engine: Engine, timeout: float) -> bool:
    sock = environ.get(SOCKET_KEY)
    if sock is None:
        engine.sleep(timeout)
        return False
    readable, _, _ = gevent.select.select([sock], [], [], timeout)
    if not readable:
        return False
    try:
        gone = sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
    if not gone:
        engine.sleep(timeout)  # the client sent more bytes (pipelining); don't spin on them
    return gone


def _hang(engine: Engine, fault: Fault) -> Response:
    """Accept the request and answer nothing until the client leaves (or max_s passes)."""
    request.get_data()  # drain the body so the socket turns readable only when the client closes
    environ = request.environ
    deadline = engine.clock() + fault.max_s
    try:
        while engine.clock() < deadline:
            if _client_gone(environ, engine, 0.5):
                _cutter(environ)()
                return Response(b"", status=499)  # nobody reads this; the client is gone
    finally:
        engine.stats.fault_responses += 1  # counted when the hang ends, so tests can see it end
    raise Unavailable(f"emulated fault: hang ended after {fault.max_s} s")


# From this inter-token gap up, a stream also watches its socket while it waits, so a client
# that leaves is noticed at once (as vLLM aborts on disconnect) rather than at the next write.
# Below it the next write comes soon enough, and a select per token would cost CPU.
WATCHED_ITL = 0.05


def _token_ids(req: CompletionRequest) -> bool:
    """Does the reply carry token ids? vLLM hides them when reasoning is hidden from the client."""
    return req.return_token_ids and req.include_reasoning


def _shown(req: CompletionRequest, delta: dict | None) -> dict | None:
    if delta is not None and "reasoning" in delta and not req.include_reasoning:
        return None  # include_reasoning=false: the reasoning span is generated, never shown
    return delta


def _cached(engine: Engine, turn: Turn, framer) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, only with --enable-prompt-tokens-details (the
    Responses API reports its cached_tokens always)."""
    if engine.config.enable_prompt_tokens_details or framer.reports_cached:
        return engine.reported_cached_tokens(turn)
    return None


def _stream(
    engine: Engine,
    turn: Turn,
    framer: AnyFramer,
    req: CompletionRequest,
    cut: Callable[[], None],
    environ: dict,
) -> Iterator[bytes]:
    """SSE in vLLM's order: role chunk, content chunks, finish chunk, [usage], [params], [DONE]."""
    stats, placement = engine.stats, engine.config.stream_params
    itl = engine.config.itl_ms / 1000.0
    gen = turn.gen
    ids = _token_ids(req)
    lossy = engine.config.stream_token_ids == "lossy"
    steps = [*gen.tokens, *((EOS,) if gen.stopped else ())]
    # Completions put the prompt's ids on the first chunk's choice; chat on the role chunk.
    prompt_ids = (
        {"choice": {"prompt_token_ids": turn.prompt_ids}} if ids and not framer.chat else None
    )
    stats.stream_opened()
    outcome = "aborted"
    try:
        if framer.chat:
            yield framer.role(turn.prompt_ids if ids else None)
        last = len(steps) - 1  # the last token rides on the finish chunk
        for i in range(last + 1):
            # Token i comes out at the end of an engine step: wait step by step until it has.
            while i and (wait := engine.until_token(turn, i)) > 0:
                if itl < WATCHED_ITL:
                    engine.sleep(wait)
                elif _client_gone(environ, engine, wait):
                    stats.aborted_streams += 1
                    return
            if turn.fault.mode == "die_after" and i >= turn.fault.tokens:
                outcome = "died"
                stats.fault_responses += 1
                cut()
                return  # no finish chunk, no [DONE], no chunked terminator
            if turn.fault.mode == "stall_after" and i == turn.fault.tokens:
                # A D that goes silent mid-stream: nothing more until the client leaves (or
                # max_s passes, then the stream goes on).
                stats.fault_responses += 1
                deadline = engine.clock() + turn.fault.max_s
                while engine.clock() < deadline:
                    if _client_gone(environ, engine, min(0.2, deadline - engine.clock())):
                        stats.aborted_streams += 1
                        return
            if turn.fault.mode == "error_after" and i >= turn.fault.tokens:
                # vLLM's stream generator catches a failure during generation and sends it as
                # an event of the same chunked stream, then [DONE] (serving_chat.py); each
                # route's framer says what its stream does instead.
                outcome = "errored"
                stats.fault_responses += 1
                yield framer.fail(InternalError("emulated fault: error_after").envelope())
                if framer.cuts_after_error:
                    cut()
                return
            if i == last:
                break
            delta = _shown(req, gen.deltas[i])
            if delta is None:
                # A token the reasoning or tool parser swallowed: no chunk, unless token ids were
                # asked for (vLLM after PR #29074 then sends an empty delta carrying them).
                if not ids or lossy:
                    continue
                delta = {}
            chunk = None if ids else framer.fast(delta)
            yield chunk or framer.chunk(
                delta, [token_id(steps[i])] if ids else None, extra=prompt_ids
            )
            prompt_ids = None
        params = engine.finish(turn)
        if gen.stopped:  # EOS: no text
            final = {} if gen.tool_calls else ({"content": ""} if framer.chat else {"text": ""})
        else:
            final = _shown(req, gen.deltas[last]) or {}
        extra = {
            **(prompt_ids or {}),
            **({"params": params} if placement == "final" and params is not None else {}),
        }
        yield framer.chunk(
            final, [token_id(steps[last])] if ids else None, gen.finish_reason, extra
        )
        yield framer.tail(
            gen,
            req.include_usage,
            len(turn.tokens),
            _cached(engine, turn, framer),
            params,
            placement,
        )
        outcome = "completed"
    except GeneratorExit:  # the server closes us after a failed write: the client went away
        stats.aborted_streams += 1
        raise
    finally:
        stats.streams_in_flight -= 1
        if outcome == "completed":
            stats.completed += 1
        engine.record(turn, outcome)


def _failed(framer, envelope: dict, cut: Callable[[], None]) -> Iterator[bytes]:
    """A stream that fails before its first token (a failed KV load)."""
    yield framer.fail(envelope)
    if framer.cuts_after_error:
        cut()


def _body(
    engine: Engine,
    turn: Turn,
    framer: AnyFramer,
    req: CompletionRequest,
    cut: Callable[[], None],
    headers: dict,
) -> Response:
    fault = turn.fault
    if fault.mode == "error_after" and fault.tokens < turn.completion_tokens:
        engine.wait_token(turn, fault.tokens)
        engine.stats.fault_responses += 1
        engine.record(turn, "errored")
        raise InternalError("emulated fault: error_after")
    if fault.mode == "die_after" and fault.tokens < turn.completion_tokens:
        engine.wait_token(turn, fault.tokens)
        engine.stats.fault_responses += 1
        engine.record(turn, "died")
        cut()
        return Response(b"", status=500)  # never arrives: the connection is already shut
    engine.wait_token(turn, turn.completion_tokens - 1)
    params = engine.finish(turn)
    gen = turn.gen
    if not req.include_reasoning:
        gen = replace(gen, reasoning=None)
    ids = _token_ids(req)
    body = framer.body(
        gen,
        len(turn.tokens),
        params,
        turn.prompt_ids if ids else None,
        token_ids(turn.sequence[len(turn.tokens) :]) if ids else None,
        _cached(engine, turn, framer),
    )
    engine.stats.completed += 1
    engine.record(turn, "completed")
    return Response(body, headers=headers, content_type="application/json")


def create_app(engine: Engine) -> Flask:
    """The Flask app of one engine; every error leaves as vLLM's envelope."""
    app = Flask(__name__)
    json_provider = DefaultJSONProvider(app)
    json_provider.compact = True  # vLLM bodies are one line; line-based clients depend on it
    app.json = json_provider
    cfg, stats = engine.config, engine.stats
    responses_store = ResponseStore(cfg.responses_api_store)

    @app.errorhandler(EngineError)
    def engine_error(exc: EngineError) -> Response:
        return _error(exc)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        kind = {404: NotFound, 405: MethodNotAllowed}.get(exc.code or 400, BadRequest)
        return _error(kind(f"{exc.name}: {request.method} {request.path}"))

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.path)
        return _error(InternalError(f"emulator bug: {exc!r}"))

    @app.get("/health")
    def health() -> Response:
        return Response(b"", status=503 if engine.faults.down else 200)

    @app.get("/version")
    def version() -> Response:
        """vllm/entrypoints/serve/instrumentator/basic.py L53-56."""
        return _json({"version": "emulated"})

    @app.get("/v1/models")
    def models() -> Response:
        if engine.faults.down:
            raise Unavailable("emulated fault: down")
        created = int(time.time())
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": created,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": cfg.model,
                        "object": "model",
                        "created": created,
                        "owned_by": "vllm",
                        "root": cfg.model,
                        "parent": None,
                        "max_model_len": cfg.max_model_len,
                        "permission": [permission],
                    }
                ],
            }
        )

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(
            exposition(engine.snapshot, cfg.model, cfg), content_type=CONTENT_TYPE_LATEST
        )

    @app.get("/stats")
    def get_stats() -> Response:
        return _json(engine.snapshot())

    @app.get("/stats/leases/<path:request_id>")
    def lease(request_id: str) -> Response:
        """Whether blocks are still kept for this internal request id (for tests)."""
        return _json({"held": engine.leases.holds(request_id)})

    @app.get("/stats/requests")
    def recent_requests() -> Response:
        return _json(list(stats.recent))

    @app.post("/stats/reset")
    def reset_stats() -> Response:
        stats.reset()
        engine.leases.reset_peak()
        return _json(engine.snapshot())

    @app.route("/faults", methods=["GET", "POST"])
    def faults() -> Response:
        if request.method == "POST":
            try:
                engine.faults.set(Fault.from_dict(request.get_json(force=True, silent=True)))
            except ValueError as exc:
                raise BadRequest(str(exc), "mode") from exc
            log.info("fault set to %s", engine.faults.current)
        return _json(engine.faults.current.to_dict())

    def serve(parse: Callable[[bytes, str], Call]) -> Response:
        """One generating request: faults, then the route's parse, prefill, and its framer's
        stream or body."""
        arrival = engine.clock()
        stats.requests += 1
        fault = engine.faults.take()
        if fault.mode == "hang":
            return _hang(engine, fault)
        if fault.mode in ("down", "error500"):
            stats.fault_responses += 1
            raise (Unavailable if fault.mode == "down" else InternalError)(
                f"emulated fault: {fault.mode}"
            )
        if fault.mode == "slow":
            engine.sleep(fault.delay_s)
        xid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        try:
            call = parse(request.get_data(), xid)
        except EngineError:
            stats.bad_requests += 1
            raise
        req, framer = call.req, call.framer
        # vLLM appends a random suffix to internal ids, so remote_request_id != the response id.
        internal_id = f"{call.request_id}-{secrets.token_hex(4)}"
        headers = {"X-Request-Id": xid}
        environ = request.environ
        cut = _cutter(environ)
        try:
            turn = engine.start(
                req, internal_id, fault, arrival, gone=lambda: _client_gone(environ, engine, 0)
            )
        except ClientGone:
            return Response(b"", status=499)  # nobody reads this; the client is gone
        except KVLoadError as exc:
            if not req.stream:
                raise
            # vLLM has sent 200 and its headers before a stream fails, so the error is an SSE event
            # of its chunked stream (an iterator: a list would get a Content-Length instead).
            return Response(_failed(framer, exc.envelope(), cut), headers=headers, content_type=SSE)
        ready = engine.clock() - arrival
        stats.first_token_seconds += ready
        headers["X-Engine-Prefill-Ms"] = f"{ready * 1000:.3f}"
        if req.stream:
            return Response(
                _stream(engine, turn, framer, req, cut, environ), headers=headers, content_type=SSE
            )
        return _body(engine, turn, framer, req, cut, headers)

    @app.post("/tokenize")
    def tokenize() -> Response:
        """vLLM's /tokenize: the prompt a chat or completions request would render, as token ids."""
        if engine.faults.down:
            raise Unavailable("emulated fault: down")
        stats.tokenize_requests += 1
        body = request.get_data()
        tokens = parse_tokenize(body, cfg.model, cfg.max_model_len, engine.template)
        reply = {
            "count": len(tokens),
            "max_model_len": cfg.max_model_len,
            "tokens": token_ids(tokens),
            "token_strs": tokens
            if b'"return_token_strs":true' in body.replace(b" ", b"")
            else None,
        }
        return _json(reply)

    def openai_call(kind: str) -> Callable[[bytes, str], Call]:
        return lambda raw, xid: chat_call(
            kind, raw, xid, cfg.model, cfg.max_model_len, engine.template, cfg.reasoning_field
        )

    @app.post("/v1/chat/completions")
    def chat_completions() -> Response:
        return serve(openai_call("chat"))

    @app.post("/v1/completions")
    def completions() -> Response:
        return serve(openai_call("completion"))

    @app.post("/v1/messages")
    def messages() -> Response:
        """vLLM's errors on this route are Anthropic's envelope, but for the route's own request
        validation (FastAPI's handler: vLLM's envelope)."""
        try:
            return serve(
                lambda raw, xid: messages_call(
                    raw, xid, cfg.model, cfg.max_model_len, engine.template
                )
            )
        except (MessagesError, ValidationError):
            raise
        except EngineError as exc:
            raise MessagesError(exc) from exc

    @app.post("/v1/messages/count_tokens")
    def messages_count_tokens() -> Response:
        return _json(
            count_tokens(request.get_data(), cfg.model, engine.template, engine.faults.down)
        )

    @app.post("/v1/responses")
    def create_response() -> Response:
        return serve(
            lambda raw, xid: responses_call(
                raw, responses_store, cfg.model, cfg.max_model_len, engine.template
            )
        )

    @app.get("/v1/responses/<response_id>")
    def retrieve_response(response_id: str) -> Response:
        if request.args.get("stream", "").lower() in ("true", "1"):
            # vLLM streams from its event store, which only background requests fill
            # (serving.py:1122-1175); the emulator runs none.
            raise NotImplementedByEmulator("GET /v1/responses/{id}?stream=true is not emulated")
        return _json(responses_store.get(response_id))

    @app.post("/v1/responses/<response_id>/cancel")
    def cancel_response(response_id: str) -> Response:
        return _json(responses_store.cancel(response_id))

    add_routes(app, engine)  # detokenize, ping, pooling, scoring, audio
    return app
