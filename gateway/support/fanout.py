"""Running one call per item, a few at once, on threads kept between rounds: the background
loops' way to ask every engine (the prober, the reader of the engines' /metrics), so one engine
that answers slowly costs its own call, not the others' turn."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Fanout:
    """`run(call, items)`: `call(item)` for each item, at most `size` at once, back when all
    are done. The threads (greenlets under gevent) are made on the first round of more than
    one item and kept idle between rounds; after `close`, or once the interpreter is exiting,
    a round runs nothing."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def run(self, call: Callable[[T], object], items: Iterable[T]) -> None:
        items = list(items)
        if len(items) <= 1:
            for item in items:
                call(item)
            return
        if self._closed:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.size)
        try:
            for _ in self._pool.map(call, items):
                pass
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            self._closed = True

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
