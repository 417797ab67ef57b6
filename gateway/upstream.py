"""P and D instance pools and the HTTP calls to them; the only module that knows `requests`."""
from __future__ import annotations

import contextvars
import hashlib
import itertools
import json
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, ReadTimeoutError
from urllib3.exceptions import HTTPError as Urllib3Error

from .errors import (BadGateway, BadRequest, ClientGone, GatewayError, GatewayTimeout,
                     ServiceUnavailable, UpstreamRejected)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    """How a pool chooses and when it stops choosing an instance."""

    routing: str = "affinity"        # "affinity" (rendezvous + preferred D) or "round_robin"
    overload_factor: float = 2.0     # skip an instance whose in-flight > factor x (least + 1)
    breaker_failures: int = 3        # consecutive failures that open the breaker
    breaker_cooldown: float = 10.0   # seconds an open breaker skips the instance


@dataclass(eq=False)
class Instance:
    """One engine and what this process knows of it.

    `name` (e.g. "prefill[0]") is what clients may see; the URL stays inside the gateway.
    """

    url: str
    role: str
    index: int
    host: str = field(init=False)
    salt: bytes = field(init=False)
    inflight: int = 0
    down: bool = False          # a connection failed: skipped until a /health probe answers
    failures: int = 0           # consecutive failed requests
    open_until: float = 0.0     # breaker: skipped until then, then tried again (half-open)

    def __post_init__(self) -> None:
        self.host = urlsplit(self.url).hostname or ""
        self.salt = self.url.encode()

    @property
    def name(self) -> str:
        return f"{self.role}[{self.index}]"

    def available(self, now: float) -> bool:
        return not self.down and now >= self.open_until

    def state(self, now: float) -> str:
        if self.down:
            return "down"
        if now < self.open_until:
            return "open"
        # Cooled down but not yet proven: the next failure opens it again at once.
        return "half-open" if self.open_until else "up"


def _weight(key: bytes, instance: Instance) -> bytes:
    return hashlib.blake2b(key, digest_size=8, key=instance.salt[-64:]).digest()


