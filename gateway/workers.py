"""gunicorn's gevent worker, with kept-alive connections let go at shutdown and a cheaper
write to clients.

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
"""
from __future__ import annotations

import gevent
import gevent.socket
from gunicorn.workers.ggevent import GeventWorker as _GeventWorker

STOP_KEEPALIVE_LINGER = 2.0   # as gunicorn's gthread worker


class GeventWorker(_GeventWorker):
    def init_process(self) -> None:
        self._idle: dict = {}     # greenlet -> the keep-alive timeout it is waiting under
        super().init_process()

    def handle(self, listener, client, addr) -> None:
        if type(client) is gevent.socket.socket:     # not TLS sockets, whose send differs
            client.__class__ = _ClientSocket
        super().handle(listener, client, addr)

    def timeout_ctx(self) -> "_IdleWait":
        # gunicorn calls this around reading each next request on a connection, only there.
        return _IdleWait(self._idle, self.cfg.keepalive if self.alive else STOP_KEEPALIVE_LINGER)

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
    """gevent.Timeout(seconds, False), registered while the greenlet waits inside it."""

    def __init__(self, idle: dict, seconds: float) -> None:
        self.idle = idle
        self.timeout = gevent.Timeout(seconds, False)

    def __enter__(self) -> gevent.Timeout:
        self.idle[gevent.getcurrent()] = self.timeout
        return self.timeout.__enter__()

    def __exit__(self, *exc) -> bool:
        self.idle.pop(gevent.getcurrent(), None)
        return self.timeout.__exit__(*exc)


class _ClientSocket(gevent.socket.socket):
    """A gevent socket whose `sendall` tries one send on the OS socket before gevent's loop."""

    __slots__ = ()

    def sendall(self, data, flags=0):  # type: ignore[no-untyped-def]
        try:
            sent = self._sock.send(data, flags)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            super().sendall(memoryview(data)[sent:], flags)
