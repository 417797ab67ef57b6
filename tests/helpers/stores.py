"""What the store tests share: one key's entry taken, as the gateway takes a conversation's."""

from __future__ import annotations

from gateway.reuse.store import ConversationStore, Entry


def take(store: ConversationStore, key: str, tag: str = "") -> Entry | None:
    """The entry under `key`, taken (single use); None if there is none."""
    found = store.take_first([key], tag)
    return None if found is None else found[1]
