"""The engine POSTs' connections over plain HTTP: http.client's, kept alive in a pool of our own.

The gateway's POSTs to an `http://` engine (P's call, D's stream, releases, /tokenize), and the
requests it passes through (gateway.flow.passthrough, a GET among them), are made here without
requests (gateway.engines.upstream: `Upstream._send`). Measured with one process
calling an emulated P, 8 calls at once under gevent, client CPU a call (`python -m
bench.engine_call`): 234 us through requests and urllib3's pool, 150 through requests' adapter
on this pool, 105 here (bare http.client: 116). urllib3 and requests spend the difference on
what an engine call never needs: retries, redirects, proxies, cookies, content decoding, a
second wrapper of every header and of the response, a URL parsed again on every call; and
http.client reads a reply's head through the email package (17.6 us for an engine's five
fields; `read_fields`, 3.7).

What a call keeps of urllib3's behaviour: a kept-alive connection is checked before reuse
(nothing to read, no EOF: `watch.still_open`) and used again only after its whole response was
read; separate connect and read timeouts; a connection not made raised as urllib3 raises it
(`ConnectTimeoutError`, `NewConnectionError`, `NameResolutionError`: 503), other failures as the
OS's or http.client's errors, which upstream translates as before; TCP_NODELAY; every
connection tracked by the request's watch while in use (gateway.engines.watch), head and body
in one write. HTTPS engines, GETs (probes, /metrics, /v1/models), and every call while
something patches requests' `HTTPAdapter.send` (`responses` in the payload tests), go through
requests and urllib3's pools.
"""
from __future__ import annotations

import collections
import http.client
import socket

from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

from gateway.engines.watch import Tracked, still_open, untrack


class Fields(dict):
    """A response's header fields by lower-cased name (the first of repeated ones), looked up
    in any case: `get`, `in`, `[]` (and http.client's `get_all`)."""

    def get(self, name: str, default=None):  # type: ignore[no-untyped-def, override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def get_all(self, name: str, failobj=None):  # type: ignore[no-untyped-def]
        value = self.get(name)
        return failobj if value is None else [value]


def read_fields(fp) -> Fields:  # type: ignore[no-untyped-def]
    """A response head's header fields, read up to its blank line, as http.client reads them
    (its limits on a line and on the number of lines; the email package's rules: the fields
    end at the first line that is not one, a field name holds no space, a folded line continues
    the field before it, a value keeps its trailing blanks) but for folded lines, joined by a
    space instead of kept with their line break. http.client hands the lines to the email
    package's parser: 17.6 us for an engine's five fields here, 3.7 us so (two or three
    responses a turn)."""
    fields = Fields()
    name = ""               # the field a folded line continues ("": none, or one not kept)
    ended = False           # a line that is not a field was read: the rest is not read as any
    for _ in range(http.client._MAXHEADERS):      # the blank line counts, as in http.client
        line = fp.readline(http.client._MAXLINE + 1)
        if len(line) > http.client._MAXLINE:
            raise http.client.LineTooLong("header line")
        if line in (b"\r\n", b"\n", b""):
            return fields
        if ended:
            continue
        text = line.decode("iso-8859-1")
        if text[0] in " \t":
            if name:       # (one of spaces only still adds a space: "chunked " is not chunked)
                dict.__setitem__(fields, name, f"{dict.__getitem__(fields, name)} {text.strip()}")
            continue
        field, colon, value = text.partition(":")
        # (a name is printable ASCII but space and colon: 0x21-0x7E)
        if not colon or not (field.isascii() and field.isprintable()) or " " in field:
            ended = True
            continue
        if not field:
            name = ""                                 # no name: skipped, as the email package does
            continue
        name = field.lower()
        if dict.__contains__(fields, name):
            name = ""                                 # a repeated field: the first counts
        else:
            # What follows the colon but its leading blanks, as the email package keeps it
            dict.__setitem__(fields, name, value.lstrip(" \t").rstrip("\r\n"))
    raise http.client.HTTPException(f"got more than {http.client._MAXHEADERS} headers")


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
        self.headers = self.msg = read_fields(self.fp)  # type: ignore[assignment]
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
        if status in (http.client.NO_CONTENT, http.client.NOT_MODIFIED) or 100 <= status < 200 \
                or self._method == "HEAD":
            self.length = 0
        if not self.will_close and not self.chunked and self.length is None:
            self.will_close = True


