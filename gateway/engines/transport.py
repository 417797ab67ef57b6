"""The one transport for every engine call: `Transport.send` a request to an engine, get its
response once the head has arrived, over http.client connections (plain or TLS) kept alive in a
pool per engine; tests replace the transport (tests/helpers/transport.py) as httpx's
`MockTransport` replaces its.

Every call goes here: P's call, D's stream, releases, /tokenize, the requests passed through
(gateway.flow.passthrough), probes, /v1/models and /metrics reads. Neither requests nor urllib3
is on the way (but urllib3's URL parser): their layers (retries, redirects, proxies, cookies, a
second wrapper of every header and of the response, a URL parsed again on every call) do
nothing for an engine call and cost CPU on every one (`python -m bench.engine_call`;
docs/BENCHMARKS.md).

What a call keeps of urllib3's behaviour: a kept-alive connection is checked before reuse
(nothing to read, no EOF: `still_open`) and used again only after its whole response was read;
separate connect and read timeouts; a connection not made raised as `ConnectFailed` (the engine
never saw the request: 503), other failures as the OS's, ssl's or http.client's errors, which
gateway.engines.upstream translates; TCP_NODELAY; every connection tracked by the request's
watch while in use (gateway.engines.watch); head and body in one write. An `https://` engine's
certificate is verified against certifi's bundle and the engine's host name, as requests
verified it.
"""

from __future__ import annotations

import collections
import functools
import http.client
import ipaddress
import select
import socket
import ssl
import threading
from typing import TYPE_CHECKING, Protocol

from urllib3.util import parse_url

from gateway.engines.watch import current_watch

if TYPE_CHECKING:
    from gateway.engines.instances import Instance


class ConnectFailed(OSError):
    """No connection to the engine was made (no route, no such name): it never saw the
    request. The OS's error is the `__cause__` (a refusal: ConnectionRefusedError)."""


class ConnectTimedOut(ConnectFailed):
    """The engine did not accept a connection within the connect timeout."""


# --- a reply's head ---------------------------------------------------------------------------


class Fields(dict):
    """A response's header fields by lower-cased name (the first of repeated ones), looked up
    in any case: `get`, `in`, `[]` (and http.client's `get_all`)."""

    def get(self, name: str, default=None):
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def get_all(self, name: str, failobj=None):
        value = self.get(name)
        return failobj if value is None else [value]


def read_fields(fp) -> Fields:
    """A response head's header fields, read up to its blank line, as http.client reads them
    (its limits on a line and on the number of lines; the email package's rules: the fields
    end at the first line that is not one, a field name holds no space, a folded line continues
    the field before it, a value keeps its trailing blanks) but for folded lines, joined by a
    space instead of kept with their line break.

    Not http.client's own `parse_headers`: it hands the lines to the email package's parser,
    which costs several times this on every reply (two or three a turn; docs/BENCHMARKS.md),
    and `HTTPResponse.begin` takes the parser from its module, with no hook for another."""
    fields = Fields()
    name = ""  # the field a folded line continues ("": none, or one not kept)
    ended = False  # a line that is not a field was read: the rest is not read as any
    # why the ignore: http.client's own limits are private, and typeshed leaves them out.
    max_headers = http.client._MAXHEADERS  # type: ignore[attr-defined]
    max_line = http.client._MAXLINE  # type: ignore[attr-defined]
    for _ in range(max_headers):  # the blank line counts, as in http.client
        line = fp.readline(max_line + 1)
        if len(line) > max_line:
            raise http.client.LineTooLong("header line")
        if line in (b"\r\n", b"\n", b""):
            return fields
        if ended:
            continue
        text = line.decode("iso-8859-1")
        if text[0] in " \t":
            if name:  # (one of spaces only still adds a space: "chunked " is not chunked)
                dict.__setitem__(fields, name, f"{dict.__getitem__(fields, name)} {text.strip()}")
            continue
        field, colon, value = text.partition(":")
        # (a name is printable ASCII but space and colon: 0x21-0x7E)
        if not colon or not (field.isascii() and field.isprintable()) or " " in field:
            ended = True
            continue
        if not field:
            name = ""  # no name: skipped, as the email package does
            continue
        name = field.lower()
        if dict.__contains__(fields, name):
            name = ""  # a repeated field: the first counts
        else:
            # What follows the colon but its leading blanks, as the email package keeps it
            dict.__setitem__(fields, name, value.lstrip(" \t").rstrip("\r\n"))
    raise http.client.HTTPException(f"got more than {max_headers} headers")


