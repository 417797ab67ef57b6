"""One scenario for every store: tenants share each D's pinned budget (issue 41, item 4)."""

from __future__ import annotations

import uuid

from gateway.reuse.store import Entry
from tests.helpers.stores import take


def on(d: str, n: int, blocks: int) -> Entry:
    return Entry(
        params={
            "remote_request_id": f"r{n}",
            "remote_block_ids": [list(range(blocks))],
            "remote_num_tokens": blocks * 16,
        },
        decode_url=d,
        history_digest=f"h{n}",
        history_len=2,
    )


def one_tenants_long_turn_releases_nothing_of_anothers(store) -> None:
    """`store` has a budget of 100 blocks a D. A tenant with 30 conversations of 1 block each (30,
    within its share) keeps them all when another tenant puts a turn of 207 blocks (3,300
    tokens): that turn alone is over the budget, so it goes (before, as the entry just put, it
    stayed and all 30 went). The second tenant's later turns, 20 blocks each, go beyond its
    share oldest first, never the first tenant's."""
    d = f"http://d-{uuid.uuid4().hex[:6]}"
    dropped: list[tuple[str, str]] = []
    store.on_drop = lambda e, why: dropped.append((e.params["remote_request_id"], why))
    roots = [uuid.uuid4().hex for _ in range(40)]
    for n in range(30):
        store.put(roots[n], on(d, n, 1), roots[n], "victim")
    store.put(roots[30], on(d, 100, 207), roots[30], "noisy")
    assert dropped == [("r100", "budget")]
    for n in range(101, 106):  # 100 blocks of 20: within 100 until the 4th
        store.put(roots[n - 70], on(d, n, 20), roots[n - 70], "noisy")
    assert dropped[1:] == [("r101", "budget"), ("r102", "budget")]
    kept = [n for n in range(30) if take(store, roots[n], roots[n]) is not None]
    assert kept == list(range(30))
