"""HTTP to the engines: one `requests` session per process, JSON calls, open streams, and what
a failed call becomes (a `GatewayError`); the only module that calls `requests`."""
from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from typing import Any, Iterator

import requests
from requests.adapters import HTTPAdapter
from requests.auth import _basic_auth_str
from requests.models import PreparedRequest
from requests.structures import CaseInsensitiveDict
from urllib3 import Timeout
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError
from urllib3.exceptions import HTTPError as Urllib3Error
from urllib3.exceptions import ReadTimeoutError
from urllib3.util import parse_url

from gateway.engines.instances import Instance
from gateway.engines.transport import EnginePool, EngineResponse
from gateway.engines.watch import (NOT_WAITING, TrackedHTTPPool, TrackedHTTPSPool, Watch,
                                   current_watch)
from gateway.support import jsonio
from gateway.support.errors import (BadGateway, BadRequest, GatewayError, GatewayTimeout,
                                    ServiceUnavailable, UpstreamRejected, clip)

log = logging.getLogger(__name__)


class Stream:
    """An open streamed response from an engine; iterate its raw bytes, always `close()`."""

    def __init__(self, response: requests.Response | DirectReply, instance: Instance) -> None:
        self._response = response
        self.instance = instance
        self.status = response.status_code
        self.headers = response.headers
        self._watch = current_watch()
        self.content_type = response.headers.get("Content-Type", "text/event-stream")
        # The request's watch keeps the read timeout from here on, if it can (gateway.engines.watch).
        sock = getattr(response.raw.connection, "sock", None)
        timeout = sock.gettimeout() if sock is not None else None
        if timeout and self._watch is not None and self._watch.keep_quiet_limit(timeout,
                                                                                instance.name):
            sock.settimeout(None)   # the next request on this connection sets its own again

    def chunks(self) -> Iterator[bytes]:
        """Bytes as they arrive; `read1` returns whatever is buffered instead of filling a block."""
        raw = self._response.raw
        # http.client's response under urllib3's: urllib3's read1 adds a context manager and
        # four calls to every read, that is to every token (it decodes content encodings and
        # translates errors, which we need neither of: `identity` was asked for, errors are
        # translated below). At the end the connection goes back to the pool, as urllib3 would.
        fp = getattr(raw, "_fp", None)
        read1 = fp.read1 if hasattr(fp, "read1") else raw.read1
        watch = self._watch
        clock = time.monotonic
        try:
            while True:
                if watch is not None:
                    watch.heard_at = clock()     # silence counts while waiting for D's bytes,
                data = read1(65536)
                if watch is not None:
                    watch.heard_at = NOT_WAITING   # not while the client takes them
                if not data:
                    self._ended(fp, raw)
                    return
                yield data
        except (Urllib3Error, requests.RequestException, http.client.HTTPException, OSError,
                ValueError) as exc:
            self.close()        # at once: D computes the request until its connection closes
            raise _translate(exc, self.instance, self._watch) from exc

    def _ended(self, response, raw) -> None:  # type: ignore[no-untyped-def]
        """D's body has no more bytes: a cut (the watch's, or short of its Content-Length) is
        an error; a whole body gives its connection back to the pool."""
        cut = self._watch.error() if self._watch is not None else None
        if cut is not None:
            raise cut
        if getattr(response, "length", None):     # http.client: bytes still owed
            raise http.client.IncompleteRead(b"", response.length)
        if response is not None and hasattr(response, "close"):
            response.close()         # http.client's end of a response
        raw.release_conn()

    def close(self) -> None:
        self._response.close()     # releases the connection, untracked first (watch.TrackedPool)


def _caused_by(exc: BaseException, *types: type) -> bool:
    """Is `exc`, or anything it wraps, one of `types`? requests wraps urllib3's MaxRetryError
    (in args), which holds NewConnectionError (`reason`), raised from the OS error (`__cause__`)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, types):
            return True
        todo += [current.__cause__, current.__context__, getattr(current, "reason", None),
                 *(a for a in current.args if isinstance(a, BaseException))]
    return False


def _translate(exc: Exception, instance: Instance,
               watch: Watch | None = None) -> GatewayError:
    """The GatewayError for a failed engine call, by the exception's types, never its text."""
    cut = watch.error() if watch is not None else None
    if cut is not None:
        return cut
    log.warning("%s (%s) failed: %r", instance.name, instance.public_url, exc)
    if _caused_by(exc, ConnectionRefusedError):
        return ServiceUnavailable(f"{instance.name} refused the connection")
    # (urllib3's NewConnectionError, a connection not made for another reason, no route or no
    # such name, is a ConnectTimeoutError too: the engine never saw the request either way.)
    if _caused_by(exc, NewConnectionError):
        return ServiceUnavailable(f"{instance.name} could not be reached")
    if _caused_by(exc, requests.ConnectTimeout, ConnectTimeoutError):
        return ServiceUnavailable(f"{instance.name} did not accept a connection in time")
    if _caused_by(exc, requests.Timeout, ReadTimeoutError, TimeoutError, socket.timeout):
        return GatewayTimeout(f"{instance.name} timed out")
    return BadGateway(f"{instance.name} broke the connection")