class EngineHTTPResponse(http.client.HTTPResponse):
    """http.client's response, its head's fields read by `read_fields`."""

    def begin(self) -> None:
        # http.client's own (Python 3.11's `HTTPResponse.begin`), but for the fields' parser,
        # which it takes from its module: no hook to give it another.
        if self.headers is not None:
            return
        while True:
            version, status, reason = self._read_status()
            if not 100 <= status < 200 or status == http.client.SWITCHING_PROTOCOLS:
                break
            # An interim response (100 Continue; http.client skips no other: a 103 Early Hints
            # was taken for the reply, and the reply's bytes left for the connection's next
            # call to read): its fields, and the reply still to come.
            read_fields(self.fp)
        self.code = self.status = status
        self.reason = reason.strip()
        if version in ("HTTP/1.0", "HTTP/0.9"):
            self.version = 10
        elif version.startswith("HTTP/1."):
            self.version = 11
        else:
            raise http.client.UnknownProtocol(version)
        self.headers = self.msg = read_fields(self.fp)
        encoding = self.headers.get("transfer-encoding")
        self.chunked = bool(encoding) and encoding.lower() == "chunked"
        self.chunk_left = None
        self.will_close = self._check_close()
        self.length = None
        length = self.headers.get("content-length")
        if length and not self.chunked:
            try:
                self.length = int(length)
            except ValueError:
                self.length = None
            else:
                if self.length < 0:
                    self.length = None
        if (
            status in (http.client.NO_CONTENT, http.client.NOT_MODIFIED)
            or 100 <= status < 200
            or self._method == "HEAD"
        ):
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


# --- connections ------------------------------------------------------------------------------

ONE_SEND_BYTES = 1 << 20  # a request's head and body go out together up to this size


