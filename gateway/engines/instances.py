"""What this process knows of the engines: instances, their pools (whose instance sets may change
while the process runs), the choice between them, breakers, and the prober that asks each engine
whether it answers, from the start."""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit, urlunsplit

from cachetools import LRUCache

from gateway.engines.cost import CostModel, Need, cheapest
from gateway.support import metrics
from gateway.support.errors import ServiceUnavailable
from gateway.support.fanout import Fanout

log = logging.getLogger(__name__)

# What every P and D needs (README, "The vLLM engines"): the NIXL connector, both roles, and
# bidirectional transfer, off by default (vLLM 0.33.0 nixl/base_scheduler.py ~L174-180), without
# which a D keeps nothing after a turn (nixl/pull_scheduler.py ~L232-233) and a P reads nothing
# from a D (~L130-134).
KV_TRANSFER_CONFIG = (
    '--kv-transfer-config \'{"kv_connector":"NixlConnector",'
    '"kv_role":"kv_both","kv_connector_extra_config":'
    '{"bidirectional_kv_xfer":true}}\''
)
MISSES = 2  # probes in a row an engine that answered before may miss before it is down
CONCURRENT = 8  # probes at once in a round


def public_url(url: str) -> str:
    """An engine URL (or an origin, "dns:<url>") without the user:password it may carry: never
    in logs, metrics or reports. The host is what follows the last "@" of the netloc, as
    urllib reads it, whatever the password holds."""
    if "@" not in url:
        return url  # most URLs, on every pinned-count update: no parse
    prefix = "dns:" if url.startswith("dns:") else ""
    parts = urlsplit(url[len(prefix) :])
    if "@" not in parts.netloc:
        return url
    return prefix + urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass(frozen=True)
class Policy:
    """How a pool chooses and when it stops choosing an instance."""

    routing: str = "affinity"  # "affinity" (the cheapest by `cost`) or "round_robin"
    overload_factor: float = 2.0  # skip an instance whose in-flight > factor x (least + 1)
    cost: CostModel = CostModel()  # affinity: how P and D weigh work, pulls and queues
    # Conversations whose last P (when not their rendezvous first) a P pool remembers: as many
    # as the worker keeps entries for (--store-size), the conversations it serves.
    conversations: int = 100_000
    breaker_failures: int = 3  # consecutive failures that open the breaker
    breaker_cooldown: float = 10.0  # seconds an open breaker skips the instance


@dataclass(eq=False)
class Instance:
    """One engine and what this process knows of it.

    `name` (e.g. "prefill[0]") is what clients may see; the URL stays inside the gateway. The
    number is given once per pool and never reused, so a name stays its instance's while it lives.
    `origin` says where it came from: "settings", "admin", or "dns:" + the settings URL whose
    host name resolved to this instance's address.
    """

    url: str
    role: str
    index: int
    origin: str = "settings"
    model: str = ""  # with several models, its model's name (in `name`)
    host: str = field(init=False)
    base_path: str = field(init=False)  # the URL's own path, before the API's (usually "")
    credentials: tuple[str, str] | None = field(init=False)  # user:password in the URL
    salt: bytes = field(init=False)
    inflight: int = 0
    queued: int = 0  # a P: the prefill work (Need, costed) this process has in flight
    prefills: int = 0  # a D: of `inflight`, P calls (--prefill-on-decode), not streams
    down: bool = False  # a connection or a probe failed: skipped until a probe answers
    failures: int = 0  # consecutive failed requests
    open_until: float = 0.0  # breaker: skipped until then, then tried again (half-open)
    # The last probe's answer (Prober): None before the first, or with probes off.
    answered: bool | None = None
    missed: int = 0  # probes in a row it did not answer
    served: tuple[str, ...] | None = None  # the models its /v1/models lists, once it answered
    why: str = ""  # why the last probe found it not ready
    # A D: did its last finished two-stage turn return kv_transfer_params (keep its blocks for
    # the next turn's P)? None before any; and how many such turns kept nothing.
    keeps_blocks: bool | None = None
    kept_nothing: int = 0
    warned: bool = False  # ...said once (per worker)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        self.host = parts.hostname or ""
        self.base_path = parts.path.rstrip("/")
        self.credentials = (
            (unquote(parts.username or ""), unquote(parts.password or ""))
            if parts.username or parts.password
            else None
        )
        self.salt = self.url.encode()

    @property
    def name(self) -> str:
        own = f"{self.role}[{self.index}]"
        return f"{self.model}/{own}" if self.model else own

    @property
    def public_url(self) -> str:
        """The URL as logs and reports show it: without the user:password it may carry."""
        return public_url(self.url)

    def available(self, now: float) -> bool:
        return not self.down and now >= self.open_until

    def state(self, now: float) -> str:
        if self.down:
            return "down"
        if now < self.open_until:
            return "open"
        # Cooled down but not yet proven: the next failure opens it again at once.
        return "half-open" if self.open_until else "up"


