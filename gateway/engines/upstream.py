"""HTTP to the engines: what each engine call sends and reads (JSON calls, open streams, pages
read by GET) and what a failed call becomes (a `GatewayError`), over one transport
(gateway.engines.transport), which tests replace."""

from __future__ import annotations

import base64
import http.client
import json
import logging
import re
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any

from gateway.engines.instances import Instance
from gateway.engines.transport import (
    ConnectFailed,
    ConnectTimedOut,
    EngineResponse,
    EngineTransport,
    Timeouts,
    Transport,
)
from gateway.engines.watch import NOT_WAITING, Watch, current_watch
from gateway.support import jsonio
from gateway.support.errors import (
    BadGateway,
    BadRequest,
    GatewayError,
    GatewayTimeout,
    ServiceUnavailable,
    UpstreamRejected,
    clip,
)

log = logging.getLogger(__name__)

# What an engine call may fail with below the gateway: the OS's errors (a connection not made,
# reset, timed out: ssl's among them), http.client's (a bad status line, a head past its
# limits, a body short of its length) and ValueError (a header value http.client refuses).
CALL_ERRORS = (http.client.HTTPException, OSError, ValueError)


class Stream:
    """An open streamed response from an engine; iterate its raw bytes, always `close()`."""

    def __init__(self, response: EngineResponse, instance: Instance) -> None:
        self._response = response
        self.instance = instance
        self.status = response.status
        self.headers = response.headers
        self._watch = current_watch()
        self.content_type = response.headers.get("Content-Type", "text/event-stream")
        # The request's watch keeps the read timeout from here on, if it can (engines.watch).
        sock = response.sock
        timeout = sock.gettimeout() if sock is not None else None
        if (
            timeout
            and sock is not None  # as `timeout` says: mypy's narrowing
            and self._watch is not None
            and self._watch.keep_quiet_limit(timeout, instance.name)
        ):
            sock.settimeout(None)  # the next request on this connection sets its own again

    def chunks(self) -> Iterator[bytes]:
        """Bytes as they arrive; `read1` returns whatever is buffered instead of filling a block."""
        read1 = self._response.read1
        watch = self._watch
        clock = time.monotonic
        try:
            while True:
                if watch is not None:
                    watch.heard_at = clock()  # silence counts while waiting for D's bytes,
                data = read1(65536)
                if watch is not None:
                    watch.heard_at = NOT_WAITING  # not while the client takes them
                if not data:
                    self._ended()
                    return
                yield data
        except CALL_ERRORS as exc:
            self.close()  # at once: D computes the request until its connection closes
            raise _translate(exc, self.instance, self._watch) from exc

    def _ended(self) -> None:
        """D's body has no more bytes: a cut (the watch's) is an error; else its end."""
        cut = self._watch.error() if self._watch is not None else None
        if cut is not None:
            raise cut
        self._response.finish()

    def close(self) -> None:
        self._response.close()  # its connection closed, untracked first (EnginePool.put)


def _caused_by(exc: BaseException, *types: type) -> bool:
    """Is `exc`, or anything it wraps, one of `types`? A connection not made is raised from
    the OS's error (`__cause__`); a test's transport may wrap one the same way."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, types):
            return True
        todo += [
            current.__cause__,
            current.__context__,
            *(a for a in current.args if isinstance(a, BaseException)),
        ]
    return False


def _translate(exc: Exception, instance: Instance, watch: Watch | None = None) -> GatewayError:
    """The GatewayError for a failed engine call, by the exception's types, never its text."""
    cut = watch.error() if watch is not None else None
    if cut is not None:
        return cut
    log.warning("%s (%s) failed: %r", instance.name, instance.public_url, exc)
    if _caused_by(exc, ConnectionRefusedError):
        return ServiceUnavailable(f"{instance.name} refused the connection")
    if _caused_by(exc, ConnectTimedOut):
        return ServiceUnavailable(f"{instance.name} did not accept a connection in time")
    # Not made for another reason (no route, no such name): the engine never saw the request.
    if _caused_by(exc, ConnectFailed):
        return ServiceUnavailable(f"{instance.name} could not be reached")
    if _caused_by(exc, TimeoutError, socket.timeout):
        return GatewayTimeout(f"{instance.name} timed out")
    return BadGateway(f"{instance.name} broke the connection")