class Pool:
    """The instances of one role: health, in-flight counts, breakers, and the choice between them."""

    def __init__(self, role: str, urls: list[str], policy: Policy = Policy(),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.role = role
        self.policy = policy
        self.instances = [Instance(url, role, i) for i, url in enumerate(urls)]
        self._by_url = {i.url: i for i in self.instances}
        self._next = itertools.cycle(self.instances)
        self._lock = threading.Lock()
        self._clock = clock
        self.on_down: Callable[[], None] | None = None   # wakes the prober

    def choose(self, key: str, prefer: str | None = None,
               exclude: Collection[Instance] = ()) -> Instance:
        """Choose for the conversation `key`; `prefer` is the instance holding its KV.

        Healthy instances only, unless none is; the preferred one unless it is overloaded;
        else the first not overloaded in rendezvous order of the key (or round robin).
        """
        now = self._clock()
        with self._lock:
            candidates = [i for i in self.instances if i not in exclude and i.available(now)]
            if not candidates:
                candidates = [i for i in self.instances if i not in exclude] or self.instances
            if self.policy.routing == "round_robin":
                while (chosen := next(self._next)) not in candidates:
                    pass
                return chosen
            limit = self.policy.overload_factor * (min(i.inflight for i in candidates) + 1)
            preferred = self._by_url.get(prefer) if prefer else None
            if preferred in candidates and preferred.inflight <= limit:
                return preferred
            raw = key.encode()
            ranked = sorted(candidates, key=lambda i: _weight(raw, i), reverse=True)
            return next((i for i in ranked if i.inflight <= limit), ranked[0])

    def acquire(self, instance: Instance) -> None:
        """Count a request in flight on the instance; `release` when it ends."""
        with self._lock:
            instance.inflight += 1

    def release(self, instance: Instance) -> None:
        with self._lock:
            instance.inflight -= 1

    def succeeded(self, instance: Instance) -> None:
        if instance.failures or instance.down or instance.open_until:
            with self._lock:
                instance.failures = 0
                instance.down = False
                instance.open_until = 0.0

    def failed(self, instance: Instance, unreachable: bool) -> None:
        """Record a failure: unreachable marks it down at once; others count toward the breaker."""
        with self._lock:
            instance.failures += 1
            if unreachable:
                instance.down = True
            elif instance.failures >= self.policy.breaker_failures or instance.open_until:
                instance.open_until = self._clock() + self.policy.breaker_cooldown
        log.warning("%s (%s) %s", instance.name, instance.url,
                    "marked down" if unreachable else f"failed {instance.failures} time(s)")
        if unreachable and self.on_down is not None:
            self.on_down()

    def report(self) -> list[dict]:
        now = self._clock()
        return [{"name": i.name, "url": i.url, "state": i.state(now), "inflight": i.inflight,
                 "consecutive_failures": i.failures} for i in self.instances]


_WATCH: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("pd_gateway_watch",
                                                                     default=None)


class Watch:
    """Ends one request's engine calls when its client goes away or its deadline passes.

    WSGI has no disconnect event: a gone client is only noticed at the next write, which
    during a long prefill is never. So a background thread (a greenlet under gevent) polls the
    client socket and, on EOF or at the deadline, shuts down the engine sockets this request
    is using; the blocked read fails at once and the caller sees `ClientGone` or a timeout.
    """

    POLL_SECONDS = 0.5   # how long a finished request's watcher may linger

    def __init__(self, client: socket.socket | None, deadline: float | None) -> None:
        self.client = client
        self.deadline = deadline
        self.gone = False
        self.expired = False
        self._connections: list[HTTPConnection] = []
        self._lock = threading.Lock()
        self._done = False
        self._token = _WATCH.set(self)
        if client is not None or deadline is not None:
            threading.Thread(target=self._run, name="pd-gateway-watch", daemon=True).start()

    def track(self, connection: HTTPConnection) -> None:
        """Register a connection this request is about to use; refuse if the request is
        already cut (its client left, or its deadline passed, before this call began)."""
        with self._lock:
            if self.gone or self.expired:
                raise ConnectionAbortedError("the request was cut before this engine call")
            self._connections.append(connection)

    def untrack(self, connection: HTTPConnection | None = None) -> None:
        with self._lock:
            if connection is None:
                self._connections.clear()
            elif connection in self._connections:
                self._connections.remove(connection)

    def error(self) -> GatewayError | None:
        """Why this request's engine calls were cut, if they were."""
        if self.gone:
            return ClientGone("the client closed the connection")
        if self.expired:
            return GatewayTimeout("the request took longer than its total deadline",
                                  instance_fault=False)
        return None

    def stop(self) -> None:
        self._done = True
        self.untrack()
        try:
            _WATCH.reset(self._token)
        except ValueError:        # stopped from another context (a generator's close)
            _WATCH.set(None)

    def _run(self) -> None:
        poller = None
        if self.client is not None:
            poller = select.poll()
            poller.register(self.client, select.POLLIN | select.POLLHUP)
        while not self._done:
            wait = self.POLL_SECONDS
            if self.deadline is not None:
                wait = min(wait, self.deadline - time.monotonic())
                if wait <= 0:
                    self.expired = True
                    return self._cut()
            if poller is None:
                time.sleep(wait)
                continue
            if poller.poll(wait * 1000) and not self._done:
                try:
                    # The raw socket: gevent's recv would wait on the socket's read event on
                    # EAGAIN, which the request's own greenlet may be using (it reads the next
                    # request on a kept-alive connection): ConcurrentObjectUseError.
                    raw = getattr(self.client, "_sock", self.client)
                    peeked = raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    peeked = b""
                if peeked:
                    poller = None      # a pipelined next request: keep only the deadline
                    continue
                self.gone = True
                return self._cut()

    def _cut(self) -> None:
        # Under the lock: a connection given back to the pool is untracked under it first
        # (`_TrackedPool._put_conn`), so one that another request may reuse is never cut; and
        # a call that starts after this finds `gone`/`expired` set in `track` and never sends.
        with self._lock:
            for connection in self._connections:
                # shutdown, not close: close from another thread would race the reader's own
                # use of the descriptor; shutdown just makes its blocked recv return.
                sock = getattr(connection, "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


class _Tracked:
    """A urllib3 connection that registers with the current request's Watch when used."""

    pd_watch: Watch | None = None

    def request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        watch = _WATCH.get()
        if watch is not None:
            self.pd_watch = watch
            watch.track(self)
        return super().request(*args, **kwargs)


class _TrackedHTTPConnection(_Tracked, HTTPConnection):
    pass


class _TrackedHTTPSConnection(_Tracked, HTTPSConnection):
    pass


class _TrackedPool:
    """Untracks a connection before it goes back to the pool, where another request may take it
    (a response closed, fully read, or a rejected reply: every release comes through here)."""

    def _put_conn(self, conn):  # type: ignore[no-untyped-def]
        watch = getattr(conn, "pd_watch", None)
        if watch is not None:
            watch.untrack(conn)
            conn.pd_watch = None
        return super()._put_conn(conn)


class _TrackedHTTPPool(_TrackedPool, HTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSPool(_TrackedPool, HTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


class Stream:
    """An open streamed response from an engine; iterate its raw bytes, always `close()`."""

    def __init__(self, response: requests.Response, instance: Instance) -> None:
        self._response = response
        self.instance = instance
        self.status = response.status_code
        self.headers = response.headers
        self._watch = _WATCH.get()
        self.content_type = response.headers.get("Content-Type", "text/event-stream")

    def chunks(self) -> Iterator[bytes]:
        """Bytes as they arrive; `read1` returns whatever is buffered instead of filling a block."""
        raw = self._response.raw
        try:
            while True:
                data = raw.read1(65536)
                if not data:
                    return
                yield data
        except (Urllib3Error, requests.RequestException, OSError) as exc:
            raise _translate(exc, self.instance, self._watch) from exc

    def close(self) -> None:
        self._response.close()     # releases the connection, untracked first (_TrackedPool)


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
    log.warning("%s (%s) failed: %r", instance.name, instance.url, exc)
    if _caused_by(exc, requests.ConnectTimeout, ConnectTimeoutError):
        return ServiceUnavailable(f"{instance.name} did not accept a connection in time")
    if _caused_by(exc, requests.Timeout, ReadTimeoutError, TimeoutError, socket.timeout):
        return GatewayTimeout(f"{instance.name} timed out")
    if _caused_by(exc, ConnectionRefusedError):
        return ServiceUnavailable(f"{instance.name} refused the connection")
    return BadGateway(f"{instance.name} broke the connection")


def _error_message(response: requests.Response) -> str:
    try:
        error = response.json().get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str) and message:
            return message
    except (ValueError, AttributeError):
        pass
    return response.reason or f"HTTP {response.status_code}"


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
        adapter = HTTPAdapter(pool_connections=max(hosts, 1), pool_maxsize=pool_size,
                              max_retries=0, pool_block=False)
        adapter.poolmanager.pool_classes_by_scheme = {"http": _TrackedHTTPPool,
                                                      "https": _TrackedHTTPSPool}
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.timeout = (connect_timeout, read_timeout)
        self.api_key = api_key

    def headers(self, request_id: str, authorization: str | None) -> dict[str, str]:
        """Headers for the engine calls; a client credential requests can't send is a 400."""
        out = {"X-Request-Id": request_id, "Accept-Encoding": "identity"}
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

    def _post(self, instance: Instance, path: str, body: dict, headers: dict,
              stream: bool) -> requests.Response:
        watch = _WATCH.get()
        try:
            response = self.session.post(
                instance.url + path, data=json.dumps(body, ensure_ascii=False).encode(),
                headers={**headers, "Content-Type": "application/json"},
                timeout=self.timeout, stream=stream)
        except requests.RequestException as exc:
            raise _translate(exc, instance, watch) from exc
        if response.status_code >= 400:
            message = _error_message(response)
            response.close()
            log.warning("%s answered %d: %s", instance.name, response.status_code, message)
            if response.status_code < 500:
                raise UpstreamRejected(message, status=response.status_code)
            # An engine's own 5xx message may name hosts, ports or engine ids: logged, not sent.
            raise BadGateway(f"{instance.name} failed with HTTP {response.status_code}")
        return response

    def post_json(self, instance: Instance, path: str, body: dict, headers: dict) -> dict:
        """POST and parse a JSON object reply, or raise a GatewayError."""
        response = self._post(instance, path, body, headers, stream=False)
        try:
            reply = response.json()
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

    def forward(self, instance: Instance, path: str, raw: bytes, headers: dict) -> Stream:
        """POST the client's bytes unchanged and return the open response, whatever its status."""
        try:
            response = self.session.post(instance.url + path, data=raw, headers=headers,
                                         timeout=self.timeout, stream=True)
        except requests.RequestException as exc:
            raise _translate(exc, instance, _WATCH.get()) from exc
        return Stream(response, instance)

    def probe(self, instance: Instance, timeout: float = 1.0) -> bool:
        """Does the instance answer GET /health with 200?"""
        try:
            with self.session.get(instance.url + "/health", timeout=timeout) as response:
                return response.status_code == 200
        except requests.RequestException:
            return False

    @staticmethod
    def watch(client: socket.socket | None, deadline: float | None) -> Watch:
        """Watch the current request's client and deadline until `Watch.stop`."""
        return Watch(client, deadline)

    def get_json(self, instance: Instance, path: str, read_timeout: float | None = None) -> dict:
        try:
            response = self.session.get(instance.url + path, timeout=(
                self.timeout[0], read_timeout or self.timeout[1]))
            response.raise_for_status()
            return response.json()
        except (requests.RequestException, ValueError) as exc:
            raise BadGateway(f"{instance.name} did not answer {path}") from exc


class Prober:
    """Probes instances marked down until /health answers 200, then puts them back in rotation.

    One background thread per process (a greenlet under gevent), started when an instance
    first goes down and ending when none is down.
    """

    def __init__(self, upstream: Upstream, pools: list[Pool], interval: float) -> None:
        self.upstream = upstream
        self.pools = pools
        self.interval = interval
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _down(self) -> list[tuple[Pool, Instance]]:
        return [(p, i) for p in self.pools for i in p.instances if i.down]

    def wake(self) -> None:
        """Make sure the probe loop runs (call after marking an instance down)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="pd-gateway-prober",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            down = self._down()
            if not down:
                return
            for pool, instance in down:
                if self.upstream.probe(instance):
                    log.info("%s (%s) answers /health again", instance.name, instance.url)
                    pool.succeeded(instance)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(self.interval + 2)    # a probe in progress times out within 1 s
