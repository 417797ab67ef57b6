"""What every worker of this host has in flight on each engine: a P's queued prefill tokens and
each engine's requests (a D's streams), for the choice of P and D (docs/routing.md).

A worker counts its own calls (`Pool.acquire`, `release`); its siblings' are invisible to it,
and the engines' reports lag by up to an interval, so a burst of first turns spread over the
workers could pile onto one P. Under gunicorn's hooks each worker also adds its counts to its
own column of a table the master shares with every worker (gateway.slots.QUEUED, INFLIGHT: a
row per engine, as the engines' reports are shared), and the cost reads the host's sum. Only
the column's worker writes its cells, so the hot path takes no lock another process waits on;
the master clears a worker's column when it exits. Outside gunicorn (no column) the counts are
the process's own, as without.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from gateway.engines.engine_load import LoadTable
from gateway.engines.instances import Instance
from gateway.slots import COLUMN_ENV, COLUMNS, INFLIGHT, MAX_SLOTS, QUEUED


class HostCounts:
    """One worker's view of the host's in-flight counts, and its own column of them."""

    def __init__(
        self,
        column: int,
        table: LoadTable | None = None,
        queued=QUEUED,
        inflight=INFLIGHT,
        columns=COLUMNS,
        stride: int = MAX_SLOTS,
    ) -> None:
        """`column`: this worker's; `columns.value`: how many a reader sums (the master's);
        `stride`: the columns of a row."""
        self.column = column
        self.table = table or LoadTable()
        self.queued_cells, self.inflight_cells = queued, inflight
        self.columns = columns
        self.stride = stride
        # What this worker last wrote for each instance with work in flight: (row, requests,
        # tokens). `sync` takes it back out and writes the instance's counts anew, so its cells
        # always hold the instance's own counts, in the row its URL has now.
        self._written: dict[Instance, tuple[int, int, int]] = {}
        # A cell is added to by this process alone, but by any of its threads (an engine's URL
        # may be in two pools, each with its own lock).
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> HostCounts | None:
        """This worker's, when gunicorn's hooks gave it a column; else None (own counts)."""
        column = int(environ.get(COLUMN_ENV, "-1"))
        return cls(column) if 0 <= column < MAX_SLOTS else None

    def sync(self, instance: Instance) -> None:
        """Make this worker's cells say what its own counts of `instance` say (`inflight`,
        `queued`, changed just before). Written as a whole, not as a change: a count made while
        the table had no row for the URL, or in a row the URL has lost since (two workers took
        one row at once; an abandoned row reclaimed), is moved, never left behind or taken
        twice."""
        with self._lock:
            written = self._written.pop(instance, None)
            if written is not None:
                row, requests, tokens = written
                cell = row * self.stride + self.column
                self.inflight_cells[cell] -= requests
                self.queued_cells[cell] -= tokens
            busy = instance.inflight > 0 or instance.queued > 0
            now = self.table.row(instance.url, make=busy) if busy else None
            if now is None:  # nothing in flight, or the table is full: its counts stay its own
                return
            cell = now * self.stride + self.column
            self.inflight_cells[cell] += instance.inflight
            self.queued_cells[cell] += instance.queued
            self._written[instance] = (now, instance.inflight, instance.queued)

    def queued(self, instance: Instance) -> int:
        """The prefill tokens every worker of the host has queued on `instance`."""
        return self._sum(instance, self.queued_cells, instance.queued)

    def inflight(self, instance: Instance) -> int:
        """The requests every worker of the host has in flight on `instance`."""
        return self._sum(instance, self.inflight_cells, instance.inflight)

    def _sum(self, instance: Instance, cells, own: int) -> int:
        row = self.table.row(instance.url)
        if row is None:
            return own
        base = row * self.stride
        # At least this worker's own: its counts may sit in a row the URL no longer finds (two
        # workers took one row for two engines at once; the table mends it).
        return max(own, sum(cells[base : base + self.columns.value]))
