"""gunicorn's gevent and gthread workers, with a deadline on every client that stalls, kept-alive
connections let go at shutdown and a cheaper write to clients.

A client that stops sending its request (headers or body) or stops taking its reply holds what
serves it: a gthread thread (8 connections that sent half their headers blocked every thread
of a worker, /health included, for as long as they stayed open), a gevent connection and the
turn's admission place and D's stream. Each client socket here has a timeout while a request is
served (`--client-timeout`): a read that waits that long, or a write that takes that long (one
reply event, or a whole JSON reply), fails, the request ends (408 for a body that stopped
coming) and everything it held is released, quietly: gunicorn logs a socket error with its
traceback unless the socket was reset or its pipe broke, so a timeout reads as the end of the
stream (then as a reset) and a write that timed out raises a broken pipe.

A client that trickles its request, a byte now and then within `--client-timeout`, would hold it
for as long as it likes: a request's head and body must arrive within `--request-timeout` of its
first byte, every read bounded by what is left of it. And with gthread the worker's own loop
reads a request's head, and a body of up to 1 MiB (of a known length or chunked; 100 Continue
sent from the loop), a pool thread taking the request only once that is in: 16 connections
sending a header line every few seconds had held every thread of a worker (`/health` with them)
for as long as they trickled. A stream whose client takes nothing (its side of the connection
acknowledges nothing) for `--client-timeout` is cut, without waiting for our own send buffer,
which the kernel grows to megabytes, to fill.

On SIGTERM gunicorn's gevent worker stops accepting, then waits until every connection's
greenlet has ended, and a connection idle between two requests ends only when its keep-alive
timer fires: up to `--keepalive` (75 s here). Workers' forwarding sessions keep connections to
each other's private listeners, so with affinity every graceful stop took that long. gunicorn's
gthread worker already caps kept-alive connections at shutdown (STOP_KEEPALIVE_LINGER, 2 s);
this does the same for gevent: a connection still waiting for its next request that long after
SIGTERM is closed, and streams in flight keep the whole graceful timeout.

Every token of every stream is one write to its client (gunicorn's `sock.sendall`). gevent's
`sendall` asks the kernel for SO_SNDBUF (a system call) and walks the data in memoryview
slices on every call, for a few hundred bytes that the socket's buffer takes at once. The
client sockets here try one plain send first and leave anything it did not take to gevent.

Python's cyclic garbage collector runs its youngest generation every 700 net new containers: with
64 turns in flight, some 250 times a second, each pass walking the live requests' young objects
(gevent's greenlets and waiters among them) only to keep them. Once the app is loaded, each worker
freezes what it has (the modules and the app: never garbage, and no longer walked by the full
collections; with --preload, their pages then stay shared with the master) and collects the
young generation every `GC_YOUNG` containers instead. Measured in the worker with `gc.callbacks`,
`bench.profile --concurrency 64`: 77-120 ms of 1.5 s of CPU in collections before (5-8 %), 41 ms
after (cycles are still collected, at most some 10,000 containers later).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import re
import selectors
import socket
import struct
import termios
import threading
import time
import weakref
from functools import partial
from typing import TYPE_CHECKING

import gevent
import gevent.socket
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker
from gunicorn.workers.gthread import ThreadWorker as _ThreadWorker

from gateway.config import Settings

STOP_KEEPALIVE_LINGER = 2.0  # as gunicorn's gthread worker
GC_YOUNG = 10_000  # net new containers between two collections of the young (700)
_REQUEST_TIMEOUT = 60.0  # this worker's --request-timeout
_LOOP_BYTES = 64 * 1024 * 1024  # this worker's --max-bodies-bytes
_CLIENT_TIMEOUT = 60.0  # this worker's --client-timeout
# What each client socket was sent and when it last took some of it (`_taking`).
_TAKEN: weakref.WeakKeyDictionary[socket.socket, list] = weakref.WeakKeyDictionary()
TAKING_CHECK_SECONDS = 1.0
_OUTQ = getattr(termios, "TIOCOUTQ", None)  # a socket's bytes not yet acknowledged (Linux)
# What a gthread worker's loop reads of a request before a pool thread takes it: its head, and a
# body of a known length up to LOOP_BODY_BYTES; requests' bytes held so at most
# --max-bodies-bytes in all (beyond, a thread reads the rest of a body; a head is closed).
LOOP_BODY_BYTES = 1024 * 1024
_LOOP_BODY = LOOP_BODY_BYTES  # this worker's: at most --max-body-bytes
CHUNKED = -1  # a body read up to its last chunk
_LENGTH = re.compile(rb"\ncontent-length[ \t]*:[ \t]*(\d{1,12})[ \t]*\r?\n", re.IGNORECASE)
_CHUNKED = re.compile(rb"\ntransfer-encoding[ \t]*:[ \t]*chunked[ \t]*\r?\n", re.IGNORECASE)
# Another transfer coding (its parser refuses it), or a client that waits for 100 Continue
# before its body (gunicorn's thread sends it).
_NOT_NOW = re.compile(rb"\n(?:transfer-encoding|expect)[ \t]*:", re.IGNORECASE)
_EXPECT = re.compile(rb"\nexpect[ \t]*:[ \t]*100-continue[ \t]*\r?(?=\n)", re.IGNORECASE)
# Each client socket's deadline for the request it is receiving: set by that request's first
# bytes, forgotten when its connection waits for a next request. Kept beside the sockets, whose
# class is swapped in place (a class that may add no slot).
_DEADLINES: weakref.WeakKeyDictionary[socket.socket, float] = weakref.WeakKeyDictionary()


def _client_timeout() -> float:
    """This worker's --client-timeout, its other bounds on clients read with it."""
    global _REQUEST_TIMEOUT, _LOOP_BYTES, _CLIENT_TIMEOUT, _LOOP_BODY
    settings = Settings.from_env()
    _REQUEST_TIMEOUT = settings.request_timeout
    _LOOP_BYTES = settings.max_bodies_bytes
    _LOOP_BODY = min(LOOP_BODY_BYTES, settings.max_body_bytes)
    _CLIENT_TIMEOUT = settings.client_timeout
    return settings.client_timeout