def _error_message(response: requests.Response) -> str:
    """An engine's error message, as long as a message should be (it may echo a client's
    input whole: vLLM's "The model `...` does not exist"), from at most ERROR_LIMIT bytes of
    its body."""
    if not getattr(response, "_content_consumed", False):
        body = response.raw.read(ERROR_LIMIT + 1, decode_content=True)
        if len(body) > ERROR_LIMIT:          # more than a message: the rest is never read, so
            response.raw.close()             # the connection is closed, not pooled
            body = body[:ERROR_LIMIT]
        response._content, response._content_consumed = body, True
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return clip(message, 1000)
    except (ValueError, AttributeError):
        pass
    return clip(response.reason or f"HTTP {response.status_code}", 200)


class EngineAdapter(HTTPAdapter):
    """requests' adapter for the engine calls that go through requests (HTTPS engines, GETs,
    and every call while something patches `HTTPAdapter.send`), without what an engine call
    never needs.

    The hooks requests documents for subclasses (`get_connection*`, `request_url`,
    `build_response`), so `HTTPAdapter.send` itself still runs (and `responses` still mocks
    it): the pool comes from the pool manager by scheme, host and port parsed once per URL
    (not two URL parses and a proxy lookup a call); the path is the one the gateway asked for;
    the response keeps urllib3's case-insensitive headers as they are, and no cookie jar is
    filled (engines set none). Measured: about 300 Python calls less a call.
    """

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._pools: dict[str, Any] = {}

    def _pool(self, url: str):  # type: ignore[no-untyped-def]
        # The pool manager's own lookup builds a 30-field pool key each call (measured: 20 us
        # a call, two a turn); a pool it has since closed (its LRU, past `hosts` pools) is
        # looked up again.
        origin = _origin(url)
        pool = self._pools.get(origin)
        if pool is None or pool.pool is None:
            parsed = parse_url(origin)
            pool = self._pools[origin] = self.poolmanager.connection_from_host(
                parsed.host, parsed.port, parsed.scheme or "http")
            if len(self._pools) > 1024:         # engines come and go: keep it bounded
                self._pools = {origin: pool}
        return pool

    def get_connection_with_tls_context(self, request, verify, proxies=None, cert=None):  # type: ignore[no-untyped-def]  # noqa: E501
        return self._pool(request.url)

    def get_connection(self, url, proxies=None):  # type: ignore[no-untyped-def]
        return self._pool(url)              # requests before 2.32 calls this one

    def request_url(self, request, proxies):  # type: ignore[no-untyped-def]
        return getattr(request, "pd_path", None) or super().request_url(request, proxies)

    def build_response(self, req, resp):  # type: ignore[no-untyped-def]
        response = requests.Response()
        response.status_code = resp.status
        response.headers = resp.headers
        response.raw = resp
        response.reason = resp.reason
        response.url = req.url
        response.request = req
        response.connection = self
        return response


def _adapter_patched() -> bool:
    """Does something stand in for requests' `HTTPAdapter.send` (`responses`, a tracer)?"""
    return HTTPAdapter.send.__module__ != "requests.adapters"


def _origin(url: str) -> str:
    return url[:url.find("/", url.find("//") + 2) % (len(url) + 1)]


class DirectReply:
    """An engine's reply to a POST made on `EnginePool` without requests: what the gateway reads
    of a `requests.Response` (status, reason, headers, the raw response, the body once read)."""

    def __init__(self, raw: EngineResponse) -> None:
        self.raw = raw
        self.status_code = raw.status
        self.reason = raw.reason
        self.headers = raw.headers
        self._content: bytes | None = None

    @property
    def content(self) -> bytes:
        """The whole body (read now if it was not)."""
        if self._content is None:
            self._content = self.raw.read()
        return self._content

    def json(self) -> Any:
        """The body's JSON (an error's message, say), in UTF-8, -16 or -32 as requests reads it,
        or else as Latin-1 (requests would guess its charset)."""
        try:
            return jsonio.loads_engine(self.content, exact=False)
        except UnicodeDecodeError:
            return json.loads(self.content.decode("latin-1"))

    def close(self) -> None:
        self.raw.close()        # a whole body gave its connection back already