class EngineConnection(Tracked, http.client.HTTPConnection):
    """http.client's connection, connected with its own timeout and TCP_NODELAY."""

    connect_timeout: float | None = None
    response_class = EngineHTTPResponse

    def connect(self) -> None:
        try:
            sock = socket.create_connection((self.host, self.port), self.connect_timeout)
        except TimeoutError as exc:
            raise ConnectTimeoutError(f"connecting to {self.host}:{self.port} timed out") from exc
        except socket.gaierror as exc:
            raise NameResolutionError(self.host, self, exc) from exc
        except OSError as exc:
            raise NewConnectionError(self, f"Failed to establish a new connection: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class EngineResponse:
    """An engine's response, as much of urllib3's HTTPResponse as requests and the gateway
    use: status, reason, headers, `read`, `release_conn`, `close`, and http.client's response
    (`_fp`) and the `connection` for a stream's reads (gateway.engines.upstream.Stream)."""

    def __init__(self, pool: EnginePool, connection: EngineConnection,
                 response: http.client.HTTPResponse) -> None:
        self._pool = pool
        self.connection: EngineConnection | None = connection
        self._fp = response
        self.status = response.status
        self.reason = response.reason
        self.headers = response.msg          # Fields

    def read(self, amt: int | None = None, decode_content: bool = True) -> bytes:
        """Up to `amt` bytes of the body (all of it with None); the connection goes back to the
        pool once the body has been read to its end. (No content decoding: the engines are
        asked for `identity`.)"""
        try:
            data = self._fp.read(amt)
        except BaseException:
            self.close()          # at once: an engine computes a request until its socket closes
            raise
        if self._fp.isclosed():
            self.release_conn()
        return data

    def release_conn(self) -> None:
        """The body was read to its end (`read`, or a stream's last read): the connection may
        serve another call. http.client closes a response read to its end."""
        self._let_go(self._fp.isclosed())

    def close(self) -> None:
        """Done with the response, maybe before its end (a stream cut short, a failed read):
        its connection is closed, never reused (bytes of this reply may still come on it). A
        response read whole gave its connection back already."""
        self._fp.close()
        self._let_go(False)

    def _let_go(self, whole: bool) -> None:
        connection, self.connection = self.connection, None
        if connection is not None:
            self._pool.put(connection, reusable=whole and not self._fp.will_close)


class EnginePool:
    """Kept-alive connections to one engine: the last given back is the first taken, at most
    `maxsize` kept (more are opened when more calls run at once, and closed after)."""

    def __init__(self, host: str, port: int, maxsize: int) -> None:
        self.host, self.port, self.maxsize = host, port, maxsize
        self._idle: collections.deque[EngineConnection] = collections.deque()
        # What requests' adapter sets on a pool before each call (HTTPAdapter.cert_verify);
        # nothing reads them over plain HTTP.
        self.cert_reqs = self.ca_certs = self.ca_cert_dir = None
        self.closed = False

    def urlopen(self, method: str, url: str, body: bytes | None = None, headers=None,  # type: ignore[no-untyped-def]  # noqa: E501
                timeout=None, **ignored) -> EngineResponse:
        """The call as requests' adapter makes it (`timeout`: urllib3's Timeout); the response
        once its head has arrived."""
        connection = self._take()
        read_timeout = timeout.read_timeout if timeout is not None else None
        connection.connect_timeout = timeout.connect_timeout if timeout is not None else None
        connection.timeout = read_timeout
        try:
            if connection.sock is not None:
                connection.sock.settimeout(read_timeout)     # a stream may have taken it off
            connection.request(method, url, body=body, headers=headers or {})
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
                return EngineConnection(self.host, self.port)
            if connection.sock is not None and still_open(connection.sock):
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
