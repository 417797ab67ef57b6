"""What the gunicorn master and its workers share: each worker's slot, the private listeners'
address, which slots own conversations, how far each worker has applied the admin changes, the
engines' reported load, and what each worker has in flight on each engine. The master's hooks
(gateway.gunicorn_conf) write them and set the variables after fork; the runtime (owners,
membership, engine_load, host_counts, the service) reads them.

The arrays are made at import, in the master, before it forks, so every worker shares them.
Importing this module imports nothing of the gateway's, nor requests: gevent can still be
patched after it.
"""

from __future__ import annotations

import multiprocessing

SLOT_ENV = "PD_GATEWAY_WORKER_SLOT"  # this worker's slot, set after fork
# host:port of slot 0's private listener (slot N listens on port + N); set after fork only when
# the workers forward (several workers, local stores, affinity on).
PRIVATE_ENV = "PD_GATEWAY_PRIVATE_BASE"
# The threads of this worker when gunicorn runs a threaded one (gthread), unset under gevent:
# a host's config chooses the worker, and the app sizes its turn limit and relay places by it.
THREADS_ENV = "PD_GATEWAY_WORKER_THREADS"
MAX_SLOTS = 256
# Which slots own conversations now, shared with every worker (forked from the master, which
# alone writes it): a worker stopped by TTOU or a smaller reload stops owning at once, so no
# request waits for an owner that is not coming back. gateway.front.owners reads it.
LIVE_SLOTS = multiprocessing.RawArray("b", MAX_SLOTS)
# Instances added or removed through the admin endpoint reach every worker through one file
# the master makes (gateway.membership: each worker appends what it was asked, and applies every
# line in order), named to each worker after fork; a reload (SIGHUP) starts a new, empty one.
# APPLIED[slot] is how far into it that slot's worker has applied, so an admin call can wait
# until every live worker has its change.
CHANGES_ENV = "PD_GATEWAY_CHANGES"
APPLIED = multiprocessing.RawArray("q", MAX_SLOTS)
# What each engine reports of its own load (gateway.engine_load), shared by a host's workers so
# each engine's /metrics is read once per interval per host, not once per worker: a row per
# engine URL, keyed by its digest (0: free), values as gateway.engine_load.FIELDS.
LOAD_ROWS = 1024
LOAD_KEYS = multiprocessing.RawArray("q", LOAD_ROWS)
LOAD_VALUES = multiprocessing.RawArray("d", LOAD_ROWS * 9)  # FIELDS a row

# What each worker has in flight on each engine, for the choice of P and D
# (gateway.engines.host_counts): per engine row (the row LOAD_KEYS gives its URL) a cell per
# worker column, P's queued prefill tokens in QUEUED and the requests in flight (D's streams)
# in INFLIGHT. A worker adds to its own column's cells only, so no process locks another out;
# a reader sums the columns below COLUMNS.value. A column, not the slot: after a reload (SIGHUP)
# the new worker of a slot runs beside the old one still finishing its streams, and a worker
# stopped by TTOU runs its streams on after its slot stopped owning. The master hands each
# living worker a column (pre_fork) and clears it when the worker exits (child_exit), so a
# worker that dies leaves nothing counted.
COLUMN_ENV = "PD_GATEWAY_WORKER_COLUMN"  # this worker's column, set after fork
QUEUED = multiprocessing.RawArray("q", LOAD_ROWS * MAX_SLOTS)
INFLIGHT = multiprocessing.RawArray("q", LOAD_ROWS * MAX_SLOTS)
COLUMNS = multiprocessing.RawValue("i", 0)  # 1 + the highest column a living worker holds


def clear_column(column: int) -> None:
    """Zero `column`'s cells in every engine row: its worker has exited."""
    zeros = [0] * LOAD_ROWS
    QUEUED[column::MAX_SLOTS] = zeros
    INFLIGHT[column::MAX_SLOTS] = zeros
