"""Admission control: a bound on the turns one worker has in flight, a short bounded wait for
a place, and a refusal (429 with Retry-After) beyond it, before any engine is called.

A turn relayed to the worker that owns its conversation (which admits it again) holds a thread
or a connection here for as long, so it takes a place too (gateway.service: with gthread among
the turns, with gevent among relays). A turn holds its place until its reply has ended (a stream
until its last byte or its client's disconnect), so streams in flight are never cut to make room:
newcomers wait or are refused.

Hand-written: a counter and a condition are all it takes, and `threading.Condition` is what
gevent patches (a greenlet waits cooperatively) as well as what gthread's threads share.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gateway.support import metrics
from gateway.support.errors import Overloaded

# A tenant that sent a turn this recently keeps a claim to its share of places.
ACTIVE_SECONDS = 10.0


class _Tenant:
    __slots__ = ("inflight", "waiting", "weight", "demand", "seen")

    def __init__(self, weight: float) -> None:
        self.inflight = self.waiting = self.demand = 0
        self.weight = weight
        self.seen = 0.0


class Admission:
    """At most `limit` turns at once; up to `queue` more wait at most `wait` seconds each.

    Places are shared between tenants (client keys) by weight, not first come: each tenant
    active in the last ACTIVE_SECONDS is entitled to `limit x weight / the active tenants'
    weights`, and the places it is entitled to and may need (up to the most it has had at
    once) stay free for it: another tenant takes them only within its own share. A waiting
    turn gets a freed place in weighted-fair order (the tenant with the fewest turns for its
    weight first). One tenant (no client keys) is first come, as before.

    A turn of a tenant under its share that finds no free place waits for the next freed one
    up to `fair_wait` seconds (other turns `wait`; one such turn a tenant, at most `patient`
    at once and within `queue`, as each holds a thread with gthread; one whose client has
    left gives up): with places held by long turns of a tenant over its share, a short wait
    and a client's retries could all end before any place was freed (a key back after a pause
    got 429 on every try). Refused even so, its claim to its share is kept: a tenant stays
    active for ACTIVE_SECONDS after its last turn (twice the Retry-After if longer), so its
    client's retry finds the place it claimed."""

    def __init__(
        self,
        limit: int,
        queue: int,
        wait: float,
        retry_after: int,
        fair_wait: float = 0.0,
        patient: int = 0,
        clock=time.monotonic,
    ) -> None:
        self.limit = limit
        self.queue = queue
        self.wait = wait
        self.retry_after = retry_after
        self.fair_wait = fair_wait
        self.patient = patient
        self.inflight = 0
        self.waiting = 0
        self.waiting_for_share = 0
        # A refused tenant's claim outlasts the wait its Retry-After asks for, and a retry.
        self.active_seconds = max(ACTIVE_SECONDS, 2.0 * retry_after)
        self.clock = clock
        self.tenants: dict[str, _Tenant] = {}
        self._ready = threading.Condition(threading.Lock())

    def enter(
        self,
        tenant: str = "",
        weight: float = 1.0,
        turns: int = 0,
        gone: Callable[[], bool] | None = None,
    ) -> Callable[[], None]:
        """Take a place for one of `tenant`'s turns (at most `turns` at once, waiting ones
        counted; 0: no bound), or raise `Overloaded`; returns what gives it back when the turn
        ends. `gone()`: has the turn's client left? (asked each second of a long wait)"""
        with self._ready:
            now = self.clock()
            own = self._tenant(tenant, weight, now)
            if turns and own.inflight + own.waiting >= turns:
                metrics.ADMISSIONS.labels("rejected_key_turns").inc()
                raise Overloaded(
                    f"This key has its limit of {turns} turns at once in flight; "
                    f"retry after {self.retry_after} s",
                    retry_after=self.retry_after,
                )
            own.demand = max(own.demand, own.inflight + 1)
            if self._may_take(own) and self._before_waiters(own):
                self._take(own)
                metrics.ADMISSIONS.labels("admitted").inc()
                return lambda: self._leave(own)
            # One turn of a key at a time waits long: a key cannot take every such wait.
            patient = (
                self.fair_wait > self.wait
                and self.waiting_for_share < self.patient
                and not own.waiting
                and self._under_share(own, now)
            )
            if self.waiting >= self.queue:
                self._refuse("queue_full")
            self.waiting += 1
            own.waiting += 1
            self.waiting_for_share += patient
            deadline = now + (self.fair_wait if patient else self.wait)
            try:
                while not (self._may_take(own) and self._next_in_line() is own):
                    left = deadline - self.clock()
                    if left <= 0:
                        own.seen = self.clock()  # its claim outlives the Retry-After
                        self._refuse("waited")
                    if patient and gone is not None and gone():
                        self._refuse("client_gone")  # its place to the next in line
                    self._ready.wait(min(left, 1.0) if patient else left)
            finally:
                self.waiting -= 1
                own.waiting -= 1
                self.waiting_for_share -= patient
                self._ready.notify_all()  # the next in line may be another tenant
            self._take(own)
            metrics.ADMISSIONS.labels("queued").inc()
            return lambda: self._leave(own)

    def leave(self) -> None:
        """Give back a place of the one tenant (no client keys): `enter()`'s own."""
        self._leave(self.tenants[""])

    def _tenant(self, name: str, weight: float, now: float) -> _Tenant:
        own = self.tenants.get(name)
        if own is None:
            if len(self.tenants) > 64:  # forget those gone quiet (bounded work, amortized)
                for gone in [k for k, t in self.tenants.items() if not self._active(t, now)]:
                    del self.tenants[gone]
            own = self.tenants[name] = _Tenant(weight)
        elif not self._active(own, now):
            own.demand = 0  # back after a pause: its need starts again
        own.weight, own.seen = weight, now
        return own

    def _active(self, t: _Tenant, now: float) -> bool:
        return t.inflight > 0 or t.waiting > 0 or now - t.seen < self.active_seconds

    def _may_take(self, own: _Tenant) -> bool:
        if self.inflight >= self.limit:
            return False
        if len(self.tenants) == 1:
            return True
        now = self.clock()
        active = [t for t in self.tenants.values() if t is own or self._active(t, now)]
        total = sum(t.weight for t in active)
        reserved = sum(
            max(0, min(self.limit * t.weight / total, t.demand) - t.inflight)
            for t in active
            if t is not own
        )
        return (
            self.inflight + reserved < self.limit or own.inflight < self.limit * own.weight / total
        )

    def _under_share(self, own: _Tenant, now: float) -> bool:
        """Has `own` fewer turns (in flight and waiting) than its share, beside other active
        tenants? (One tenant alone is first come: no share to wait for.)"""
        active = [t for t in self.tenants.values() if t is own or self._active(t, now)]
        if len(active) < 2:
            return False
        total = sum(t.weight for t in active)
        return own.inflight + own.waiting < self.limit * own.weight / total

    def _before_waiters(self, own: _Tenant) -> bool:
        """May a newcomer of `own` take a free place now: no waiting tenant that may take one
        has fewer turns for its weight (one tenant: first come, as the place is free)."""
        if not self.waiting:
            return True
        first = self._next_in_line()
        return first is None or own.inflight / own.weight <= first.inflight / first.weight

    def _next_in_line(self) -> _Tenant | None:
        """Of the waiting tenants that may take a place, the one with the fewest turns for its
        weight."""
        return min(
            (t for t in self.tenants.values() if t.waiting and self._may_take(t)),
            key=lambda t: t.inflight / t.weight,
            default=None,
        )

    def _take(self, own: _Tenant) -> None:
        self.inflight += 1
        own.inflight += 1

    def _leave(self, own: _Tenant) -> None:
        with self._ready:
            self.inflight -= 1
            own.inflight -= 1
            own.seen = self.clock()
            self._ready.notify_all()

    def _refuse(self, why: str) -> None:
        metrics.ADMISSIONS.labels(f"rejected_{why}").inc()
        raise Overloaded(
            f"The gateway is at its limit of {self.limit} turns in flight; "
            f"retry after {self.retry_after} s",
            retry_after=self.retry_after,
        )

    def report(self) -> dict:
        return {
            "turns_in_flight": self.inflight,
            "turns_waiting": self.waiting,
            "max_turns": self.limit,
        }


class BodyBudget:
    """Bytes of request bodies one worker holds at once, each counted as it arrives and held
    until its turn has ended (the body, what is parsed from it and the engine bodies built from
    it live that long): a body whose next bytes would go beyond `limit` gets 429 before it is
    parsed. A body alone always fits (up to --max-body-bytes), so no size is refused for good,
    and a client that sends slowly holds only what it has sent.

    Why: memory and CPU grow with a body, some 15 times its size in memory, from before it is
    read until its turn ends (docs/production.md, "Big bodies", has the figures), and admission
    counts turns, not their size: a few big bodies at once could take a worker past its memory."""

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
                raise Overloaded(
                    f"The gateway holds {budget.held} bytes of request bodies, at "
                    f"its limit of {budget.limit}; retry after "
                    f"{budget.retry_after} s",
                    retry_after=budget.retry_after,
                )
            budget.held += size
            self.size += size

    def release(self) -> None:
        with self.budget._lock:
            self.budget.held -= self.size
            self.size = 0
