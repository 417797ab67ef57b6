"""Per-key limits: requests and tokens per minute and turns at once, with the headers OpenAI's
API sends (`x-ratelimit-*`, `retry-after`, `retry-after-ms`), which its SDK reads.

Each client API key is a tenant. Its limits come from its line in the keys file
(`KEY rpm=600 tpm=200000 turns=8 weight=2`), else from the defaults (--key-rpm, --key-tpm,
--key-turns); 0 is no limit. Requests and tokens are counted by the `limits` library (the one
Flask-Limiter uses) in fixed one-minute windows, in the store's Redis when the store is one (every
worker and every gateway host share one budget), else in each worker's memory, each worker
enforcing the whole limit: with affinity, a conversation's turns all run in its owner worker, so
a share of the limit per worker would hold a one-conversation client to that share and refuse
every request larger than it. Tokens: the prompt is
estimated from the body before the turn (4 bytes a token) and charged; when the turn ends the
charge is corrected by what the engines reported (P's prompt tokens, the reply's tokens).
Turns at once are counted by the worker's admission (gateway.front.admission), as its places are.

A storage that fails (Redis down) admits: limits must not take the gateway down with them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from limits import RateLimitItemPerMinute
from limits.storage import Storage, storage_from_string

from gateway import redis_url
from gateway.support import metrics
from gateway.support.errors import Overloaded

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4  # a body's bytes per prompt token, for the estimate before the turn
_KEY_PREFIX = "pd-gateway-limits"


@dataclass(frozen=True)
class KeyLimits:
    """One key's limits (0: none) and its weight in fair admission."""

    rpm: int = 0
    tpm: int = 0
    turns: int = 0
    weight: float = 1.0

    @classmethod
    def parse(cls, options: list[str], defaults: KeyLimits) -> KeyLimits:
        """`rpm=600 tpm=200000 turns=8 weight=2` over `defaults`; ValueError names a bad one."""
        values: dict[str, float] = {
            "rpm": defaults.rpm,
            "tpm": defaults.tpm,
            "turns": defaults.turns,
            "weight": defaults.weight,
        }
        for option in options:
            name, eq, raw = option.partition("=")
            if not eq or name not in values:
                raise ValueError(f"{option!r} is not one of rpm=, tpm=, turns=, weight=")
            value = float(raw) if name == "weight" else int(raw)
            if value < 0 or (name == "weight" and value == 0) or not math.isfinite(value):
                raise ValueError(f"{option!r} must be positive")
            values[name] = value
        # The counts were parsed by int() (the defaults are ints): int() only tells mypy.
        return cls(
            rpm=int(values["rpm"]),
            tpm=int(values["tpm"]),
            turns=int(values["turns"]),
            weight=values["weight"],
        )


def duration(seconds: float) -> str:
    """A reset time as OpenAI's headers write it: "1s", "6m0s", "120ms"."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


class RateLimited(Overloaded):
    """A key over its requests or tokens per minute: 429 with OpenAI's headers."""

    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after: float, headers: dict[str, str]) -> None:
        super().__init__(message, retry_after=max(1, math.ceil(retry_after)))
        self.wait_ms = max(1, int(retry_after * 1000))
        self.limit_headers = headers

    def headers(self) -> dict[str, str]:
        return {
            **self.limit_headers,
            "Retry-After": str(self.retry_after),
            "retry-after-ms": str(self.wait_ms),
        }


@dataclass
class Ticket:
    """One admitted request's count: its headers; `charge`, the correction once the turn has
    ended (or failed after an engine worked for it); `refund`, what gives it all back if no
    engine did (refused for a place, an engine that failed first). Whichever comes first is
    the one that counts."""

    headers: dict[str, str]
    charge: Callable[[int], None] = lambda tokens: None
    refund: Callable[[], None] = lambda: None
    estimate: int = 1  # the prompt's tokens as counted before the turn


NO_TICKET = Ticket({})
NO_LIMITS = KeyLimits()


def storage_url(store: str) -> tuple[str, dict]:
    """The `limits` storage for the gateway's --store: its Redis (a cluster, a Sentinel set)
    where it is one, else memory; and the storage's options."""
    if store == "local":
        return "memory://", {}
    options: dict = {"key_prefix": _KEY_PREFIX}
    url = redis_url.parse(store)
    if url.scheme == "unix":
        return "redis+unix://" + url.rest, options
    if url.tls and url.kind != "primary":  # limits names TLS by the option, not the scheme
        return f"redis+{url.kind}://{url.rest}", {**options, "ssl": True}
    return store, options


