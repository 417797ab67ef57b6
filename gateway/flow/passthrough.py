"""vLLM's other client routes, passed to an engine of the request's model as they came: which
routes (`ROUTES`; docs/routes.md lists them beside those left closed, with vLLM's file:line),
which engine serves each, and the call, tried again on another engine before any byte, its
reply relayed as the engine sent it."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

from werkzeug.http import parse_options_header

from gateway.engines.instances import Instance, Pool
from gateway.engines.upstream import REPLY_LIMIT, Stream, Upstream
from gateway.flow.attempts import Work, attempt
from gateway.flow.model_pools import ModelPool, ModelPools
from gateway.flow.reply import Reply, relayed
from gateway.support import jsonio
from gateway.support.errors import BadGateway, BadRequest, GatewayError


@dataclass(frozen=True)
class Route:
    """One of vLLM's routes the gateway passes to an engine."""

    path: str
    method: str  # GET or POST
    # Which engine: "prefill" or "decode" of the request's model, "either" of them (the less
    # busy pool), or "any" engine of any model (the route says nothing of a model).
    role: str
    body: str  # "json", "form" (multipart/form-data), or "" (none)
    # Does the engine run the model for it? Its key is then charged the prompt tokens the
    # engine reports (usage.prompt_tokens); else nothing but the request.
    computes: bool
    source: str  # where vLLM 0.33.0 serves it


# The engine's response headers a client gets besides its status, Content-Type and body:
# `metadata`, the shapes of embeddings sent as bytes (encoding_format bytes; vLLM 0.33.0
# vllm/entrypoints/pooling/utils.py L185-204). Not the rest (its server, its own request id).
RELAYED = ("metadata",)
_POOLING = "vllm/entrypoints/pooling/"
ROUTES = (
    # The tokenizer, on the API server's CPU: any engine of the model, P or D.
    Route(
        "/tokenize",
        "POST",
        "either",
        "json",
        False,
        "vllm/entrypoints/serve/tokenize/api_router.py:35",
    ),
    Route(
        "/detokenize",
        "POST",
        "either",
        "json",
        False,
        "vllm/entrypoints/serve/tokenize/api_router.py:61",
    ),
    Route(
        "/tokenizer_info",
        "GET",
        "either",
        "",
        False,
        "vllm/entrypoints/serve/tokenize/api_router.py:90 (--enable-tokenizer-info-endpoint)",
    ),
    Route(
        "/v1/messages/count_tokens",
        "POST",
        "either",
        "json",
        False,
        "vllm/entrypoints/anthropic/api_router.py:90",
    ),
    Route("/version", "GET", "any", "", False, "vllm/entrypoints/serve/instrumentator/basic.py:53"),
    # A forward pass over the prompt, nothing decoded: prefill's kind of work, kept off D's
    # decode batches (vLLM serves these for a pooling model only).
    Route(
        "/v1/embeddings",
        "POST",
        "prefill",
        "json",
        True,
        _POOLING + "embed/api_router.py:28, token_embed/api_router.py:25",
    ),
    Route("/v2/embed", "POST", "prefill", "json", True, _POOLING + "embed/api_router.py:46"),
    Route("/pooling", "POST", "prefill", "json", True, _POOLING + "pooling/api_router.py:27"),
    Route("/classify", "POST", "prefill", "json", True, _POOLING + "classify/api_router.py:26"),
    Route("/score", "POST", "prefill", "json", True, _POOLING + "scoring/api_router.py:37"),
    Route("/v1/score", "POST", "prefill", "json", True, _POOLING + "scoring/api_router.py:52"),
    Route("/rerank", "POST", "prefill", "json", True, _POOLING + "scoring/api_router.py:69"),
    Route("/v1/rerank", "POST", "prefill", "json", True, _POOLING + "scoring/api_router.py:84"),
    Route("/v2/rerank", "POST", "prefill", "json", True, _POOLING + "scoring/api_router.py:102"),
    # A generation streamed to the client: D's work in vLLM's P/D.
    Route(
        "/v1/audio/transcriptions",
        "POST",
        "decode",
        "form",
        True,
        "vllm/entrypoints/speech_to_text/transcription/api_router.py:31",
    ),
    Route(
        "/v1/audio/translations",
        "POST",
        "decode",
        "form",
        True,
        "vllm/entrypoints/speech_to_text/translation/api_router.py:31",
    ),
)


def model_of(route: Route, raw: bytes, content_type: str) -> tuple[object, Callable[[str], bytes]]:
    """The model the request names (None if it names none), and how to write the request
    with another name in its place (an alias's model). A JSON body that is not an object is a
    400 here: the gateway reads its model to choose the engines."""
    if route.body == "json":
        try:
            body = jsonio.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"Request body is not valid JSON: {exc}"[:300]) from exc
        if not isinstance(body, dict):
            raise BadRequest("Request body must be a JSON object", param="body")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest("'model' must be a string", param="model")
        return model, lambda name: jsonio.dumps({**body, "model": name})
    if route.body == "form":
        found = form_field(raw, content_type, "model")
        if found is None:
            return None, lambda name: raw
        value, where = found
        return value, lambda name: raw[: where.start] + name.encode() + raw[where.stop :]
    return None, lambda name: raw