class Counts(Protocol):
    """Every worker's in-flight counts on this host (gateway.engines.host_counts.HostCounts)."""

    def sync(self, instance: Instance) -> None: ...

    def queued(self, instance: Instance) -> int: ...

    def inflight(self, instance: Instance) -> int: ...


def _weight(key: bytes, instance: Instance) -> bytes:
    return hashlib.blake2b(key, digest_size=8, key=instance.salt[-64:]).digest()


def _first(
    key: bytes, instances: Sequence[Instance], ranked: Sequence[Instance] = ()
) -> Instance | None:
    """The first of every instance in rendezvous order of `key`: `ranked[0]` where `ranked` (the
    candidates, in that order) holds them all. Of every instance, not only the candidates: the
    first excluded (a retry) or down, the next in order is no more at home than any other."""
    if len(ranked) == len(instances):
        return ranked[0] if ranked else None
    return max(instances, key=lambda i: _weight(key, i), default=None)


class Pool:
    """The instances of one role: health, in-flight counts, breakers, and the choice between them.

    Instances come and go at run time (`add`, `remove`, `sync`), under the lock. `instances` is
    replaced, never changed in place, so a reader without the lock sees one whole set. A removed
    instance is never chosen again, but the requests and streams on it keep it (acquire and
    release work on the object), so they finish there.
    """

    def __init__(
        self,
        role: str,
        urls: list[str],
        policy: Policy = Policy(),
        clock: Callable[[], float] = time.monotonic,
        model: str = "",
    ) -> None:
        self.role = role
        self.model = model
        self.policy = policy
        self.instances: list[Instance] = []
        self._by_url: dict[str, Instance] = {}
        self._numbers = itertools.count()
        self._turn = 0  # round robin: where the next search starts
        # A P: the URL of the P that prefilled each conversation's last turn, where it is not
        # the conversation's rendezvous first (`prefilled`); under the lock.
        self._prefilled: LRUCache[str, str] = LRUCache(policy.conversations)
        self._lock = threading.Lock()
        self._clock = clock
        self.on_down: Callable[[], None] | None = None  # wakes the prober (down, or added)
        # Are the instances probed (Prober)? Then one is ready only once it answered; without
        # probes, every instance not marked down is taken as ready.
        self.probed = False
        # Is an instance queueing or full by its own report (gateway.engines.engine_load)? None: no
        # reports, in-flight counts alone.
        self.busy: Callable[[Instance], bool] | None = None
        self.reported: Callable[[Instance], object] | None = None  # for report()
        # Its fresh report (waiting, running), for the cost; None: no reports.
        self.load: Callable[[Instance], Any] | None = None
        # Every worker's in-flight counts on this host (gateway.engines.host_counts), which
        # `acquire` and `release` add to; None: this process's own (not under gunicorn).
        self.counts: Counts | None = None
        # A P pool's Ds that may take a prefill when every P has more queued than they
        # (--prefill-on-decode: the same model's D pool; `_spill`); None: Ps only.
        self.spill: Pool | None = None
        for url in urls:
            self.add(url)

    def add(self, url: str, origin: str = "settings") -> tuple[Instance, bool]:
        """The instance at `url`, added unless it is there already; and whether it is new."""
        with self._lock:
            found = self._by_url.get(url)
            if found is not None:
                return found, False
            instance = Instance(url, self.role, next(self._numbers), origin, self.model)
            self._by_url[url] = instance
            self.instances = [*self.instances, instance]
        # Run-time changes are news; the settings' own instances are not.
        (log.debug if origin == "settings" else log.info)(
            "%s (%s) added (%s)", instance.name, instance.public_url, public_url(origin)
        )
        if self.on_down is not None:  # probed at once, not at the next round
            self.on_down()
        return instance, True

    def remove(self, url: str) -> Instance | None:
        """Take the instance at `url` out of the pool (None if it is not there). What runs on it
        finishes; nothing new is sent to it."""
        with self._lock:
            instance = self._by_url.pop(url, None)
            if instance is None:
                return None
            self.instances = [i for i in self.instances if i is not instance]
        log.info(
            "%s (%s) removed (%d in flight finish there)",
            instance.name,
            instance.public_url,
            instance.inflight,
        )
        return instance

    def sync(self, origin: str, urls: list[str]) -> tuple[list[Instance], list[Instance]]:
        """Make the instances of `origin` exactly `urls` (a name's addresses, just resolved):
        the instances added and those removed. An instance of another origin at one of the
        URLs stays as it is."""
        wanted = set(urls)
        gone = [i.url for i in self.instances if i.origin == origin and i.url not in wanted]
        removed = [i for i in map(self.remove, gone) if i is not None]
        added = [i for i, new in (self.add(url, origin) for url in urls) if new]
        return added, removed

    def get(self, url: str | None) -> Instance | None:
        """The instance at `url` if it is in the pool now."""
        with self._lock:
            return self._by_url.get(url) if url else None

    def choose(
        self,
        key: str,
        prefer: str | None = None,
        exclude: Collection[Instance] = (),
        need: Need | None = None,
    ) -> Instance:
        """Choose for the conversation `key`; `prefer` is the D holding its KV, `need` what the
        turn asks of a P.

        Healthy instances only, unless none is; of those neither overloaded nor busy, the
        cheapest (`gateway.engines.cost`: P given `need`, or D), equal costs in rendezvous order
        of the key; else the first not overloaded in that order (or round robin).
        """
        now = self._clock()
        with self._lock:
            instances = self.instances
            if not instances:  # every address of its names gone, say: nothing to choose
                raise ServiceUnavailable(f"no {self.role} instance is known", instance_fault=False)
            candidates = [i for i in instances if i not in exclude and i.available(now)]
            if not candidates:
                # Each marked down or open: try them anyway (a request's failure marks an
                # instance down at once, before a probe could confirm it), except those whose
                # last probe found them not answering.
                candidates = [
                    i for i in instances if i not in exclude and i.answered is not False
                ] or [i for i in instances if i.answered is not False]
                if not candidates:
                    raise ServiceUnavailable(self.unservable(), instance_fault=False)
            if self.policy.routing == "round_robin":
                # The next candidate after the last one chosen, in the pool's order (which
                # instances joining or leaving only lengthen or shorten).
                for step in range(len(instances)):
                    chosen = instances[(self._turn + step) % len(instances)]
                    if chosen in candidates:
                        self._turn = (self._turn + step + 1) % len(instances)
                        return chosen
            raw = key.encode()
            spill = self._spill(raw, need, exclude) if need is not None else []
            if len(candidates) == 1 and not spill:  # what the ranking below would end on
                return candidates[0]
            limit = self._limit(candidates)
            busy = self.busy
            ranked = sorted(candidates, key=lambda i: _weight(raw, i), reverse=True)
            eligible = [i for i in ranked if i.inflight <= limit and not (busy and busy(i))]
            if eligible or spill:
                preferred = self._by_url.get(prefer) if prefer else None
                if need is not None:
                    own = self._own(key, raw, ranked)
                    # Ps first: a D prefills only where it costs less than every P (with no P
                    # eligible, than the one the last resort would take).
                    ps = eligible or [self._last_resort(ranked, limit)]
                    return cheapest([*ps, *spill], lambda i: self._prefill_cost(i, need, i is own))
                if self.role == "decode":
                    # The D that holds the entry; without one, the first in rendezvous order,
                    # whose prefix cache served the conversation's turns before.
                    home = preferred if preferred is not None else _first(raw, instances, ranked)
                    return cheapest(eligible, lambda i: self._decode_cost(i, i is home))
                return preferred if preferred in eligible else eligible[0]
            return self._last_resort(ranked, limit)

    def _last_resort(self, ranked: list[Instance], limit: float) -> Instance:
        """Busy or overloaded, every one: not busy first; all busy, in-flight counts alone."""
        if self.busy is not None:
            ranked = [i for i in ranked if not self.busy(i)] or ranked
        return next((i for i in ranked if i.inflight <= limit), ranked[0])

    @property
    def reach(self) -> int:
        """How many instances `choose` may return: the pool's own, and the Ds it may spill to."""
        return len(self.instances) + (len(self.spill.instances) if self.spill is not None else 0)

    def _spill(self, raw: bytes, need: Need, exclude: Collection[Instance]) -> list[Instance]:
        """The Ds that may take a turn's prefill (--prefill-on-decode), in rendezvous order:
        for a turn without an entry (a first turn, or one whose entry is gone), which computes
        its whole prompt, or all but what its own P caches; and only while another D is ready
        to decode it. A turn with an entry costs any P little (P reads D's blocks): moved to a
        D it would stall D's streams and add a pull for little. Of the Ds, those the D choice
        would take (ready, neither overloaded nor busy). A D then prefills as a P does and
        another D decodes, pulling from it (`Disagg`). Its cost (`CostModel.spilled`) charges
        the turn's work once more for each stream the D runs."""
        pool = self.spill
        if pool is None or need.held_on is not None or self.policy.routing == "round_robin":
            return []
        now = self._clock()
        ready = [i for i in pool.instances if i.available(now)]
        if len(ready) < 2:
            return []
        limit = pool._limit(ready)
        busy = pool.busy
        return sorted(
            (
                i
                for i in ready
                if i not in exclude and i.inflight <= limit and not (busy and busy(i))
            ),
            key=lambda i: _weight(raw, i),
            reverse=True,
        )

    def _home(self, instance: Instance) -> Pool:
        """The pool `instance` is counted in: a D this P pool spilled a prefill onto is its D
        pool's (one engine, one lock over its counts)."""
        return self.spill if self.spill is not None and instance.role != self.role else self

    def work(self, instance: Instance, key: str, need: Need) -> int:
        """The prefill work `need` brings `instance` (its cost without the queue), in whole
        tokens (sums of floats added and taken away would leave residues that break ties):
        what `acquire` counts queued there while the turn's P call runs. 0 under round
        robin, which reads no cost."""
        if self.policy.routing == "round_robin":
            return 0
        with self._lock:
            own = self._own(key, key.encode())
        return round(self.policy.cost.work(need, instance is own))

    def _own(self, key: str, raw: bytes, ranked: Sequence[Instance] = ()) -> Instance | None:
        """The conversation's own P, whose prefix cache holds its history: the P that prefilled
        its last turn, if this process remembers it and it is still in the pool; else the
        first in rendezvous order of every instance (`_first`). Under the lock."""
        url = self._prefilled.get(key)
        remembered = self._by_url.get(url) if url is not None else None
        return remembered if remembered is not None else _first(raw, self.instances, ranked)

    def prefilled(self, key: str, instance: Instance) -> None:
        """`instance` prefilled a turn of the conversation `key`: its prefix cache holds the
        history now, so it is the conversation's own P for the next turn. Remembered only where
        it is not the rendezvous first (the default, which every worker and host agrees on).
        Not under round robin, which reads no cost."""
        if self.policy.routing == "round_robin" or instance.role != self.role:
            return  # (a D that prefilled is never costed as the conversation's own P)
        with self._lock:
            if instance is _first(key.encode(), self.instances):
                self._prefilled.pop(key, None)
            else:
                self._prefilled[key] = instance.url

    def queued(self, instance: Instance) -> int:
        """The prefill work queued on a P from this host: every worker's under gunicorn's
        hooks (`counts`), else this process's."""
        return self.counts.queued(instance) if self.counts is not None else instance.queued

    def streams(self, instance: Instance) -> int:
        """The requests (a D's streams) in flight on an instance from this host, likewise."""
        return self.counts.inflight(instance) if self.counts is not None else instance.inflight

    def _prefill_cost(self, instance: Instance, need: Need, own: bool) -> float:
        report = self.load(instance) if self.load is not None else None
        if instance.role != self.role:  # a D (`_spill`): its streams wait for the prefill
            # This host's requests on D and those D reports running include this process's
            # P calls there, which are no streams (and count in `queued`).
            streams = self.streams(instance)
            waiting = 0.0
            if report is not None:
                streams, waiting = max(streams, report.running), max(report.waiting, 0.0)
            streams = max(streams - instance.prefills, 0)
            return self.policy.cost.spilled(need, self.queued(instance), waiting, streams)
        reported = (max(report.waiting, 0.0) + report.running) if report is not None else 0.0
        return self.policy.cost.prefill(need, own, self.queued(instance), reported)

    def _decode_cost(self, instance: Instance, holds: bool) -> float:
        report = self.load(instance) if self.load is not None else None
        # This host's streams are among those D reports, running or waiting: the larger.
        streams = self.streams(instance)
        if report is not None:
            streams = max(streams, report.running + max(report.waiting, 0.0))
        return self.policy.cost.decode(streams, holds, self.queued(instance))

    def _limit(self, candidates: list[Instance]) -> float:
        """In flight above this is overloaded: factor x (the least loaded's + 1)."""
        return self.policy.overload_factor * (min(i.inflight for i in candidates) + 1)

    def ready(self, instance: Instance) -> bool:
        """Is it there to serve, by what is known: not marked down and, when probed, it answered
        its last probe (its breaker aside: an engine answering errors is still there)."""
        return not instance.down and (instance.answered is True or not self.probed)

    def any_ready(self) -> bool:
        return any(self.ready(i) for i in self.instances)

    def servable(self) -> bool:
        """Could a request be sent to one of them at all: some instance whose last probe did
        not find it unable (ready, or marked down by a request and not yet probed)?"""
        return any(i.answered is not False for i in self.instances)

    def unservable(self) -> str:
        """Why no request can go to this pool, for a client: nothing of the engines' URLs."""
        what = f"{self.role} instance" + (f" of model {self.model!r}" if self.model else "")
        if not self.instances:
            return f"no {what} is known"
        return f"no {what} answers its health check"

    def probed_now(self, instance: Instance, answered: bool, why: str = "") -> None:
        """A probe's answer: ready (back if it was down) or not (down until one answers). An
        engine that answered before is given up only after `MISSES` probes in a row: a busy
        vLLM can miss one (its /health shares the event loop with every stream)."""
        with self._lock:
            instance.missed = 0 if answered else instance.missed + 1
            if not answered and instance.answered and instance.missed < MISSES:
                return
            before, instance.answered, instance.why = instance.answered, answered, why
            if answered and instance.down:
                instance.failures, instance.down, instance.open_until = 0, False, 0.0
            elif not answered:
                instance.down = True
        if before is None:  # the first answer: what the operator needs to see
            if answered:
                log.info(
                    "%s (%s) answers; serves %s",
                    instance.name,
                    instance.public_url,
                    ", ".join(instance.served or ()) or "models it does not list",
                )
            else:
                log.warning("%s (%s) is not ready: %s", instance.name, instance.public_url, why)
        elif before != answered:
            (log.info if answered else log.warning)(
                "%s (%s) %s",
                instance.name,
                instance.public_url,
                "answers again" if answered else f"is not ready: {why}",
            )

    def kept_nothing(self, instance: Instance, streamed: bool) -> None:
        """A D finished a turn it loaded from P without kv_transfer_params: it keeps no blocks,
        so no later turn of its conversations reads any. Said once per engine, counted."""
        with self._lock:
            instance.kept_nothing += 1
            instance.keeps_blocks = False
            first, instance.warned = not instance.warned, True
        metrics.DECODE_KEPT_NOTHING.labels(instance.name).inc()
        if first:
            log.warning(
                "%s (%s) finished a turn without kv_transfer_params: it keeps no KV blocks for "
                "the next turn, so no turn of its conversations can reuse them. Start it with "
                "bidirectional KV transfer: %s%s (`pd-gateway check` tests a P/D pair)",
                instance.name,
                instance.public_url,
                KV_TRANSFER_CONFIG,
                "; a streamed turn also needs a vLLM whose streams carry the params (PR #40186)"
                if streamed
                else "",
            )

    @staticmethod
    def kept(instance: Instance) -> None:
        """A D returned its params after a turn it loaded from P."""
        instance.keeps_blocks = True

    def readiness(self, url: str) -> tuple[Instance | None, str]:
        """The instance at `url` if it may take a request now, else None and why: down (or
        its breaker open), overloaded (the rule `choose` applies), or gone from the pool."""
        now = self._clock()
        with self._lock:
            instance = self._by_url.get(url)
            if instance is None:
                return None, "gone"
            if not instance.available(now):
                return None, "down"
            if instance.inflight > self._limit([i for i in self.instances if i.available(now)]):
                return None, "overloaded"
            if self.busy is not None and self.busy(instance):
                return None, "busy"
            return instance, "ready"

    def acquire(self, instance: Instance, work: int = 0, prefill: bool = False) -> None:
        """Count a request in flight on the instance, and the prefill `work` it brings (a P's
        cost for it); `release` both when it ends."""
        if (home := self._home(instance)) is not self:
            return home.acquire(instance, work, prefill=True)
        with self._lock:
            instance.inflight += 1
            instance.queued += work
            instance.prefills += prefill
            if self.counts is not None:
                self.counts.sync(instance)

    def release(self, instance: Instance, work: int = 0, prefill: bool = False) -> None:
        if (home := self._home(instance)) is not self:
            return home.release(instance, work, prefill=True)
        with self._lock:
            instance.inflight -= 1
            instance.queued -= work
            instance.prefills -= prefill
            if self.counts is not None:
                self.counts.sync(instance)

    def succeeded(self, instance: Instance) -> None:
        if (home := self._home(instance)) is not self:
            return home.succeeded(instance)
        if instance.failures or instance.down or instance.open_until or instance.answered is False:
            with self._lock:
                instance.failures = 0
                instance.down = False
                instance.open_until = 0.0
                if instance.answered is False:  # it answered a request: it answers
                    instance.answered, instance.missed, instance.why = True, 0, ""

    def failed(self, instance: Instance, unreachable: bool) -> None:
        """Record a failure: unreachable marks it down at once; others count toward the breaker."""
        if (home := self._home(instance)) is not self:
            return home.failed(instance, unreachable)
        with self._lock:
            instance.failures += 1
            if unreachable:
                instance.down = True
            elif instance.failures >= self.policy.breaker_failures or instance.open_until:
                instance.open_until = self._clock() + self.policy.breaker_cooldown
        log.warning(
            "%s (%s) %s",
            instance.name,
            instance.public_url,
            "marked down" if unreachable else f"failed {instance.failures} time(s)",
        )
        if unreachable and self.on_down is not None:
            self.on_down()

    def report(self) -> list[dict]:
        now = self._clock()
        reported = self.reported or (lambda i: None)
        return [
            {
                "name": i.name,
                "url": i.public_url,
                "origin": public_url(i.origin),
                "state": i.state(now),
                "ready": self.ready(i),
                "inflight": i.inflight,
                "consecutive_failures": i.failures,
                "models": list(i.served or ()),
                **(
                    {"keeps_blocks": i.keeps_blocks, "turns_kept_nothing": i.kept_nothing}
                    if self.role == "decode"
                    else {}
                ),
                **({"why": i.why} if i.why and i.down else {}),
                "reported": reported(i),
            }
            for i in self.instances
        ]


