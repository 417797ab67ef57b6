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
        # The row each instance's counts went to, until they are back to nothing: its
        # release takes away from the cell its acquire added to, whatever the table did since.
        self._rows: dict[Instance, int] = {}
        # A cell is added to by this process alone, but by any of its threads (an engine's URL
        # may be in two pools, each with its own lock).
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> HostCounts | None:
        """This worker's, when gunicorn's hooks gave it a column; else None (own counts)."""
        column = int(environ.get(COLUMN_ENV, "-1"))
        return cls(column) if 0 <= column < MAX_SLOTS else None

    def add(self, instance: Instance, requests: int, work: int) -> None:
        """`instance` has `requests` more in flight from this worker and `work` more prefill
        tokens queued (negative: fewer); its own counts already say so."""
        with self._lock:
            row = self._rows.get(instance)
            if row is None:
                if requests <= 0:  # its acquire found no row: nothing of it is in the table
                    return
                row = self.table.row(instance.url, make=True)
                if row is None:  # the table is full here: this worker's counts stay its own
                    return
                self._rows[instance] = row
            cell = row * self.stride + self.column
            self.inflight_cells[cell] += requests
            self.queued_cells[cell] += work
            if not instance.inflight and not instance.queued:
                del self._rows[instance]

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