def _taking(sock: socket.socket, size: int) -> None:
    """Before `size` more bytes go to a client: has it taken any of what it was sent (its side
    of the connection acknowledged them) in the last --client-timeout? Asked once a second
    at most (one ioctl); BrokenPipeError if it has taken nothing that long while bytes wait
    for it. A write alone would wait only once the kernel's buffers on both sides are full,
    and our own grows to megabytes: a stream nobody read held its place and D's for minutes."""
    state = _TAKEN.get(sock)
    now = time.monotonic()
    if state is None:
        _TAKEN[sock] = [size, 0, now, now]  # written, taken, when taken last grew, checked
        return
    written = state[0]
    state[0] = written + size
    if now - state[3] < TAKING_CHECK_SECONDS or _OUTQ is None:
        return
    state[3] = now
    try:
        queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return
    taken = written - queued
    if taken > state[1] or not queued:
        state[1], state[2] = taken, now
    elif now - state[2] >= _CLIENT_TIMEOUT:
        raise BrokenPipeError(errno.EPIPE, "the client took nothing for --client-timeout")


def _collect_less() -> None:
    """After the app is loaded: what the worker has is kept for good (`gc.freeze`), and the young
    generation is collected less often (never more often than the interpreter was told)."""
    gc.freeze()
    young, *older = gc.get_threshold()
    if young:  # 0: collection is off; leave it so
        gc.set_threshold(max(young, GC_YOUNG), *older)


def _head_end(head: bytearray, seen: int) -> int:
    """Where the request's body begins (after the blank line that ends its head), or -1: the
    head is not whole yet (`seen`: bytes already looked through)."""
    end = head.find(b"\r\n\r\n", max(0, seen - 3))
    if end >= 0:
        return end + 4
    end = head.find(b"\n\n", max(0, seen - 1))
    return end + 2 if end >= 0 else -1


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _continue(sock: socket.socket, head: bytearray, end: int) -> int:
    """A client that waits for 100 Continue before a body the loop would read gets it now, and
    its Expect line is taken out of the head (gunicorn's thread would send another); the bytes
    taken out. ConnectionError if the answer went out only in part."""
    expect = _EXPECT.search(head, 0, end)
    if expect is None or not head.startswith(b"HTTP/1.1", head.find(b"\n") - 9):
        return 0
    lines = head[: expect.start()] + head[expect.end() : end]
    if _body_to_read(lines, len(lines)) == 0:
        return 0  # a thread's to read: gunicorn answers it
    try:
        sent = sock.send(CONTINUE)
    except BlockingIOError:
        return 0
    if sent != len(CONTINUE):
        raise ConnectionError("100 Continue sent in part")
    del head[expect.start() : expect.end()]
    return expect.end() - expect.start()


