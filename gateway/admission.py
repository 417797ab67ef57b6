"""Admission control: a bound on the turns one worker has in flight, a short bounded wait for
a place, and a refusal (429 with Retry-After) beyond it, before any engine is called.

A turn relayed to the worker that owns its conversation (which admits it again) holds a thread
or a connection here for as long, so it takes a place too (gateway.service: with gthread among
the turns, with gevent among relays). A turn holds its place until its reply has ended (a stream until its last byte or its client's
disconnect), so streams in flight are never cut to make room: newcomers wait or are refused.

Hand-written: a counter and a condition are all it takes, and `threading.Condition` is what
gevent patches (a greenlet waits cooperatively) as well as what gthread's threads share.
"""
from __future__ import annotations

import threading
import time

from . import metrics
from .errors import Overloaded


class Admission:
    """At most `limit` turns at once; up to `queue` more wait at most `wait` seconds each."""

    def __init__(self, limit: int, queue: int, wait: float, retry_after: int) -> None:
        self.limit = limit
        self.queue = queue
        self.wait = wait
        self.retry_after = retry_after
        self.inflight = 0
        self.waiting = 0
        self._ready = threading.Condition(threading.Lock())

    def enter(self) -> None:
        """Take a place for one turn, or raise `Overloaded`; call `leave` when the turn ends."""
        with self._ready:
            if self.inflight < self.limit:
                self.inflight += 1
                metrics.ADMISSIONS.labels("admitted").inc()
                return
            if self.waiting >= self.queue:
                self._refuse("queue_full")
            self.waiting += 1
            deadline = time.monotonic() + self.wait
            try:
                while self.inflight >= self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._refuse("waited")
                    self._ready.wait(left)
            finally:
                self.waiting -= 1
            self.inflight += 1
            metrics.ADMISSIONS.labels("queued").inc()

    def leave(self) -> None:
        with self._ready:
            self.inflight -= 1
            self._ready.notify()

    def _refuse(self, why: str) -> None:
        metrics.ADMISSIONS.labels(f"rejected_{why}").inc()
        raise Overloaded(f"The gateway is at its limit of {self.limit} turns in flight; "
                         f"retry after {self.retry_after} s", retry_after=self.retry_after)

    def report(self) -> dict:
        return {"turns_in_flight": self.inflight, "turns_waiting": self.waiting,
                "max_turns": self.limit}


class BodyBudget:
    """Bytes of request bodies one worker holds at once, each counted as it arrives and held
    until its turn has ended (the body, what is parsed from it and the engine bodies built from
    it live that long): a body whose next bytes would go beyond `limit` gets 429 before it is
    parsed. A body alone always fits (up to --max-body-bytes), so no size is refused for good,
    and a client that sends slowly holds only what it has sent.

    Why: memory and CPU grow with a body, ~15 times its size in memory and up to ~50 ns a byte
    to parse and identify (a 32 MiB history of 900,000 short messages: 0.5 GB, 1.7 s). Admission
    counts turns, not their size: four such bodies at once took a gevent worker to 1.66 GB."""

    def __init__(self, limit: int, retry_after: int) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self.held = 0
        self._lock = threading.Lock()

    def hold(self) -> BodyHold:
        return BodyHold(self)


class BodyHold:
    """One body's bytes in the budget: `add` as they arrive, `release` (idempotent) at the end."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.size = 0

    def add(self, size: int) -> None:
        budget = self.budget
        with budget._lock:
            if budget.held > self.size and budget.held + size > budget.limit:
                metrics.ADMISSIONS.labels("rejected_bodies").inc()
                raise Overloaded(f"The gateway holds {budget.held} bytes of request bodies, at "
                                 f"its limit of {budget.limit}; retry after "
                                 f"{budget.retry_after} s", retry_after=budget.retry_after)
            budget.held += size
            self.size += size

    def release(self) -> None:
        with self.budget._lock:
            self.budget.held -= self.size
            self.size = 0