class Prober:
    """Asks every instance whether it answers: at once when it starts, then every `interval`
    seconds, and at once again when a request marks one down. An instance that answers
    `GET /health` with 200 (vLLM 0.33.0 `entrypoints/serve/instrumentator/health.py` ~L22-33:
    503 once its engine is dead) is ready, and the first time it answers its `/v1/models` says
    what it serves; one that does not answer, or serves another model than its pool's, is down
    until it does. So a gateway whose engines are not there is not ready before any client
    asks it (its /health is 503), and a turn no D can serve fails before P is called.

    One background thread per process (a greenlet under gevent), from `start` to `stop`.
    """

    def __init__(
        self,
        probe: Callable[[Instance], bool],
        pools: list[Pool],
        interval: float,
        models: Callable[[Instance], list[str] | None] = lambda i: None,
    ) -> None:
        self.probe = probe  # does the instance answer GET /health? (Upstream.probe)
        self.models = models  # what its GET /v1/models lists (None: no answer)
        self.pools = pools
        self.interval = interval
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._probes = Fanout(CONCURRENT)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def start(self) -> None:
        if self.enabled and self._thread is None:
            for pool in self.pools:
                pool.probed = True
            self._thread = threading.Thread(target=self._run, name="pd-gateway-prober", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Probe now (call after marking an instance down)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.probe_all()
            except Exception:  # a bug must not end the loop
                log.exception("probing the engines failed")
            self._wake.wait(self.interval)
            self._wake.clear()

    def probe_all(self) -> None:
        """One round: every instance of every pool, at most `CONCURRENT` at once (one that does
        not answer costs its timeout, not the others' turn)."""
        self._probes.run(
            lambda job: self.probe_one(*job),
            [(pool, instance) for pool in self.pools for instance in pool.instances],
        )

    def probe_one(self, pool: Pool, instance: Instance) -> None:
        if not self.probe(instance):
            pool.probed_now(instance, False, "no answer to GET /health")
            return
        if instance.answered is not True or instance.served is None:
            served = self.models(instance)
            instance.served = tuple(served) if served is not None else None
        if pool.model and instance.served is not None and pool.model not in instance.served:
            # (Asked again at the next probe: the answer may change with a restart.)
            pool.probed_now(
                instance, False, f"serves {', '.join(instance.served)}, not {pool.model}"
            )
            return
        pool.probed_now(instance, True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.interval + 2)  # a probe in progress times out within 1 s
        self._probes.close()