def _chunks_end(head: bytearray, at: int) -> int:
    """Walk a chunked body from `at`, the start of a chunk's size line: where to go on from
    when more has come, or -1 once its last chunk and trailers are in (or it is not chunked as
    it says: gunicorn's parser refuses it). Each chunk is stepped over, never searched."""
    while True:
        line = head.find(b"\r\n", at)
        if line < 0:
            return at  # its size line is not whole yet
        size = bytes(head[at:line]).split(b";", 1)[0].strip()
        if not 0 < len(size) <= 16 or not all(c in b"0123456789abcdefABCDEF" for c in size):
            return -1
        length = int(size, 16)
        if length == 0:  # the last chunk: trailer lines to an empty one
            if head[line + 2 : line + 4] == b"\r\n" or head.find(b"\r\n\r\n", line) >= 0:
                return -1
            return at
        following = line + 2 + length + 2
        if following > len(head):
            return at  # this chunk is not whole yet
        at = following


def _body_to_read(head: bytearray, end: int) -> int:
    """How much of the body a gthread worker's loop reads before a thread takes the request:
    all of one of a single known length up to --max-body-bytes and LOOP_BODY_BYTES, CHUNKED
    for a chunked one, else none (gunicorn's parser reads or refuses it)."""
    lines = bytes(head[:end])
    lengths = _LENGTH.findall(lines)
    if not lengths and _CHUNKED.search(lines) and len(_NOT_NOW.findall(lines)) == 1:
        return CHUNKED
    if len(lengths) != 1 or _NOT_NOW.search(lines):
        return 0
    length = int(lengths[0])
    return length if length <= _LOOP_BODY else 0


class GeventWorker(_GeventWorker):
    def init_process(self) -> None:
        self._idle: dict = {}  # greenlet -> the keep-alive timeout it is waiting under
        self._clients: dict = {}  # greenlet -> the client socket it serves
        self._client_timeout = _client_timeout()
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        _collect_less()

    def handle(self, listener, client, addr) -> None:
        if type(client) is gevent.socket.socket:  # not TLS sockets, whose send differs
            client.__class__ = _ClientSocket
        client.settimeout(self._client_timeout)  # off while it waits for a next request
        glet = gevent.getcurrent()
        self._clients[glet] = client
        try:
            super().handle(listener, client, addr)
        finally:
            del self._clients[glet]

    def handle_request(self, listener_name, req, sock, addr):
        try:
            return super().handle_request(listener_name, req, sock, addr)
        finally:
            _DEADLINES.pop(sock, None)  # served: a drain after it is not its head

    # gunicorn uses what it returns as a context manager (gevent's worker returns a
    # gevent.Timeout); the stubs say None.
    def timeout_ctx(self) -> _IdleWait:  # type: ignore[override]
        # gunicorn calls this around reading each next request on a connection, only there:
        # the keep-alive wait, bounded by itself (the request's headers with it); the client
        # timeout holds from the headers on.
        return _IdleWait(
            self._idle,
            self.cfg.keepalive if self.alive else STOP_KEEPALIVE_LINGER,
            self._clients.get(gevent.getcurrent()),
            self._client_timeout,
        )

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        gevent.spawn_later(STOP_KEEPALIVE_LINGER, self._let_go)  # out of the signal handler

    def _let_go(self) -> None:
        loop = gevent.get_hub().loop
        for glet in list(self._idle):
            loop.run_callback(self._end_wait, glet)

    def _end_wait(self, glet) -> None:
        # Runs in the hub, as gevent.kill does, so no request can start between the check
        # and the throw. The Timeout was made with exception=False: its own `with` swallows
        # it, gunicorn sees no request and closes the connection.
        timeout = self._idle.get(glet)
        if timeout is not None:
            glet.throw(timeout)


class _IdleWait:
    """gevent.Timeout(seconds, False), registered while the greenlet waits inside it; the
    client's own timeout off meanwhile, and on again after."""

    def __init__(self, idle: dict, seconds: float, client, client_timeout: float) -> None:
        self.idle = idle
        # False: gevent's documented "expire silently" (its `with` swallows it); not in the stubs.
        self.timeout = gevent.Timeout(seconds, False)  # type: ignore[arg-type]
        self.client = client
        self.client_timeout = client_timeout

    def __enter__(self) -> gevent.Timeout:
        self.idle[gevent.getcurrent()] = self.timeout
        if self.client is not None:
            _DEADLINES.pop(self.client, None)  # a next request: its first byte sets its own
            self.client.settimeout(None)
        return self.timeout.__enter__()

    def __exit__(self, *exc) -> bool | None:
        self.idle.pop(gevent.getcurrent(), None)
        if self.client is not None:
            self.client.settimeout(self.client_timeout)
        return self.timeout.__exit__(*exc)


