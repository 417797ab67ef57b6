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

import errno
import gc
import socket

import gevent
import gevent.socket
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker
from gunicorn.workers.gthread import ThreadWorker as _ThreadWorker

from gateway.config import Settings

STOP_KEEPALIVE_LINGER = 2.0   # as gunicorn's gthread worker
GC_YOUNG = 10_000             # net new containers between two collections of the young (700)
_THREAD_CLIENT_TIMEOUT: float | None = None    # this gthread worker's --client-timeout


def _client_timeout() -> float:
    return Settings.from_env().client_timeout


def _collect_less() -> None:
    """After the app is loaded: what the worker has is kept for good (`gc.freeze`), and the young
    generation is collected less often (never more often than the interpreter was told)."""
    gc.freeze()
    young, *older = gc.get_threshold()
    if young:        # 0: collection is off; leave it so
        gc.set_threshold(max(young, GC_YOUNG), *older)


class GeventWorker(_GeventWorker):
    def init_process(self) -> None:
        self._idle: dict = {}     # greenlet -> the keep-alive timeout it is waiting under
        self._clients: dict = {}  # greenlet -> the client socket it serves
        self._client_timeout = _client_timeout()
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        _collect_less()

    def handle(self, listener, client, addr) -> None:
        if type(client) is gevent.socket.socket:     # not TLS sockets, whose send differs
            client.__class__ = _ClientSocket
        client.settimeout(self._client_timeout)       # off while it waits for a next request
        glet = gevent.getcurrent()
        self._clients[glet] = client
        try:
            super().handle(listener, client, addr)
        finally:
            del self._clients[glet]

    def timeout_ctx(self) -> "_IdleWait":
        # gunicorn calls this around reading each next request on a connection, only there:
        # the keep-alive wait, bounded by itself (the request's headers with it); the client
        # timeout holds from the headers on.
        return _IdleWait(self._idle, self.cfg.keepalive if self.alive else STOP_KEEPALIVE_LINGER,
                         self._clients.get(gevent.getcurrent()), self._client_timeout)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        gevent.spawn_later(STOP_KEEPALIVE_LINGER, self._let_go)   # out of the signal handler

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
        self.timeout = gevent.Timeout(seconds, False)
        self.client = client
        self.client_timeout = client_timeout

    def __enter__(self) -> gevent.Timeout:
        self.idle[gevent.getcurrent()] = self.timeout
        if self.client is not None:
            self.client.settimeout(None)
        return self.timeout.__enter__()

    def __exit__(self, *exc) -> bool:
        self.idle.pop(gevent.getcurrent(), None)
        if self.client is not None:
            self.client.settimeout(self.client_timeout)
        return self.timeout.__exit__(*exc)


class _QuietTimeouts:
    """A client socket's timeouts (a stalled client) end its request quietly. gunicorn logs a
    socket error with its traceback unless it is a broken pipe or a reset, and a client could
    fill the log with stalls: a plain read that times out finds the end of the stream (gunicorn:
    a client gone; the gateway's body read: 408, `pd_stalled`), and the socket becomes its
    `_stalled` class; a write that times out is a broken pipe. A read with flags (the watcher's
    peek) sees a timeout as what it is."""

    __slots__ = ()
    pd_stalled = False
    _stalled: type          # each socket class's own, set with it

    def sendall(self, data, flags: int = 0) -> None:  # type: ignore[no-untyped-def]
        try:
            super().sendall(data, flags)  # type: ignore[misc]
        except TimeoutError:
            raise BrokenPipeError(errno.EPIPE, "the client took nothing for --client-timeout") \
                from None

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        try:
            return super().recv(bufsize, flags)  # type: ignore[misc]
        except TimeoutError:
            if flags:
                raise
            self.__class__ = self._stalled
            return b""

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:  # type: ignore[no-untyped-def]
        try:
            return super().recv_into(buffer, nbytes, flags)  # type: ignore[misc]
        except TimeoutError:
            if flags:
                raise
            self.__class__ = self._stalled
            return 0


class _Stalled:
    """After the read that timed out (which found the end): the connection is done for, and
    a reset is what gunicorn closes quietly (it drains a body before a next request)."""

    __slots__ = ()
    pd_stalled = True

    def recv(self, *args):  # type: ignore[no-untyped-def]
        raise ConnectionResetError(errno.ECONNRESET, "the client stalled")

    recv_into = recv


class _ClientSocket(_QuietTimeouts, gevent.socket.socket):
    """A gevent socket whose `sendall` tries one send on the OS socket before gevent's loop."""

    __slots__ = ()

    def sendall(self, data, flags=0):  # type: ignore[no-untyped-def]
        try:
            sent = self._sock.send(data, flags)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            super().sendall(memoryview(data)[sent:], flags)


class _StalledClientSocket(_Stalled, _ClientSocket):
    __slots__ = ()


_ClientSocket._stalled = _StalledClientSocket


class ThreadWorker(_ThreadWorker):
    """gunicorn's gthread worker, whose client sockets time out (`--client-timeout`) wherever
    a thread would block on them (gunicorn makes them blocking in the thread that serves a
    request), and whose closing connections never make its main loop wait for the client."""

    def init_process(self) -> None:
        global _THREAD_CLIENT_TIMEOUT
        _THREAD_CLIENT_TIMEOUT = _client_timeout()
        super().init_process()

    def load_wsgi(self) -> None:
        super().load_wsgi()
        _collect_less()

    def enqueue_req(self, conn):  # type: ignore[no-untyped-def]
        # Before gunicorn makes the socket blocking for its thread (in `enqueue_req` up to
        # gunicorn 23, in `handle` later). TLS sockets are left as they are (gunicorn wraps
        # them in its own class): put a buffering proxy in front of a TLS gthread gateway.
        if type(conn.sock) is socket.socket:
            conn.sock.__class__ = _ThreadClientSocket
        return super().enqueue_req(conn)


class _ThreadClientSocket(_QuietTimeouts, socket.socket):
    """Blocking means: with a timeout (a read or a whole write that takes longer fails). Half-
    closed by the server, it waits for nothing more:
    gunicorn 27 lingers on a closing connection for the client's own close, up to 2 s, in the
    main loop that accepts and dispatches every connection (a client that never closes held
    all of them up: 2 s per refused request of a burst)."""

    __slots__ = ()

    def setblocking(self, flag: bool) -> None:
        if flag:
            super().settimeout(_THREAD_CLIENT_TIMEOUT)
        else:
            super().setblocking(False)

    def shutdown(self, how: int) -> None:
        super().shutdown(how)
        if how == socket.SHUT_WR:
            self.__class__ = _ClosingSocket


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

    def settimeout(self, value) -> None:  # type: ignore[no-untyped-def]
        super().settimeout(0.0)