# What an engine's replies may weigh: a page (/metrics, /v1/models: vLLM's are tens of KB) and
# an answer to a POST (P's, /tokenize's, a whole reply of D's with its token ids: what a context
# of a million tokens takes); beyond, the call fails. Read whole, an engine's reply of any size
# was the gateway's memory (a 150 MB /metrics page took a worker to ~790 MB).
HEALTH_LIMIT = 64 * 1024
ERROR_LIMIT = 1024 * 1024
PAGE_LIMIT = 8 * 1024 * 1024
REPLY_LIMIT = 64 * 1024 * 1024
READ_CHUNK = 64 * 1024


class EngineReplyTooLarge(requests.RequestException):
    """An engine's reply beyond what the gateway reads of one."""


class Upstream:
    """One `requests.Session` per process (created after fork) for all calls to the engines."""

    def __init__(self, connect_timeout: float, read_timeout: float, pool_size: int,
                 api_key: str = "", hosts: int = 16) -> None:
        self.session = requests.Session()
        # No proxy or .netrc lookup per call: with trust_env, requests scans os.environ and
        # stats ~/.netrc for every request (measured: about 1.3 ms of CPU per turn). Engines
        # are reached directly.
        self.session.trust_env = False
        # pool_block=False: a burst above pool_size opens extra connections instead of
        # waiting forever (requests passes no pool timeout).
        # One connection pool per engine and per worker listener (forwarding): fewer cached
        # pools than hosts would close and reopen connections all the time.
        adapter = EngineAdapter(pool_connections=max(hosts, 1), pool_maxsize=pool_size,
                                max_retries=0, pool_block=False)
        self._engine_pools: dict[str, EnginePool] = {}    # the direct POSTs' (transport.py)
        self._pool_size = pool_size
        adapter.poolmanager.pool_classes_by_scheme = {"http": TrackedHTTPPool,
                                                      "https": TrackedHTTPSPool}
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._adapter = adapter
        self.timeout = (connect_timeout, read_timeout)
        self._timeout = Timeout(connect=connect_timeout, read=read_timeout)
        self.api_key = api_key
        # The GETs' bodies as the POSTs' are: not compressed (their size is read as it comes).
        self.session.headers["Accept-Encoding"] = "identity"
        if api_key:
            # The GETs (probes, /v1/models, /metrics) carry it too: vLLM's --api-key guards
            # every /v1 path, GET /v1/models among them (vLLM 0.33.0
            # entrypoints/serve/middleware/authenticate.py ~L11, ~L59). POSTs set their own.
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def close(self) -> None:
        """Close every kept connection (requests' pools and the direct POSTs')."""
        self.session.close()
        for pool in list(self._engine_pools.values()):
            pool.close()

    def headers(self, request_id: str, authorization: str | None, traceparent: str = "",
                tracestate: str | None = None) -> dict[str, str]:
        """Headers for the engine calls (request id, W3C trace context, credential); a client
        credential requests can't send is a 400."""
        out = {"X-Request-Id": request_id, "Accept-Encoding": "identity"}
        if traceparent:
            out["traceparent"] = traceparent
            if tracestate and len(tracestate) <= 512 and tracestate.isprintable():
                out["tracestate"] = tracestate
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        elif authorization:
            try:
                requests.utils.check_header_validity(("Authorization", authorization))
            except requests.exceptions.InvalidHeader as exc:
                raise BadRequest("The Authorization header has characters that cannot be "
                                 "forwarded", param="Authorization") from exc
            out["Authorization"] = authorization
        return out

    def _engine_pool(self, url: str) -> EnginePool:
        origin = _origin(url)
        pool = self._engine_pools.get(origin)
        if pool is None:
            parsed = parse_url(origin)
            if len(self._engine_pools) >= 1024:   # engines come and go: keep it bounded
                old, self._engine_pools = self._engine_pools, {}   # (other threads read it)
                for each in list(old.values()):
                    each.close()
            # An IPv6 host without its brackets: http.client keeps them when given a port.
            pool = self._engine_pools[origin] = EnginePool(parsed.host.strip("[]"),
                                                           parsed.port or 80, self._pool_size)
        return pool

    def _send(self, instance: Instance, path: str, body: bytes, headers: dict,
              stream: bool, timeout: Timeout | None = None,
              method: str = "POST") -> requests.Response | DirectReply:
        """POST `body` (or another `method`), whatever the reply's status; raise a GatewayError
        if it failed.

        To a plain-HTTP engine, on a connection of the gateway's own pool (gateway.engines.
        transport): requests' layers (the Session's settings, cookies, hooks and redirects, the
        adapter's certificate, proxy and timeout handling, its request and response objects) do
        nothing for an engine call; measured with `python -m bench.engine_call`. Through
        requests' adapter for HTTPS engines, and whenever something patches `HTTPAdapter.send`:
        `responses`, which the payload tests pin every call with, sees every call as before.
        """
        headers = {**headers, "Content-Length": str(len(body))}
        if instance.credentials:      # user:password in the URL, as requests sends them
            headers["Authorization"] = _basic_auth_str(*instance.credentials)
        try:
            if instance.url.startswith("http://") and not _adapter_patched():
                response: requests.Response | DirectReply = DirectReply(
                    self._engine_pool(instance.url).urlopen(
                        method, instance.base_path + path, body, headers,
                        timeout or self._timeout))
            else:
                response = self._adapter_send(instance, path, body, headers, stream, timeout,
                                              method)
            if not stream:
                # Read whole, as Session.send does (the connection returns to its pool), in
                # one read: requests' `content` reads through a generator of 10 KB chunks
                # (measured: 40 us a P call). One byte more than may come says it was more.
                content = response.raw.read(REPLY_LIMIT + 1, decode_content=True)
                if len(content) > REPLY_LIMIT:
                    response.raw.close()
                    raise BadGateway(f"{instance.name} sent a reply larger than "
                                     f"{REPLY_LIMIT:,} bytes")
                response._content = content
                response._content_consumed = True
        # urllib3's own errors: the body read above is urllib3's (requests would wrap them);
        # ValueError: a bad header.
        # http.client's own (a bad status line, a header line too long: engine calls go over
        # http.client connections, gateway.engines.transport, which nothing wraps).
        # OSError: a body that breaks off or times out there (http.client raises the socket's).
        except (requests.RequestException, Urllib3Error, http.client.HTTPException, OSError,
                ValueError) as exc:
            raise _translate(exc, instance, current_watch()) from exc
        return response

    def _adapter_send(self, instance: Instance, path: str, body: bytes, headers: dict,
                      stream: bool, timeout: Timeout | None,
                      method: str = "POST") -> requests.Response:
        """Straight to `HTTPAdapter.send`, with the request prepared here: the Session's layers
        (merging settings, cookies, hooks, redirects) do nothing for an engine call and cost
        about 0.4 ms of CPU each (measured: 1.5 -> 1.1 ms a call)."""
        request = PreparedRequest()
        request.method = method
        request.url = instance.url + path
        # The path the engine is asked for (EngineAdapter.request_url), after its URL's own.
        request.pd_path = instance.base_path + path   # type: ignore[attr-defined]
        request.headers = CaseInsensitiveDict(headers)
        request.body = body
        return self._adapter.send(request, stream=stream, timeout=timeout or self._timeout)

    def _post(self, instance: Instance, path: str, body: dict, headers: dict,
              stream: bool, timeout: Timeout | None = None) -> requests.Response | DirectReply:
        response = self._send(instance, path, jsonio.dumps(body),
                              {**headers, "Content-Type": "application/json"}, stream, timeout)
        return self._unless_failed(instance, response)

    def _unless_failed(self, instance: Instance, response: requests.Response | DirectReply,
                       relay: bool = False) -> requests.Response | DirectReply:
        """The response, unless its status is an error: a 4xx raises UpstreamRejected with the
        engine's message, a 5xx BadGateway. With `relay`, a 4xx and a 501 (vLLM's answer to
        an API its model does not serve) are the engine's answer, returned as they came."""
        status = response.status_code
        if status >= 400 and not (relay and (status < 500 or status == 501)):
            try:
                message = _error_message(response)
            except (requests.RequestException, Urllib3Error, http.client.HTTPException,
                    OSError) as exc:
                raise _translate(exc, instance, current_watch()) from exc
            finally:
                response.close()
            log.warning("%s answered %d: %s", instance.name, response.status_code, message)
            if response.status_code < 500:
                raise UpstreamRejected(message, status=response.status_code)
            # An engine's own 5xx message may name hosts, ports or engine ids: logged, not sent.
            raise BadGateway(f"{instance.name} failed with HTTP {response.status_code}")
        return response

    def post_json(self, instance: Instance, path: str, body: dict, headers: dict,
                  read_timeout: float | None = None) -> dict:
        """POST and parse a JSON object reply, or raise a GatewayError; `read_timeout` instead
        of --read-timeout for a call that should never take long."""
        timeout = None if read_timeout is None else Timeout(connect=self.timeout[0],
                                                            read=read_timeout)
        response = self._post(instance, path, body, headers, stream=False, timeout=timeout)
        try:
            reply = jsonio.loads_engine(response.content)
        except ValueError as exc:
            raise BadGateway(f"{instance.name} sent a reply that is not JSON") from exc
        if not isinstance(reply, dict):
            raise BadGateway(f"{instance.name} sent a reply that is not a JSON object")
        return reply

    def tokenize(self, instance: Instance, body: dict, headers: dict) -> list:
        """The token ids of the prompt `body` renders to (vLLM's POST /tokenize)."""
        tokens = self.post_json(instance, "/tokenize", body, headers).get("tokens")
        if not isinstance(tokens, list):
            raise BadGateway(f"{instance.name} sent a /tokenize reply without tokens")
        return tokens

    def open_stream(self, instance: Instance, path: str, body: dict, headers: dict) -> Stream:
        """POST and return the open response once its headers arrived, or raise a GatewayError."""
        return Stream(self._post(instance, path, body, headers, stream=True), instance)

    def post_raw(self, instance: Instance, path: str, raw: bytes, headers: dict) -> Stream:
        """POST the client's bytes unchanged and return the open response, whatever its status."""
        return Stream(self._send(instance, path, raw, headers, stream=True), instance)

    def relay(self, instance: Instance, method: str, path: str, raw: bytes,
              headers: dict) -> Stream:
        """Send the client's request as it came (its bytes, `headers` beside the gateway's)
        and return the open response, an engine's refusal (4xx, 501) among them; an engine
        that failed (another 5xx, or no answer) raises a GatewayError, as any call."""
        return Stream(self._unless_failed(
            instance, self._send(instance, path, raw, headers, stream=True, method=method),
            relay=True), instance)

    def _get(self, instance: Instance, path: str, timeout: float, limit: int) -> bytes:
        """GET `path`'s body, answered 200: each read within `timeout` and no read begun after
        it has passed since the call began (a reply that trickles is cut, as a slow one is), at
        most `limit` bytes once decoded, no redirect followed (an engine answers where it is; a
        redirect would take the gateway wherever the answer says). Raises requests' errors, an
        error status or a redirect among them."""
        deadline = time.monotonic() + timeout
        with self.session.get(instance.url + path, timeout=(min(self.timeout[0], timeout),
                                                            timeout),
                              allow_redirects=False, stream=True) as response:
            response.raise_for_status()
            if response.status_code != 200:     # a redirect among them: never followed
                raise requests.HTTPError(f"{response.status_code}, not 200", response=response)
            chunks, size = [], 0
            while True:
                try:
                    # read1: what has come, at once (read(n) would wait for n bytes); decoded,
                    # a call's output capped at its size (urllib3 2.x).
                    chunk = response.raw.read1(READ_CHUNK, decode_content=True)
                except (Urllib3Error, http.client.HTTPException, OSError) as exc:
                    raise requests.ConnectionError(str(exc)) from exc
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > limit:
                    raise EngineReplyTooLarge(f"{instance.name}'s {path} is larger than "
                                              f"{limit:,} bytes")
                if time.monotonic() > deadline:
                    raise requests.Timeout(f"{instance.name}'s {path} took longer than "
                                           f"{timeout:g} s")
                chunks.append(chunk)

    def probe(self, instance: Instance, timeout: float = 1.0) -> bool:
        """Does the instance answer GET /health with 200?"""
        try:
            self._get(instance, "/health", timeout, HEALTH_LIMIT)
            return True
        except requests.RequestException:
            return False

    def served_models(self, instance: Instance, timeout: float = 5.0) -> list[str] | None:
        """The model ids the instance's GET /v1/models lists; None if it did not answer so."""
        try:
            data = jsonio.loads_engine(self._get(instance, "/v1/models", timeout,
                                                 PAGE_LIMIT)).get("data")
        except (requests.RequestException, ValueError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]

    def get_bytes(self, instance: Instance, path: str, timeout: float) -> bytes:
        """GET `path`'s body, bounded as `_get` (raises requests' errors; for background
        reads, not requests)."""
        return self._get(instance, path, timeout, PAGE_LIMIT)

    def get_json(self, instance: Instance, path: str, read_timeout: float | None = None) -> dict:
        try:
            reply = jsonio.loads_engine(self._get(instance, path,
                                                  read_timeout or self.timeout[1], PAGE_LIMIT))
        except (requests.RequestException, ValueError) as exc:
            raise BadGateway(f"{instance.name} did not answer {path}") from exc
        if not isinstance(reply, dict):
            raise BadGateway(f"{instance.name} did not answer {path} with a JSON object")
        return reply