if TYPE_CHECKING:
    # The mixins below are only ever mixed into a socket class: typed as one.
    _SocketMixin = socket.socket
else:
    _SocketMixin = object


class _QuietTimeouts(_SocketMixin):
    """A client socket's timeouts (a stalled client) end its request quietly. gunicorn logs a
    socket error with its traceback unless it is a broken pipe or a reset, and a client could
    fill the log with stalls: a plain read that times out finds the end of the stream (gunicorn:
    a client gone; the gateway's body read: 408, `pd_stalled`), and the socket becomes its
    `_stalled` class; a write that times out is a broken pipe. A read with flags (the watcher's
    peek) sees a timeout as what it is."""

    __slots__ = ()
    pd_stalled = False
    _stalled: type  # each socket class's own, set with it

    def sendall(self, data, flags: int = 0) -> None:
        _taking(self, len(data))
        self._sendall(data, flags)

    def _sendall(self, data, flags: int) -> None:
        try:
            super().sendall(data, flags)
        except TimeoutError:
            raise BrokenPipeError(
                errno.EPIPE, "the client took nothing for --client-timeout"
            ) from None

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if flags:
            return super().recv(bufsize, flags)
        try:
            return self._within_deadline(super().recv, bufsize)
        except TimeoutError:
            self.__class__ = self._stalled
            return b""

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        if flags:
            return super().recv_into(buffer, nbytes, flags)
        try:
            return self._within_deadline(super().recv_into, buffer, nbytes)
        except TimeoutError:
            self.__class__ = self._stalled
            return 0

    def _within_deadline(self, read, *args):
        """A read of the request, waiting no longer than its deadline leaves (the first read
        that brings bytes sets it)."""
        deadline = _DEADLINES.get(self)
        if deadline is None:
            got = read(*args)
            if got:
                _DEADLINES[self] = time.monotonic() + _REQUEST_TIMEOUT
            return got
        left = deadline - time.monotonic()
        timeout = self.gettimeout()
        if left <= 0:
            # Past it: what has come already is still taken (a request a thread starts on late
            # was sent in time), nothing more is waited for.
            self.settimeout(0.0)
            try:
                return read(*args)
            except BlockingIOError:
                raise TimeoutError(
                    "the request took longer than --request-timeout to arrive"
                ) from None
            finally:
                self.settimeout(timeout)
        if timeout is not None and timeout <= left:  # non-blocking (0) among them
            return read(*args)
        self.settimeout(left)
        try:
            return read(*args)
        finally:
            self.settimeout(timeout)


class _Stalled:
    """After the read that timed out (which found the end): the connection is done for, and
    a reset is what gunicorn closes quietly (it drains a body before a next request)."""

    __slots__ = ()
    pd_stalled = True

    def recv(self, *args):
        raise ConnectionResetError(errno.ECONNRESET, "the client stalled")

    recv_into = recv


class _ClientSocket(_QuietTimeouts, gevent.socket.socket):
    """A gevent socket whose `sendall` tries one send on the OS socket before gevent's loop."""

    __slots__ = ()

    def sendall(self, data, flags=0):
        _taking(self, len(data))
        try:
            # gevent's socket keeps the OS socket in `_sock` (internal, not in the stubs).
            sent = self._sock.send(data, flags)  # type: ignore[attr-defined]
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._sendall(memoryview(data)[sent:], flags)


class _StalledClientSocket(_Stalled, _ClientSocket):
    __slots__ = ()


_ClientSocket._stalled = _StalledClientSocket