def _reply_json(content: bytes) -> Any:
    """A reply's JSON (an error's message, say), in UTF-8, -16 or -32, or else as Latin-1 (what
    requests' guess of its charset gave)."""
    try:
        return jsonio.loads_engine(content, exact=False)
    except UnicodeDecodeError:
        return json.loads(content.decode("latin-1"))


def _error_message(response: EngineResponse) -> str:
    """An engine's error message, as long as a message should be (it may echo a client's
    input whole: vLLM's "The model `...` does not exist"), from at most ERROR_LIMIT bytes of
    its body."""
    if response.content is None:
        body = response.read(ERROR_LIMIT + 1)
        if len(body) > ERROR_LIMIT:  # more than a message: the rest is never read, so
            response.close()  # the connection is closed, not pooled
            body = body[:ERROR_LIMIT]
        response.content = body
    try:
        error = _reply_json(response.content).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return clip(message, 1000)
    except (ValueError, AttributeError):
        pass
    return clip(response.reason or f"HTTP {response.status}", 200)


def _basic_auth(user: str, password: str) -> str:
    """user:password in an engine's URL, as requests sent them (Latin-1, base64)."""
    pair = f"{user}:{password}".encode("latin-1")
    return "Basic " + base64.b64encode(pair).decode("ascii")


# A client's credential the gateway forwards: one line, no leading blank (requests' rule for a
# header value, which the engine calls kept).
_FORWARDABLE = re.compile(r"\S[^\r\n]*|")

# What an engine's replies may weigh: a page (/metrics, /v1/models: vLLM's are tens of KB) and
# an answer to a POST (P's, /tokenize's, a whole reply of D's with its token ids: what a context
# of a million tokens takes); beyond, the call fails. Read whole, an engine's reply of any size
# was the gateway's memory, several times over (docs/BENCHMARKS.md, "The figures behind
# smaller choices").
HEALTH_LIMIT = 64 * 1024
ERROR_LIMIT = 1024 * 1024
PAGE_LIMIT = 8 * 1024 * 1024
REPLY_LIMIT = 64 * 1024 * 1024
READ_CHUNK = 64 * 1024


class EngineGetFailed(Exception):
    """A GET of an engine's page that did not answer 200 with a body within its time and size
    (`Upstream.get_bytes`)."""


class EngineReplyTooLarge(EngineGetFailed):
    """An engine's page beyond what the gateway reads of one."""


def _decoder(encoding: str | None):
    """A page's content decoding (`decompress(data, max_length)`), None for `identity`: an
    engine, or a proxy before it, may compress a page whatever it was asked."""
    encoding = (encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib's header (or gzip's)
    raise EngineGetFailed(f"a page in {encoding}, which the gateway does not decode")


