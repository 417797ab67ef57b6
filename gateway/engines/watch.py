"""Cancelling one request's engine calls: a watcher of its client socket and deadline, which
each engine connection registers with while in use (gateway.engines.transport)."""

from __future__ import annotations

import contextlib
import contextvars
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import gevent
from gevent import monkey

from gateway.support.errors import ClientGone, GatewayError, GatewayTimeout

if TYPE_CHECKING:
    from gevent._types import _IoWatcher, _TimerWatcher

_WATCH: contextvars.ContextVar[Watch | None] = contextvars.ContextVar(
    "pd_gateway_watch", default=None
)
NOT_WAITING = float("inf")  # Watch.heard_at while its stream is not waiting for bytes


class Watch:
    """Ends one request's engine calls when its client goes away or its deadline passes.

    WSGI has no disconnect event: a gone client is only noticed at the next write, which
    during a long prefill is never. So the client socket and the clock are watched beside the
    request and, on EOF or at the deadline, the engine sockets this request is using are shut
    down; the blocked read fails at once and the caller sees `ClientGone` or a timeout.
    Under gevent the event loop watches them itself (a socket watcher and a timer whose
    callbacks run in the hub: no greenlet, no poll object, no wake-up of the request's own
    greenlet: less CPU a turn than a watching greenlet, most with many turns at once; the figure
    is in docs/BENCHMARKS.md, "The figures behind smaller choices"); with threads, a background
    thread polls.
    """

    POLL_SECONDS = 0.5  # how long a finished request's watcher may linger
    live = 0  # watchers running in this process (the admin report shows it)
    _live_lock = threading.Lock()

    def __init__(self, client: socket.socket | None, deadline: float | None) -> None:
        self.client = client
        self.deadline = deadline
        self.gone = False
        self.expired = False
        # The read timeout of a stream this watch keeps (`keep_quiet_limit`): the stream sets
        # `heard_at` when it starts to wait for bytes (infinity while it is not waiting: its
        # client is taking the last ones); waiting for `quiet_limit` seconds, it is cut.
        self.quiet_limit: float | None = None
        self.quiet_source = ""
        self.heard_at = 0.0
        self.silent = False
        self._running = client is not None or deadline is not None
        self._connections: list[Any] = []
        self._lock = threading.Lock()
        self._done = False
        # The event loop's watchers, under gevent.
        self._io: _IoWatcher | None = None
        self._timer: _TimerWatcher | None = None
        self._looped = self._running and monkey.is_module_patched("threading")
        self._counted = False  # in Watch.live, under gevent
        if self._looped:
            self._loop = gevent.get_hub().loop
            if client is not None:
                self._raw = getattr(client, "_sock", client)
                self._io = self._loop.io(client.fileno(), 1)  # 1: readable
                self._io.start(self._readable)
            self._arm()
            self._counted = True
        if self._running:
            with Watch._live_lock:
                Watch.live += 1
            if not self._looped:
                threading.Thread(target=self._watch, name="pd-gateway-watch", daemon=True).start()
        self._token = _WATCH.set(self)

    def track(self, connection: Any) -> None:
        """Register a connection this request is about to use; refuse if the request is
        already cut (its client left, or its deadline passed, before this call began)."""
        with self._lock:
            if self.gone or self.expired or self.silent:
                raise ConnectionAbortedError("the request was cut before this engine call")
            self._connections.append(connection)

    def untrack(self, connection: Any = None) -> None:
        with self._lock:
            if connection is None:
                self._connections.clear()
            elif connection in self._connections:
                self._connections.remove(connection)

    def keep_quiet_limit(self, seconds: float, source: str) -> bool:
        """Take over a stream's read timeout (its socket then needs none): cut the request's
        connections if the stream is silent for `seconds`. False if this watch has no thread
        to do it (no client socket and no deadline): the socket keeps its own timeout.

        Why: under gevent a socket timeout costs a Timeout (a timer started and stopped) on
        every wait for bytes, that is on every token of every stream."""
        if not self._running:
            return False
        self.quiet_source = source
        self.heard_at = time.monotonic()
        self.quiet_limit = seconds
        if self._looped:
            self._arm()
        return True

    def error(self) -> GatewayError | None:
        """Why this request's engine calls were cut, if they were."""
        if self.gone:
            return ClientGone("the client closed the connection")
        if self.silent:
            return GatewayTimeout(f"{self.quiet_source} sent nothing for {self.quiet_limit:g} s")
        if self.expired:
            return GatewayTimeout(
                "the request took longer than its total deadline", instance_fault=False
            )
        return None

    def stop(self) -> None:
        self._done = True
        self.untrack()
        # Now, not at a next wake: while a watcher of the client socket is active, gevent
        # defers closing that socket (loop.closing_fd) until the loop next wakes, so a
        # `Connection: close` client saw every response end 0.1-0.5 s late.
        self._stop_watchers()
        try:
            _WATCH.reset(self._token)
        except ValueError:  # stopped from another context (a generator's close)
            _WATCH.set(None)

    # --- under gevent: the event loop's watchers, their callbacks run in the hub -------------

    def _arm(self) -> None:
        """(Re)start the timer for the earliest of the deadline and the stream's quiet limit."""
        if self._timer is not None:
            self._timer.stop()
            self._timer.close()
            self._timer = None
        if self._done:
            return
        now = time.monotonic()
        due = self.deadline if self.deadline is not None else NOT_WAITING
        if self.quiet_limit is not None:
            # While its client takes the bytes (NOT_WAITING) the stream is not silent: look
            # again a whole limit from now, never later (the thread looks every 0.5 s).
            waiting_since = self.heard_at if self.heard_at != NOT_WAITING else now
            due = min(due, waiting_since + self.quiet_limit)
        if due == NOT_WAITING:
            return  # no deadline, no stream's limit yet: only the socket is watched
        self._timer = timer = self._loop.timer(max(due - now, 0.0))
        timer.start(self._tick)

    def _tick(self) -> None:
        if self._done:
            return
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            self.expired = True
        elif self.quiet_limit is not None and now >= self.heard_at + self.quiet_limit:
            self.silent = True
        else:
            return self._arm()
        self._stop_watchers()
        gevent.spawn(self._cut)  # a greenlet may wait for the lock; the hub must not

    def _readable(self) -> None:
        if self._done:
            return
        # Registered only with a client, and stopped (watchers None) before the watch ends.
        assert self.client is not None and self._io is not None
        if self.client.fileno() < 0:  # closed under us (gevent tells its watchers so)
            self._stop_watchers()
            return
        try:
            # The raw socket, without waiting: gevent's recv would wait on the socket's read
            # event on EAGAIN, which the request's own greenlet may be using.
            peeked = self._raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            peeked = b""
        self._io.stop()  # readable it stays: look no more
        if peeked:
            return  # a pipelined next request: keep only the deadline
        self.gone = True
        self._stop_watchers()
        gevent.spawn(self._cut)

    def _stop_watchers(self) -> None:
        """Stop and close the loop's watchers; the watch is no longer live (cut or stopped)."""
        for watcher in (self._io, self._timer):
            if watcher is not None:
                watcher.stop()
                watcher.close()
        if self._counted:
            self._counted = False
            with Watch._live_lock:
                Watch.live -= 1
        self._io = self._timer = None

    # --- with threads: a thread polls ----------------------------------------------------------

    def _watch(self) -> None:
        try:
            self._run()
        finally:
            with Watch._live_lock:
                Watch.live -= 1

    def _run(self) -> None:
        poller = None
        client = self.client
        if client is not None:
            poller = select.poll()
            poller.register(client, select.POLLIN | select.POLLHUP)
        while not self._done:
            wait = self.POLL_SECONDS
            if self.deadline is not None:
                wait = min(wait, self.deadline - time.monotonic())
                if wait <= 0:
                    self.expired = True
                    return self._cut()
            if self.quiet_limit is not None:
                quiet_left = self.heard_at + self.quiet_limit - time.monotonic()
                if quiet_left <= 0:
                    self.silent = True
                    return self._cut()
                wait = min(wait, quiet_left)
            if poller is None or client is None:  # (both or neither)
                time.sleep(wait)
                continue
            if poller.poll(wait * 1000) and not self._done:
                try:
                    # The raw socket: gevent's recv would wait on the socket's read event on
                    # EAGAIN, which the request's own greenlet may be using (it reads the next
                    # request on a kept-alive connection): ConcurrentObjectUseError.
                    raw: socket.socket = getattr(client, "_sock", client)
                    peeked = raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    peeked = b""
                if peeked:
                    poller = None  # a pipelined next request: keep only the deadline
                    continue
                self.gone = True
                return self._cut()

    def _cut(self) -> None:
        # Under the lock: a connection given back to the pool is untracked under it first
        # (`EnginePool.put`), so one that another request may reuse is never cut; and
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


def current_watch() -> Watch | None:
    """The watch of the request this thread (or greenlet) is serving, if any."""
    return _WATCH.get()


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """Engine calls made for no client (its reply is out already): neither cut when the client
    leaves nor bound by its deadline; give them a timeout of their own."""
    token = _WATCH.set(None)
    try:
        yield
    finally:
        _WATCH.reset(token)