def form_field(raw: bytes, content_type: str, name: str) -> tuple[str, slice] | None:
    """The value of the multipart/form-data field `name` (not a file) and where its bytes are
    in `raw`; None if the body has no such field (or is not multipart)."""
    mimetype, options = parse_options_header(content_type)
    boundary = options.get("boundary")
    if mimetype != "multipart/form-data" or not boundary:
        return None
    delimiter = b"\r\n--" + boundary.encode("latin-1")
    position = raw.find(delimiter[2:])  # the first has no line break before it
    if position != 0:
        return None
    position += len(delimiter) - 2
    while raw[position : position + 2] == b"\r\n":  # "--" after a delimiter: the last
        head_end = raw.find(b"\r\n\r\n", position)
        end = raw.find(delimiter, head_end) if head_end != -1 else -1
        if end == -1:
            return None
        for line in raw[position + 2 : head_end].decode("latin-1").split("\r\n"):
            field, _, value = line.partition(":")
            if field.strip().lower() == "content-disposition":
                _, params = parse_options_header(value)
                if params.get("name") == name and "filename" not in params:
                    where = slice(head_end + 4, end)
                    return raw[where].decode("utf-8", "replace"), where
        position = end + len(delimiter)
    return None


def _least_busy(pools: list[Pool], now: float) -> Pool:
    """The pool whose least busy ready instance has the fewest requests in flight (a pool
    with none ready last)."""

    def load(pool: Pool) -> tuple[bool, int]:
        ready = [i.inflight for i in pool.instances if pool.ready(i) and i.available(now)]
        return (not ready, min(ready, default=0))

    return min(pools, key=load)


class PassThrough:
    """Sends a route's request to an engine and relays its reply."""

    def __init__(self, upstream: Upstream, pools: ModelPools, attempts: int) -> None:
        self.upstream = upstream
        self.pools = pools
        self.attempts = attempts

    def pool(self, route: Route, model: ModelPool) -> Pool:
        """The engines `route` goes to, for a request of `model`."""
        if route.role in ("prefill", "decode"):
            return model.prefill if route.role == "prefill" else model.decode
        both = (
            [model.prefill, model.decode]
            if route.role == "either"
            else [pool for each in self.pools.pools for pool in (each.prefill, each.decode)]
        )
        return _least_busy(both, time.monotonic())

    def run(
        self,
        route: Route,
        pool: Pool,
        target: str,
        raw: bytes,
        headers: dict,
        request_id: str,
        work: Work,
    ) -> Reply:
        """Send the request (`target`: its path and query) to an engine of `pool`, tried
        again on another before any byte reached the client; the reply as the engine answered
        it: a body read whole, an event stream relayed as it comes."""

        def call(instance: Instance, failure: GatewayError | None) -> tuple[Stream, bytes | None]:
            stream = self.upstream.relay(instance, route.method, target, raw, headers)
            if stream.content_type.startswith("text/event-stream"):
                return stream, None
            with ExitStack() as closing:  # read whole: a body cut short is tried again
                closing.callback(stream.close)
                body, size = [], 0
                for chunk in stream.chunks():
                    size += len(chunk)
                    if size > REPLY_LIMIT:
                        raise BadGateway(
                            f"{instance.name} sent a reply larger than {REPLY_LIMIT:,} bytes"
                        )
                    body.append(chunk)
            return stream, b"".join(body)

        instance, (stream, body) = attempt(
            pool, request_id, call, self.attempts, hold=True, work=work
        )
        work.done = True
        # Its key is charged what the engine computed: the prompt tokens it reports, or the
        # estimate where it reports none (a stream); nothing for the tokenizer's routes.
        work.prompt_tokens = None if route.computes else 0
        relayed_headers = {name: stream.headers[name] for name in RELAYED if name in stream.headers}
        if body is not None:
            pool.release(instance)
            if route.computes and stream.content_type.startswith("application/json"):
                work.prompt_tokens = _prompt_tokens(body)
            return Reply(
                headers=relayed_headers,
                body=body,
                status=stream.status,
                content_type=stream.content_type,
            )
        closing = ExitStack()
        closing.callback(pool.release, instance)
        closing.callback(stream.close)
        return Reply(
            headers={**relayed_headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            stream=relayed(stream, sse=True),
            status=stream.status,
            content_type=stream.content_type,
            close=closing.close,
        )


def _prompt_tokens(body: bytes) -> int | None:
    """The prompt tokens a JSON reply reports (usage.prompt_tokens), if it does."""
    try:
        usage = jsonio.loads_engine(body, exact=False).get("usage")
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    except (ValueError, AttributeError):
        return None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None