class EngineConnection(http.client.HTTPConnection):
    """http.client's connection to an engine: connected with its own timeout and TCP_NODELAY,
    registered with the current request's watch while in use (gateway.engines.watch), and
    sending a request's head and body in one write.

    http.client writes the head, then the body: two sends on a socket with TCP_NODELAY, two
    segments, two wake-ups of the engine. On loopback each send runs the receiver's side of TCP
    too, for every P and D call."""

    connect_timeout: float | None = None
    response_class = EngineHTTPResponse
    pd_watch = None  # the Watch this connection is registered with
    _head: bytes | None = None  # held until the body comes, while `_one_send`
    _one_send = False

    @property
    def is_connected(self) -> bool:
        """May this kept-alive connection serve another call (urllib3's name): see
        `still_open`."""
        return self.sock is not None and still_open(self.sock)

    def connect(self) -> None:
        try:
            sock = _connect(self.host, self.port, self.connect_timeout)
        except TimeoutError as exc:
            raise ConnectTimedOut(f"connecting to {self.host}:{self.port} timed out") from exc
        except OSError as exc:  # a refusal among them: its cause says so
            raise ConnectFailed(f"no connection to {self.host}:{self.port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
        except OSError:
            sock.close()
            raise
        self.sock = sock

    def request(self, method, url, body=None, headers=None, **kwargs):
        watch = current_watch()
        if watch is not None:
            self.pd_watch = watch
            watch.track(self)
        self._one_send = type(body) is bytes and 0 < len(body) <= ONE_SEND_BYTES
        try:
            return super().request(method, url, body=body, headers=headers or {}, **kwargs)
        finally:
            self._one_send, self._head = False, None

    def send(self, data):
        if self._one_send:
            if self._head is None:  # the head (http.client's _send_output)
                self._head = data
                return
            data, self._one_send, self._head = self._head + data, False, None
        super().send(data)


def _connect(host: str, port: int, timeout: float | None) -> socket.socket:
    """A TCP connection to `host`: an IP address connected to as it is, a name resolved
    (every time: where it points may change). `socket.create_connection` resolves even an
    address, and under gevent every resolution goes through gevent's thread pool: a hand-off to
    a thread and back for each new engine connection, which a burst of new turns (each opening
    its connections to P and D) waits on; gevent's own `connect` takes an address as it is."""
    family = _literal_family(host)
    if family is None:
        return socket.create_connection((host, port), timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


@functools.lru_cache(maxsize=1024)
def _literal_family(host: str) -> socket.AddressFamily | None:
    """The address family of an IP address (IPv6 without its brackets); None for a name."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return socket.AF_INET6 if address.version == 6 else socket.AF_INET


class EngineTLSConnection(EngineConnection):
    """An `https://` engine's connection: TCP as any, then TLS within the connect timeout."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext) -> None:
        super().__init__(host, port)
        self._context = context

    def connect(self) -> None:
        super().connect()
        self.sock.settimeout(self.connect_timeout)
        try:
            self.sock = self._context.wrap_socket(self.sock, server_hostname=self.host)
        except BaseException:
            self.sock.close()
            self.sock = None
            raise
        self.sock.settimeout(self.timeout)


def still_open(sock: socket.socket) -> bool:
    """May a kept-alive engine connection be used again: nothing to read, no EOF? Under gevent
    one non-blocking peek of the real socket gevent's wraps (kept non-blocking); a plain
    socket, or a TLS one (whose bytes are records, not replies, and which takes no flags), is
    polled, as urllib3 does (a peek on a socket with a timeout would wait for it)."""
    raw = getattr(sock, "_sock", None)
    if raw is None or isinstance(sock, ssl.SSLSocket) or hasattr(sock, "cipher"):
        try:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):  # closed meanwhile
            return False
    try:
        raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True  # nothing to read: still connected
    except OSError:
        return False  # reset, or closed meanwhile
    return False  # EOF, or bytes nobody asked for: urllib3 drops it too


def untrack(connection) -> None:
    """Before a connection goes back to its pool, where another request may take it."""
    watch = getattr(connection, "pd_watch", None)
    if watch is not None:
        watch.untrack(connection)
        connection.pd_watch = None


# --- responses and pools ----------------------------------------------------------------------


class EngineResponse:
    """An engine's response: status, reason, headers (`Fields`), the body's bytes (`read`,
    `read1`), and the connection it came on, which goes back to its pool once the body was read
    to its end (`release_conn`) and is closed if not (`close`)."""

    def __init__(
        self,
        pool: EnginePool | None,
        connection: EngineConnection | None,
        response: http.client.HTTPResponse,
    ) -> None:
        self._pool = pool
        self.connection = connection
        self._fp = response
        self.status = response.status
        self.reason = response.reason
        self.headers = response.msg  # Fields
        self.content: bytes | None = None  # the whole body, once upstream has read it
        # What has come of the body, up to n bytes, waiting only if nothing has (a stream's
        # tokens as they come): http.client's own, no call around it on every token.
        self.read1 = response.read1

    @property
    def sock(self) -> socket.socket | None:
        """The connection's socket (a stream's read timeout is taken off it: watch)."""
        return self.connection.sock if self.connection is not None else None

    def read(self, amt: int | None = None) -> bytes:
        """Up to `amt` bytes of the body (all of it with None); the connection goes back to the
        pool once the body has been read to its end. (No content decoding: the engines are
        asked for `identity`.)"""
        try:
            data = self._fp.read(amt)
        except BaseException:
            self.close()  # at once: an engine computes a request until its socket closes
            raise
        if self._fp.isclosed():
            self.release_conn()
        return data

    def finish(self) -> None:
        """The body's last `read1` gave nothing: short of its Content-Length, that is an error
        (http.client's IncompleteRead); whole, its connection goes back to the pool."""
        if self._fp.length:  # bytes still owed
            raise http.client.IncompleteRead(b"", self._fp.length)
        self._fp.close()  # http.client's end of a response
        self.release_conn()

    def release_conn(self) -> None:
        """The body was read to its end (`read`, `finish`): the connection may serve another
        call. http.client closes a response read to its end."""
        self._let_go(self._fp.isclosed())

    def close(self) -> None:
        """Done with the response, maybe before its end (a stream cut short, a failed read):
        its connection is closed, never reused (bytes of this reply may still come on it). A
        response read whole gave its connection back already."""
        self._fp.close()
        self._let_go(False)

    def _let_go(self, whole: bool) -> None:
        connection, self.connection = self.connection, None
        if connection is not None and self._pool is not None:
            self._pool.put(connection, reusable=whole and not self._fp.will_close)


class EnginePool:
    """Kept-alive connections to one engine: the last given back is the first taken, at most
    `maxsize` kept (more are opened when more calls run at once, and closed after)."""

    def __init__(
        self, host: str, port: int, maxsize: int, context: ssl.SSLContext | None = None
    ) -> None:
        self.host, self.port, self.maxsize = host, port, maxsize
        self._context = context
        self._idle: collections.deque[EngineConnection] = collections.deque()
        self.closed = False

    def urlopen(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: dict,
        timeout: tuple[float | None, float | None],
    ) -> EngineResponse:
        """The response to `method url` once its head has arrived (`timeout`: connect, read)."""
        connection = self._take()
        connection.connect_timeout, connection.timeout = timeout
        try:
            if connection.sock is not None:
                connection.sock.settimeout(timeout[1])  # a stream may have taken it off
            connection.request(method, url, body=body, headers=headers)
            response = connection.getresponse()
        except BaseException:
            self.put(connection, reusable=False)
            raise
        return EngineResponse(self, connection, response)

    def _take(self) -> EngineConnection:
        while True:
            try:
                connection = self._idle.pop()
            except IndexError:
                if self._context is not None:
                    return EngineTLSConnection(self.host, self.port, self._context)
                return EngineConnection(self.host, self.port)
            if connection.is_connected:
                return connection
            connection.close()

    def put(self, connection: EngineConnection, reusable: bool) -> None:
        untrack(connection)
        if reusable and not self.closed and len(self._idle) < self.maxsize:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().close()


Timeouts = tuple[float | None, float | None]  # (connect, read) seconds


class EngineTransport(Protocol):
    """What `Upstream` needs of a transport (tests give it another: tests/helpers/transport)."""

    def send(
        self,
        instance: Instance,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: Timeouts,
    ) -> EngineResponse: ...

    def close(self) -> None: ...


class Transport:
    """The engine calls' transport: one pool of kept-alive connections per engine (its URL),
    `pool_size` connections kept in each; `tls` verifies `https://` engines (default: as
    requests did, `tls_context()`)."""

    def __init__(self, pool_size: int, tls: ssl.SSLContext | None = None) -> None:
        self._pool_size = pool_size
        self._pools: dict[str, EnginePool] = {}
        self._tls = tls
        self._lock = threading.Lock()

    def send(
        self,
        instance: Instance,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: Timeouts,
    ) -> EngineResponse:
        """`method` `path` (after the instance URL's own path) with `body` and `headers` (all
        of them: Host and, with a body, Content-Length are the only ones added); the response
        once its head has arrived, whatever its status."""
        pool = self._pools.get(instance.url)
        if pool is None:
            pool = self._pool(instance)
        return pool.urlopen(method, instance.base_path + path, body, headers, timeout)

    def _pool(self, instance: Instance) -> EnginePool:
        # urllib3's parser, as the admin API's allowlist reads an added URL (gateway.engines.
        # membership): the host checked is the host connected to.
        parsed = parse_url(instance.url)
        with self._lock:
            pool = self._pools.get(instance.url)
            if pool is not None:
                return pool
            if len(self._pools) >= 1024:  # engines come and go: keep it bounded
                old, self._pools = self._pools, {}  # (other threads read it)
                for each in list(old.values()):
                    each.close()
            context = None
            if parsed.scheme == "https":
                context = self._tls = self._tls or tls_context()
            # An IPv6 host without its brackets: http.client keeps them when given a port.
            port = parsed.port or (443 if context is not None else 80)
            pool = self._pools[instance.url] = EnginePool(
                (parsed.host or "").strip("[]"), port, self._pool_size, context
            )
            return pool

    def close(self) -> None:
        """Close every kept connection."""
        for pool in list(self._pools.values()):
            pool.close()


def tls_context() -> ssl.SSLContext:
    """What requests verified an `https://` engine with: certifi's CA bundle, the host name."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())