class Tenants:
    """Checks and counts each key's requests and tokens per minute."""

    def __init__(self, store: str, timeout: float, clock: Callable[[], float] = time.time) -> None:
        self.url, self.options = storage_url(store)
        if self.options:
            self.options.update(socket_timeout=timeout, socket_connect_timeout=timeout)
        self.clock = clock
        # Made on first use (a cluster's client asks its seeds at once); requests are admitted
        # uncounted while it cannot be made or a second after a call failed.
        # why the cast: storage_from_string's type includes limits.aio's storages, and the
        # URLs made here (memory://, redis*://) are all synchronous ones.
        self._storage = redis_url.Lazy(
            lambda: cast(Storage, storage_from_string(self.url, **self.options)), timeout
        )
        self._ends: dict[str, float] = {}  # each counter's window end, as last asked
        # Keys whose requests of this window are spent, as this worker counted them: until the
        # window ends, their next request is refused before its body is read.
        self._spent: dict[str, tuple[float, dict[str, str]]] = {}

    def refuse_early(self, tenant: str, limits: KeyLimits) -> None:
        """Raise RateLimited if `tenant`'s requests of this window are spent: before its body
        is parsed (a key already over its limit would otherwise still cost the worker the parse
        of whatever body it sends). Asked of the counter itself, and only for a key this worker
        has refused in this window: a refund (here, in another worker, on another host) or a
        new limit may have left it a request."""
        spent = self._spent.get(tenant) if limits.rpm else None
        if spent is None:
            return
        until, headers = spent
        now = self.clock()
        try:
            item = self._item(limits.rpm)
            count = self._storage.get().get(item.key_for(tenant, "requests")) if now < until else 0
        except Exception:  # the storage failing: the turn's own count decides
            return
        if count < limits.rpm:
            self._spent.pop(tenant, None)
            return
        metrics.RATE_LIMITED.labels("requests").inc()
        reset = max(0.001, until - now)
        raise RateLimited(
            f"Rate limit reached for requests per minute: limit {limits.rpm}. "
            f"Please try again in {duration(reset)}.",
            reset,
            {**headers, "x-ratelimit-reset-requests": duration(reset)},
        )

    def _window_end(self, storage, key: str, now: float) -> float:
        """When `key`'s window ends: asked once a window (a Redis round trip), then known."""
        end = self._ends.get(key)
        if end is None or end <= now:
            end = storage.get_expiry(key)
            if len(self._ends) > 100_000:
                self._ends.clear()
            self._ends[key] = end
        return end

    @staticmethod
    def _item(per_minute: int) -> RateLimitItemPerMinute:
        return RateLimitItemPerMinute(per_minute)

    def admit(self, tenant: str, limits: KeyLimits, body_bytes: int) -> Ticket:
        """Count one request of `tenant` and its estimated prompt tokens, or raise RateLimited
        (nothing counted). The ticket's headers go on the reply."""
        if not (limits.rpm or limits.tpm):
            return NO_TICKET
        estimate = max(1, body_bytes // BYTES_PER_TOKEN)
        checks = [("requests", self._item(limits.rpm), 1)] if limits.rpm else []
        if limits.tpm:
            checks.append(("tokens", self._item(limits.tpm), estimate))
        try:
            storage = self._storage.get()
            now = self.clock()
            counted, headers = [], {}
            for kind, item, cost in checks:
                # Counted first, given back if over: one call where a test and a hit take two.
                key = item.key_for(tenant, kind)
                count = storage.incr(key, item.get_expiry(), amount=cost)
                counted.append((key, item, cost))
                reset = max(0.001, self._window_end(storage, key, now) - now)
                headers.update(
                    {
                        f"x-ratelimit-limit-{kind}": str(item.amount),
                        f"x-ratelimit-remaining-{kind}": str(max(0, item.amount - count)),
                        f"x-ratelimit-reset-{kind}": duration(reset),
                    }
                )
                if count > item.amount:
                    for given_key, given_item, given in counted:
                        storage.incr(given_key, given_item.get_expiry(), amount=-given)
                    headers[f"x-ratelimit-remaining-{kind}"] = str(
                        max(0, item.amount - count + cost)
                    )
                    if kind == "requests":  # its next: refused before its body
                        self._spend(tenant, now + reset, headers)
                    metrics.RATE_LIMITED.labels(kind).inc()
                    raise RateLimited(
                        f"Rate limit reached for {kind} per minute: limit {item.amount}"
                        + (f", requested {cost}" if kind == "tokens" else "")
                        + f". Please try again in {duration(reset)}.",
                        reset,
                        headers,
                    )
        except RateLimited:
            raise
        except Exception as exc:  # the storage failed: admit, uncounted, for a second
            self._failed(exc)
            return NO_TICKET
        settled: list[bool] = []
        window_end = self._ends.get(counted[-1][0], 0.0)

        def charge(tokens: int) -> None:
            """The real tokens of the turn in place of the estimate. Tokens are given back
            only within the window they were counted in: a counter that has started again
            must not start below zero."""
            if settled:
                return
            settled.append(True)
            if (
                not limits.tpm
                or tokens == estimate
                or (tokens < estimate and self.clock() >= window_end)
            ):
                return
            key, item, _ = counted[-1]
            self._incr(storage, key, item, tokens - estimate)

        def refund() -> None:
            if settled:
                return
            settled.append(True)
            if self.clock() < window_end:
                for key, item, cost in counted:
                    self._incr(storage, key, item, -cost)

        return Ticket(headers, charge, refund, estimate)

    def _spend(self, tenant: str, until: float, headers: dict[str, str]) -> None:
        if len(self._spent) > 100_000:  # keys come and go: forget the lot
            self._spent.clear()
        self._spent[tenant] = (until, {**headers, "x-ratelimit-remaining-requests": "0"})

    def _incr(self, storage, key: str, item, amount: int) -> None:
        try:
            storage.incr(key, item.get_expiry(), amount=amount)
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        log.warning("rate limit storage failed: %r; requests admitted uncounted for a second", exc)
        metrics.STORE_ERRORS.labels("limits").inc()
        self._storage.failed()