class ThreadWorker(_ThreadWorker):
    """gunicorn's gthread worker, whose client sockets time out (`--client-timeout`) wherever
    a thread would block on them (gunicorn makes them blocking in the thread that serves a
    request), whose closing connections never make its main loop wait for the client, and
    whose main loop reads each request's head (and a body of a known length, or a chunked one,
    up to 1 MiB) before a pool thread takes the request, never waiting on a client."""

    def init_process(self) -> None:
        _client_timeout()
        self._heads: dict = {}  # connection -> when the loop began to wait for it
        self._held = 0  # bytes the loop read that no thread has taken yet
        self._held_lock = threading.Lock()
        self._swept = 0.0
        self._stopped_at: float | None = None
        cfg = self.cfg
        limits = (cfg.limit_request_line, cfg.limit_request_fields, cfg.limit_request_field_size)
        self._head_limit = (
            limits[0] + limits[1] * (limits[2] + 2) + 4 if all(limits) else LOOP_BODY_BYTES
        )
        # TLS, HTTP/2 and uwsgi connections are gunicorn's own to read (no HTTP/1 head).
        self._reads_heads = (
            not cfg.is_ssl
            and getattr(cfg, "http2_cleartext", "off") in ("off", None)
            and getattr(cfg, "protocol", "http") == "http"
        )
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        _collect_less()

    def enqueue_req(self, conn):
        # Before gunicorn makes the socket blocking for its thread (in `enqueue_req` up to
        # gunicorn 23, in `handle` later). TLS sockets are left as they are (gunicorn wraps
        # them in its own class): put a buffering proxy in front of a TLS gthread gateway.
        if type(conn.sock) is socket.socket:
            conn.sock.__class__ = _ThreadClientSocket
        if not self._reads_heads or not isinstance(conn.sock, _ThreadClientSocket):
            return super().enqueue_req(conn)
        _DEADLINES.pop(conn.sock, None)  # a next request: its first byte sets its own
        # What a body's drain read ahead (a pipelined request) begins the head (gunicorn 24+
        # gives it back; an older one's parser keeps it, and its thread reads the rest).
        unreader = getattr(conn.parser, "unreader", None)
        ahead = unreader is not None and unreader.buf.getvalue()
        if ahead and not hasattr(unreader, "take_buffered"):
            return super().enqueue_req(conn)
        conn.sock.setblocking(False)  # this loop never waits on a client
        now = time.monotonic()
        conn.pd_head = bytearray(
            unreader.take_buffered() if ahead and unreader is not None else b""
        )
        conn.pd_need = conn.pd_body_at = None
        conn.pd_heard = None
        if conn.pd_head:
            conn.pd_heard = now
            _DEADLINES[conn.sock] = now + _REQUEST_TIMEOUT
        self._hold(len(conn.pd_head))
        if self._read_head(conn, 0):
            return None
        self._heads[conn] = now
        with self._poller_lock:
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._more_head, conn))
        return None

    @property
    def _poller_lock(self):
        """gunicorn before 24 registers connections from pool threads too, under its lock (made
        as its loop starts)."""
        return getattr(self, "_lock", None) or contextlib.nullcontext()

    def _more_head(self, conn, _fileobj) -> None:
        """The poller: more of a request's bytes have come."""
        self._read_head(conn, len(conn.pd_head), waiting=True)

    def _read_head(self, conn, seen: int, waiting: bool = False) -> bool:
        """Read what has come of the request, without waiting (`seen`: bytes of it already
        looked through). True once the connection is no longer this loop's: a thread has it
        (its head whole, and its body if the loop reads it; or a head past gunicorn's limits,
        for its parser to refuse; or the loop holding --max-bodies-bytes already), or it is
        closed (gone, or a head stalled past its deadline)."""
        head = conn.pd_head
        while True:
            try:
                if self._whole(conn, head, seen):
                    break
            except ConnectionError:
                self._close(conn, waiting)
                return True
            if self._held >= _LOOP_BYTES:
                break  # the loop holds enough: a thread reads the rest
            seen = len(head)
            try:
                got = conn.sock.recv(65536)
            except BlockingIOError:
                return False
            except OSError:
                got = b""
            if not got:
                if conn.pd_need is not None:
                    # A body cut short (the client done sending) or past its deadline: its
                    # answer (400, 408) from a thread.
                    break
                self._close(conn, waiting)
                return True
            head += got
            self._hold(len(got))
            conn.pd_heard = time.monotonic()
        self._to_thread(conn, waiting)
        return True

    def _whole(self, conn, head: bytearray, seen: int) -> bool:
        """Has the loop read what it reads of this request: its head, and its body where it
        reads that too (known length, or chunked: its last chunk in; at most LOOP_BODY_BYTES)?"""
        if conn.pd_need is None:
            end = _head_end(head, seen)
            if end < 0:
                return len(head) > self._head_limit
            taken = _continue(conn.sock, head, end)
            self._hold(-taken)
            end -= taken
            body = _body_to_read(head, end)
            conn.pd_body_at, conn.pd_need = end, (CHUNKED if body == CHUNKED else end + body)
        if conn.pd_need != CHUNKED:
            return len(head) >= conn.pd_need
        if len(head) - conn.pd_body_at > _LOOP_BODY:
            return True
        conn.pd_body_at = _chunks_end(head, conn.pd_body_at)
        return conn.pd_body_at < 0

    def _hold(self, size: int) -> None:
        with self._held_lock:
            self._held += size

    def _to_thread(self, conn, waiting: bool) -> None:
        """A pool thread takes the request (and the bytes the loop read of it)."""
        self._let_go_of(conn, waiting)
        super().enqueue_req(conn)

    def _close(self, conn, waiting: bool) -> None:
        self._let_go_of(conn, waiting)
        self._hold(-len(conn.__dict__.pop("pd_head")))
        self.nr_conns -= 1
        conn.close()

    def _let_go_of(self, conn, waiting: bool) -> None:
        """The loop waits on the connection's socket no more."""
        if waiting:
            self._heads.pop(conn, None)
            try:
                with self._poller_lock:
                    self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass

    def handle(self, conn):
        """In a pool thread: what the loop read goes back in front of the parser."""
        head = conn.__dict__.pop("pd_head", None)
        if head is not None:
            self._hold(-len(head))
            if head:
                conn.data_ready = True  # gunicorn 24+: no wait for its first bytes
                conn.sock.setblocking(True)
                conn.init()
                conn.parser.unreader.unread(bytes(head))
        return super().handle(conn)

    def murder_keepalived(self, *args, **kwargs):
        """gunicorn's sweep of idle connections, once a loop pass; four times a second, the
        requests the loop reads past their deadline too: --request-timeout from their first
        byte and --client-timeout from their last (a head closed; a body to a thread, for its
        408), --keepalive (5 s at least) before their first; 2 s once the worker stops."""
        result = super().murder_keepalived(*args, **kwargs)
        now = time.monotonic()
        if now - self._swept < 0.25 and self.alive:
            return result
        self._swept = now
        if not self.alive and self._stopped_at is None:
            self._stopped_at = now
        for conn, since in list(self._heads.items()):
            if conn.pd_heard is None:
                deadline = since + max(self.cfg.keepalive, 5.0)
            else:
                deadline = min(_DEADLINES.get(conn.sock, now), conn.pd_heard + _CLIENT_TIMEOUT)
            if self._stopped_at is not None:
                deadline = min(deadline, self._stopped_at + STOP_KEEPALIVE_LINGER)
            if now < deadline:
                continue
            if conn.pd_need is not None and self.alive:
                # A body that stopped coming: its thread finds it ended at once (408).
                _DEADLINES[conn.sock] = now
                self._to_thread(conn, waiting=True)
            else:
                self._close(conn, waiting=True)
        return result


