"""What every conversation store shares: `Entry` (what one turn leaves for the next), the
`ConversationStore` interface, an entry packed in bytes, and each D's pinned budget."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gateway.engines.d_budget import Limit
from gateway.reuse.packing import pack, unpack


@dataclass(frozen=True)
class Entry:
    """What one finished turn leaves for the next: D's params and where they live."""

    params: dict
    decode_url: str  # the D instance holding the blocks (and its local prefix cache)
    history_digest: str  # digest of the history the blocks hold (conversation.Identity)
    history_len: int  # its length: messages for chat, characters for a prompt
    # A reply the digest can vouch for (gateway.reuse.exactness.plain_reply).
    plain: bool = False
    token_digest: str | None = None  # digest of the tokens D holds, if D reported its ids
    # When D's blocks are gone, on the store's clock; set by the first put. D frees them at its
    # TTL whatever the gateway does, so an entry put back keeps it.
    expires_at: float | None = None
    # Digests of D's tokens at a few block boundaries, to find how much of them a prompt that
    # does not extend them all still shares (gateway.reuse.partial); only where D reported its ids.
    prefixes: bytes | None = None


Budget = Callable[[str], Limit]  # D's URL -> its pinned budget now (gateway.engines.d_budget)


def fixed(budget: int) -> Budget:
    """The same budget for every D (0: none)."""
    limit = Limit(budget)
    return lambda decode: limit


class ConversationStore(Protocol):
    """What the gateway asks of a store, whichever its backend."""

    def take_first(self, keys: Sequence[str], tag: str = "") -> tuple[str, Entry] | None:
        """Remove and return the entry under the first of `keys` that has one (keys are tried
        in order, longest history first). D hands its blocks over once: entries are single use.
        `tag` is the same for every key of one conversation (its root): a Redis Cluster keeps
        them in one hash slot."""

    def put(self, key: str, entry: Entry, tag: str = "", tenant: str = "") -> None:
        """Store the entry, replacing any older one for the key. `tenant` (the client key's
        id): tenants share each D's pinned budget (and a local store's size) equally, the one
        holding the most giving way first."""

    def report(self) -> dict:
        """What /health shows of the store."""

    # Called with (entry, reason) for each entry that leaves the store unread: replaced by a
    # newer one for its key, evicted for room, expired, or over its D's pinned budget.
    on_drop: Callable[[Entry, str], None]
    # Each D's pinned budget now (gateway.engines.d_budget; 0: none).
    budget: Budget

    def sweep(self) -> None:
        """Expire what is due now, and release what is beyond a D's budget that shrank (each
        entry goes to `on_drop`)."""


def encode(entry: Entry) -> bytes:
    """The entry in a few hundred bytes (gateway.reuse.packing): Python objects would take
    kilobytes."""
    return pack(
        entry.params,
        entry.decode_url,
        entry.history_digest,
        entry.history_len,
        entry.plain,
        entry.token_digest,
        entry.expires_at,
        entry.prefixes,
    )


def decode(packed: bytes) -> Entry:
    """The entry `encode` packed; ValueError for anything else (a foreign value in Redis)."""
    return Entry(**unpack(packed))


def pinned_blocks(entry: Entry) -> int:
    """The blocks D keeps for the entry (its exported remote_block_ids, every group)."""
    return sum(len(group) for group in entry.params.get("remote_block_ids") or ())


def ignore(entry: Entry, reason: str) -> None:
    pass


def stamped(entry: Entry, now: float, ttl: float) -> Entry:
    """The entry with its expiry: now + ttl on the first put, unchanged after."""
    return entry if entry.expires_at is not None else replace(entry, expires_at=now + ttl)