class Upstream:
    """Every call to the engines of one process, over its transport (one per process, created
    after fork: gateway.engines.transport.Transport, unless given another)."""

    def __init__(
        self,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
        api_key: str = "",
        transport: EngineTransport | None = None,
    ) -> None:
        # One pool per engine, `pool_size` connections kept in each; a burst above it opens
        # extra connections instead of waiting.
        self.transport = transport if transport is not None else Transport(pool_size)
        self.timeout: tuple[float, float] = (connect_timeout, read_timeout)
        self.api_key = api_key
        # The GETs' bodies as the POSTs' are: not compressed (their size is read as it comes).
        self._get_headers = {"Accept-Encoding": "identity"}
        if api_key:
            # The GETs (probes, /v1/models, /metrics) carry it too: vLLM's --api-key guards
            # every /v1 path, GET /v1/models among them (vLLM 0.33.0
            # entrypoints/serve/middleware/authenticate.py ~L11, ~L59). POSTs set their own.
            self._get_headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        """Close every kept connection."""
        self.transport.close()

    def headers(
        self,
        request_id: str,
        authorization: str | None,
        traceparent: str = "",
        tracestate: str | None = None,
    ) -> dict[str, str]:
        """Headers for the engine calls (request id, W3C trace context, credential); a client
        credential that cannot be sent on is a 400."""
        out = {"X-Request-Id": request_id, "Accept-Encoding": "identity"}
        if traceparent:
            out["traceparent"] = traceparent
            if tracestate and len(tracestate) <= 512 and tracestate.isprintable():
                out["tracestate"] = tracestate
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        elif authorization:
            if not _FORWARDABLE.fullmatch(authorization):
                raise BadRequest(
                    "The Authorization header has characters that cannot be forwarded",
                    param="Authorization",
                )
            out["Authorization"] = authorization
        return out

    def _send(
        self,
        instance: Instance,
        path: str,
        body: bytes,
        headers: dict,
        stream: bool,
        timeout: Timeouts | None = None,
        method: str = "POST",
    ) -> EngineResponse:
        """POST `body` (or another `method`), whatever the reply's status; raise a GatewayError
        if it failed. Not `stream`: the body is read whole (`content`)."""
        headers = {**headers, "Content-Length": str(len(body))}
        if instance.credentials:  # user:password in the URL, as requests sent them
            headers["Authorization"] = _basic_auth(*instance.credentials)
        try:
            response = self.transport.send(
                instance, method, path, body, headers, timeout or self.timeout
            )
            if not stream:
                # In one read; one byte more than may come says it was more.
                content = response.read(REPLY_LIMIT + 1)
                if len(content) > REPLY_LIMIT:
                    response.close()
                    raise BadGateway(
                        f"{instance.name} sent a reply larger than {REPLY_LIMIT:,} bytes"
                    )
                response.content = content
        except CALL_ERRORS as exc:
            raise _translate(exc, instance, current_watch()) from exc
        return response

    def _post(
        self,
        instance: Instance,
        path: str,
        body: dict,
        headers: dict,
        stream: bool,
        timeout: Timeouts | None = None,
    ) -> EngineResponse:
        response = self._send(
            instance,
            path,
            jsonio.dumps(body),
            {**headers, "Content-Type": "application/json"},
            stream,
            timeout,
        )
        return self._unless_failed(instance, response)

    def _unless_failed(
        self, instance: Instance, response: EngineResponse, relay: bool = False
    ) -> EngineResponse:
        """The response, unless its status is an error: a 4xx raises UpstreamRejected with the
        engine's message, a 5xx BadGateway. With `relay`, a 4xx and a 501 (vLLM's answer to
        an API its model does not serve) are the engine's answer, returned as they came."""
        status = response.status
        if status >= 400 and not (relay and (status < 500 or status == 501)):
            try:
                message = _error_message(response)
            except CALL_ERRORS as exc:
                raise _translate(exc, instance, current_watch()) from exc
            finally:
                response.close()
            log.warning("%s answered %d: %s", instance.name, status, message)
            if status < 500:
                raise UpstreamRejected(message, status=status)
            # An engine's own 5xx message may name hosts, ports or engine ids: logged, not sent.
            raise BadGateway(f"{instance.name} failed with HTTP {status}")
        return response

    def post_json(
        self,
        instance: Instance,
        path: str,
        body: dict,
        headers: dict,
        read_timeout: float | None = None,
    ) -> dict:
        """POST and parse a JSON object reply, or raise a GatewayError; `read_timeout` instead
        of --read-timeout for a call that should never take long."""
        timeout = None if read_timeout is None else (self.timeout[0], read_timeout)
        response = self._post(instance, path, body, headers, stream=False, timeout=timeout)
        assert response.content is not None  # not a stream: `_send` read it whole
        try:
            reply = jsonio.loads_engine(response.content)
        except ValueError as exc:
            raise BadGateway(f"{instance.name} sent a reply that is not JSON") from exc
        if not isinstance(reply, dict):
            raise BadGateway(f"{instance.name} sent a reply that is not a JSON object")
        return reply

    def tokenize(
        self, instance: Instance, body: dict, headers: dict, read_timeout: float | None = None
    ) -> list:
        """The token ids of the prompt `body` renders to (vLLM's POST /tokenize); `read_timeout`
        as `post_json`'s."""
        tokens = self.post_json(instance, "/tokenize", body, headers, read_timeout).get("tokens")
        if not isinstance(tokens, list):
            raise BadGateway(f"{instance.name} sent a /tokenize reply without tokens")
        return tokens

    def open_stream(self, instance: Instance, path: str, body: dict, headers: dict) -> Stream:
        """POST and return the open response once its headers arrived, or raise a GatewayError."""
        return Stream(self._post(instance, path, body, headers, stream=True), instance)

    def post_raw(self, instance: Instance, path: str, raw: bytes, headers: dict) -> Stream:
        """POST the client's bytes unchanged and return the open response, whatever its status."""
        return Stream(self._send(instance, path, raw, headers, stream=True), instance)

    def relay(
        self, instance: Instance, method: str, path: str, raw: bytes, headers: dict
    ) -> Stream:
        """Send the client's request as it came (its bytes, `headers` beside the gateway's)
        and return the open response, an engine's refusal (4xx, 501) among them; an engine
        that failed (another 5xx, or no answer) raises a GatewayError, as any call."""
        return Stream(
            self._unless_failed(
                instance,
                self._send(instance, path, raw, headers, stream=True, method=method),
                relay=True,
            ),
            instance,
        )

    def _get(self, instance: Instance, path: str, timeout: float, limit: int) -> bytes:
        """GET `path`'s body, answered 200: each read within `timeout` and no read begun after
        it has passed since the call began (a reply that trickles is cut, as a slow one is), at
        most `limit` bytes once decoded, no redirect followed (an engine answers where it is; a
        redirect would take the gateway wherever the answer says). Raises EngineGetFailed."""
        deadline = time.monotonic() + timeout
        headers = self._get_headers
        if instance.credentials:
            headers = {**headers, "Authorization": _basic_auth(*instance.credentials)}
        try:
            response = self.transport.send(
                instance, "GET", path, None, headers, (min(self.timeout[0], timeout), timeout)
            )
        except CALL_ERRORS as exc:
            raise EngineGetFailed(f"{instance.name}'s {path}: {exc!r}") from exc
        try:
            if response.status != 200:  # a redirect among them: never followed
                raise EngineGetFailed(f"{instance.name}'s {path} answered {response.status}")
            decoder = _decoder(response.headers.get("Content-Encoding"))
            chunks: list[bytes] = []
            size = 0
            while True:
                # read1: what has come, at once (read(n) would wait for n bytes)
                chunk = response.read1(READ_CHUNK)
                if not chunk:
                    response.finish()
                    return b"".join(chunks)
                if decoder is not None:  # decoded, a read's output capped at what is left
                    chunk = decoder.decompress(chunk, limit + 1 - size)
                    if decoder.unconsumed_tail:
                        size = limit  # more than is left: too large below
                size += len(chunk)
                if size > limit:
                    raise EngineReplyTooLarge(
                        f"{instance.name}'s {path} is larger than {limit:,} bytes"
                    )
                if time.monotonic() > deadline:
                    raise EngineGetFailed(
                        f"{instance.name}'s {path} took longer than {timeout:g} s"
                    )
                chunks.append(chunk)
        except (*CALL_ERRORS, zlib.error) as exc:
            raise EngineGetFailed(f"{instance.name}'s {path}: {exc!r}") from exc
        finally:
            response.close()  # a whole body gave its connection back already

    def probe(self, instance: Instance, timeout: float = 1.0) -> bool:
        """Does the instance answer GET /health with 200?"""
        try:
            self._get(instance, "/health", timeout, HEALTH_LIMIT)
            return True
        except EngineGetFailed:
            return False

    def served_models(self, instance: Instance, timeout: float = 5.0) -> list[str] | None:
        """The model ids the instance's GET /v1/models lists; None if it did not answer so."""
        try:
            data = jsonio.loads_engine(self._get(instance, "/v1/models", timeout, PAGE_LIMIT)).get(
                "data"
            )
        except (EngineGetFailed, ValueError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def get_bytes(self, instance: Instance, path: str, timeout: float) -> bytes:
        """GET `path`'s body, bounded as `_get` (raises EngineGetFailed; for background
        reads, not requests)."""
        return self._get(instance, path, timeout, PAGE_LIMIT)

    def get_json(self, instance: Instance, path: str, read_timeout: float | None = None) -> dict:
        try:
            reply = jsonio.loads_engine(
                self._get(instance, path, read_timeout or self.timeout[1], PAGE_LIMIT)
            )
        except (EngineGetFailed, ValueError) as exc:
            raise BadGateway(f"{instance.name} did not answer {path}") from exc
        if not isinstance(reply, dict):
            raise BadGateway(f"{instance.name} did not answer {path} with a JSON object")
        return reply