class _ThreadClientSocket(_QuietTimeouts, socket.socket):
    """Blocking means: with a timeout (a read or a whole write that takes longer fails). Half-
    closed by the server, it waits for nothing more:
    gunicorn 27 lingers on a closing connection for the client's own close, up to 2 s, in the
    main loop that accepts and dispatches every connection (a client that never closes held
    all of them up: 2 s per refused request of a burst)."""

    __slots__ = ()

    def setblocking(self, flag: bool) -> None:
        if flag:
            super().settimeout(_CLIENT_TIMEOUT)
        else:
            super().setblocking(False)

    def shutdown(self, how: int) -> None:
        super().shutdown(how)
        if how == socket.SHUT_WR:
            # The socket becomes its closing class in place (a class swap mypy cannot follow).
            self.__class__ = _ClosingSocket  # type: ignore[assignment]


class _StalledThreadSocket(_Stalled, _ThreadClientSocket):
    """gthread keeps a connection whose request ended well (a 408) for a next request, in its
    poller: shut for reading, it turns readable at once, and gunicorn closes it (the read is a
    reset) rather than keep it `--keepalive`."""

    __slots__ = ()

    def setblocking(self, flag: bool) -> None:
        super().setblocking(flag)
        if not flag:
            try:
                socket.socket.shutdown(self, socket.SHUT_RD)
            except OSError:
                pass


_ThreadClientSocket._stalled = _StalledThreadSocket


class _ClosingSocket(socket.socket):
    """What the client already sent is drained (no reset cuts the reply's last bytes); what it
    has not sent yet is not waited for."""

    __slots__ = ()

    def settimeout(self, value) -> None:
        super().settimeout(0.0)
