"""The cost of giving a turn's prefill to one P, or its decode to one D: what `Pool.choose`
weighs under --routing affinity (docs/routing.md has the model, its parameters and defaults).

Every P cost is in prefill tokens (the time P takes to compute one is the unit, and cancels out
of the choice): the work queued there before this turn, plus the tokens this turn would compute
there, plus those it would pull, each at --route-pull-cost of a computed one. A D's cost is in
streams: those it runs, plus --route-move-streams where it does not hold the conversation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Need:
    """What a turn asks of P, estimated before P sees it (gateway.flow.disagg.prefill_need)."""

    tokens: int  # its prompt
    held: int = 0  # of which D holds the blocks (the entry's remote_num_tokens): any P reads
    cached: int = 0  # of which the conversation's own P (`Pool._own`) computed before
    held_on: str | None = None  # the URL of the entry's D, if the turn has an entry

    def retried(self) -> Need:
        """What a retry asks: none of D's blocks, since a retry is never sent D's params
        (gateway.flow.disagg, `Disagg._prefill`); the own P's prefix cache still holds what it
        computed (a retry excludes the P that failed, which may or may not be the own P)."""
        return replace(self, held=0)


@dataclass(frozen=True, slots=True)
class CostModel:
    """The parameters (--route-pull-cost, --route-request-tokens, --route-move-streams)."""

    pull: float = 0.1  # one token's KV pulled from another engine, against computing it
    request_tokens: int = 512  # the prefill tokens a request an engine reports stands for
    move_streams: float = 4.0  # streams a D must carry beyond another's before a turn leaves it

    def prefill(self, need: Need, own: bool, queued: float, reported: float) -> float:
        """P's cost: the larger of the prefill tokens this host's workers have in flight
        there (`queued`) and those the engine reports waiting and running (`reported` requests
        at `request_tokens` each: every host's), plus this turn's work there. `own`: the
        conversation's own P, whose prefix cache holds what it computed for earlier turns."""
        return max(queued, reported * self.request_tokens) + self.work(need, own)

    def work(self, need: Need, own: bool) -> float:
        """The turn's tokens computed on that P, plus those pulled from D at `pull` each: P
        reads what D holds beyond its own cache hit (vLLM 0.33.0 nixl/pull_scheduler.py
        ~L85-103), and computes the rest."""
        cached = min(need.cached, need.tokens) if own else 0
        pulled = max(min(need.held, need.tokens) - cached, 0)
        return need.tokens - cached - pulled + self.pull * pulled

    def spilled(self, need: Need, queued: float, waiting: float, streams: float) -> float:
        """A D's cost for a turn's prefill (--prefill-on-decode): the prefill tokens this host
        has in flight there or the requests it reports waiting (`request_tokens` each), the
        larger, as for a P; then the turn's work (never as the conversation's own P) paid once
        for the turn and once for each of the D's `streams`. A prefill on D shares D's steps
        with its streams (chunked prefill batches them), so each of them waits about as long
        as the turn does: a D with no streams prefills as a P would; one decoding 10 streams,
        only where every P has 10 times the turn's work more queued."""
        return max(queued, waiting * self.request_tokens) + self.work(need, False) * (1 + streams)

    def decode(self, streams: float, holds: bool, prefilling: float = 0.0) -> float:
        """D's cost: its streams (in flight from here, or as it reports them, the larger), and
        the cost of moving where it does not hold the conversation's blocks (its prefix cache
        misses the history: it pulls the whole prompt from P, not only the new tokens). With
        --prefill-on-decode, the prefill tokens this host has queued on D (`prefilling`), at
        `request_tokens` a stream: a new stream's first token waits for them as for a P's
        queue, so a D computing a long prompt sheds the decodes that may go elsewhere."""
        queue = prefilling / self.request_tokens if self.request_tokens else 0.0
        return streams + queue + (0.0 if holds else self.move_streams)


def cheapest(ranked: Sequence[T], cost: Callable[[T], float]) -> T:
    """The least costly of `ranked`; of equal costs the first, so rendezvous order breaks ties
    and an idle pool's choice stays sticky and the same on every worker and host."""
    best, best_cost = ranked[0], cost(ranked[0])
    for candidate in ranked[1:]:
        value = cost(candidate)
        if value < best_cost:
            best, best_cost = candidate, value
    return best
