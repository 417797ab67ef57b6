"""The engine calls' connections over plain HTTP: http.client's, kept alive in a pool of our own.

requests still makes every engine call (gateway.engines.upstream: its adapter's `send`, which
`responses` mocks in the payload tests), but below it, for the POSTs the gateway sends to an
`http://` engine, the pool is this one instead of urllib3's. Measured with one process calling
an emulated P, 8 calls at once under gevent, client CPU a call: 216 us through urllib3's pool,
118 us for the same call on http.client alone. urllib3 spends the difference on what an engine
call never needs: retries, redirects, proxies, content decoding, a second wrapper of every
header and of the response, a URL parsed again on every call. A turn makes two such calls (P,
then D) and a release one.

What a call keeps of urllib3's behaviour: a kept-alive connection is checked before reuse
(nothing to read, no EOF: `watch.still_open`) and used again only after its whole response was
read; separate connect and read timeouts; a connection not made raised as urllib3 raises it
(`ConnectTimeoutError`, `NewConnectionError`, `NameResolutionError`: 503), other failures as the
OS's or http.client's errors, which upstream translates as before; TCP_NODELAY; every connection tracked by the request's watch
while in use (gateway.engines.watch), head and body in one write. HTTPS engines, GETs (probes,
/metrics, /v1/models) and requests before 2.32 (whose adapter does not say which request asks
for a pool) keep urllib3's pools.
"""
from __future__ import annotations

import collections
import http.client
import socket

from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError

from gateway.engines.watch import Tracked, still_open, untrack


class EngineConnection(Tracked, http.client.HTTPConnection):
    """http.client's connection, connected with its own timeout and TCP_NODELAY."""

    connect_timeout: float | None = None

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
        self.headers = response.msg          # case-insensitive `get`, `in` and `[]`

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
