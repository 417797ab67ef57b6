"""Every worker's in-flight work on an engine, visible to the host's other workers
(gateway/engines/host_counts.py): each worker adds to its own column of a shared table, the
costs of P and D read the host's sum, and a worker that exits leaves nothing counted."""

from __future__ import annotations

import multiprocessing
from types import SimpleNamespace

import pytest

from gateway import gunicorn_conf, slots
from gateway.config import Settings
from gateway.engines.cost import CostModel, Need
from gateway.engines.engine_load import FIELDS, LoadTable
from gateway.engines.host_counts import HostCounts
from gateway.engines.instances import Instance, Policy, Pool, _weight
from gateway.flow.attempts import attempt

PS = ["http://p0:8000", "http://p1:8000"]
DS = ["http://d0:8000", "http://d1:8000"]
ROWS, STRIDE = 16, 8


def rendezvous(pool: Pool, key: str) -> list[Instance]:
    return sorted(pool.instances, key=lambda i: _weight(key.encode(), i), reverse=True)


class Host:
    """A host's shared memory, small, as the master makes it before it forks."""

    def __init__(self, columns: int = 2) -> None:
        self.keys = multiprocessing.RawArray("q", ROWS)
        self.values = multiprocessing.RawArray("d", ROWS * len(FIELDS))
        self.queued = multiprocessing.RawArray("q", ROWS * STRIDE)
        self.inflight = multiprocessing.RawArray("q", ROWS * STRIDE)
        self.columns = multiprocessing.RawValue("i", columns)

    def worker(self, column: int, role: str = "prefill") -> Pool:
        """One worker's pool of `role`, counting in `column`."""
        pool = Pool(role, PS if role == "prefill" else DS, Policy(cost=CostModel(pull=0.1)))
        pool.counts = HostCounts(
            column,
            LoadTable(self.keys, self.values, ROWS),
            self.queued,
            self.inflight,
            self.columns,
            STRIDE,
        )
        return pool


def test_a_ps_queue_from_one_worker_steers_another_workers_first_turn():
    host = Host()
    one, other = host.worker(0), host.worker(1)
    key = "first-turn"
    home = rendezvous(other, key)[0]
    first = Need(tokens=4000)  # a first turn: the same work on either P, the queue decides
    seen = []

    def while_ones_call_runs(instance, failure):
        seen.append(
            (instance.url, other.queued(other.get(instance.url)), other.choose(key, need=first).url)
        )
        return "ok"

    answered = attempt(one, key, while_ones_call_runs, 1, need=first)
    assert answered.instance.url == home.url
    # The other worker sees the first's 4000 tokens queued on the home P, and goes elsewhere.
    assert seen == [(home.url, 4000, next(i.url for i in other.instances if i.url != home.url))]
    # Released: nothing counted anywhere, and the home P is the choice again.
    assert [other.queued(i) for i in other.instances] == [0, 0]
    assert other.choose(key, need=first) is home
    assert not any(host.queued) and not any(host.inflight)


def test_each_worker_adds_to_its_own_column_and_readers_sum_them():
    host = Host(columns=3)
    one, two = host.worker(0), host.worker(2)
    p0_one, p0_two = one.get(PS[0]), two.get(PS[0])
    one.acquire(p0_one, 300)
    two.acquire(p0_two, 200)
    two.acquire(p0_two, 50)
    row = LoadTable(host.keys, host.values, ROWS).row(PS[0])
    assert host.queued[row * STRIDE : row * STRIDE + 3] == [300, 0, 250]
    assert host.inflight[row * STRIDE : row * STRIDE + 3] == [1, 0, 2]
    assert one.queued(p0_one) == two.queued(p0_two) == 550
    assert one.streams(p0_one) == 3
    # Each worker's own counts stay its own (the overload limit reads them).
    assert (p0_one.queued, p0_two.queued) == (300, 250)
    two.release(p0_two, 200)
    assert one.queued(p0_one) == 350 and one.streams(p0_one) == 2
    # A column beyond the living ones is not read (the third's 50 here).
    host.columns.value = 1
    assert one.queued(p0_one) == two.queued(p0_two) == 300


def test_a_ds_streams_from_one_worker_count_in_anothers_choice():
    host = Host()
    one, other = host.worker(0, "decode"), host.worker(1, "decode")
    key = "conversation"
    home = rendezvous(other, key)[0]
    held = one.get(home.url)
    for _ in range(4):  # M = 4: four streams more than another D is still home
        one.acquire(held)
    assert other.choose(key) is home
    one.acquire(held)
    assert other.choose(key).url != home.url
    for _ in range(5):
        one.release(held)
    assert other.choose(key) is home


def test_an_engine_the_table_has_no_row_for_counts_its_workers_own():
    host = Host()
    host.keys[:] = list(range(1, ROWS + 1))  # every row another engine's
    one = host.worker(0)
    p0 = one.get(PS[0])
    one.acquire(p0, 500)
    assert one.queued(p0) == 500 and one.streams(p0) == 1
    host.keys[3] = 0  # a row freed meanwhile: the release takes nothing from it
    one.release(p0, 500)
    assert one.queued(p0) == 0 and not any(host.queued) and not any(host.inflight)


def test_a_count_made_without_a_row_joins_the_row_once_one_frees():
    host = Host()
    host.keys[:] = list(range(1, ROWS + 1))  # every row another engine's
    one, other = host.worker(0), host.worker(1)
    p0 = one.get(PS[0])
    one.acquire(p0, 500)  # no row: counted by this worker alone
    host.keys[3] = 0  # a row freed meanwhile
    one.acquire(p0, 300)  # the row is taken, and holds both calls
    assert other.queued(other.get(PS[0])) == 800 and other.streams(other.get(PS[0])) == 2
    one.release(p0, 500)
    one.release(p0, 300)
    assert list(host.queued) == [0] * len(host.queued)  # nothing left, nothing below zero
    assert list(host.inflight) == [0] * len(host.inflight)


def test_counts_follow_their_engine_to_the_row_it_has_now():
    host = Host()
    one, other = host.worker(0), host.worker(1)
    p0 = one.get(PS[0])
    one.acquire(p0, 1000)
    [row] = [r for r in range(ROWS) if host.queued[r * STRIDE]]
    host.keys[row] = 12345  # the row lost to another engine (two workers took it at once)
    one.acquire(p0, 10)  # written again where p0's URL is now
    assert other.queued(other.get(PS[0])) == 1010
    assert host.queued[row * STRIDE] == 0  # nothing of p0's left in the other engine's row
    one.release(p0, 1000)
    one.release(p0, 10)
    assert list(host.queued) == [0] * len(host.queued)


def test_outside_gunicorn_the_counts_are_the_processs_own(monkeypatch):
    monkeypatch.delenv(slots.COLUMN_ENV, raising=False)
    assert HostCounts.from_env() is None
    assert HostCounts.from_env({slots.COLUMN_ENV: "3"}).column == 3
    pool = Pool("prefill", PS)
    p0 = pool.get(PS[0])
    pool.acquire(p0, 700)
    assert pool.counts is None and pool.queued(p0) == 700 and pool.streams(p0) == 1


# --- the master's hooks: a column per living worker, cleared when it exits ----------------------


@pytest.fixture
def master(monkeypatch, tmp_path):
    """gunicorn's master as the hooks see it; the shared memory as it was, afterwards."""
    monkeypatch.setenv(gunicorn_conf.MULTIPROC_ENV, str(tmp_path))  # child_exit's metrics
    saved = (bytes(slots.LIVE_SLOTS), slots.COLUMNS.value)
    logged = []
    server = SimpleNamespace(
        pd_slots={},
        pd_columns={},
        pd_private=None,
        num_workers=2,
        WORKERS={},
        log=SimpleNamespace(error=lambda *args: logged.append(args)),
    )
    yield server, gunicorn_conf._hooks(Settings())
    slots.LIVE_SLOTS[:] = saved[0]
    slots.COLUMNS.value = saved[1]
    for column in range(4):
        slots.clear_column(column)


def _fork(server, hooks, pid: int) -> SimpleNamespace:
    worker = SimpleNamespace(pid=pid, age=pid)
    hooks["pre_fork"](server, worker)
    server.WORKERS[pid] = worker
    return worker


def _exit(server, hooks, worker) -> None:
    del server.WORKERS[worker.pid]
    hooks["child_exit"](server, worker)


def test_a_worker_that_exits_leaves_nothing_counted(master):
    server, hooks = master
    one, two = _fork(server, hooks, 101), _fork(server, hooks, 102)
    assert (one.pd_column, two.pd_column) == (0, 1) and slots.COLUMNS.value == 2
    row = 5
    for worker, tokens in ((one, 4000), (two, 300)):
        slots.QUEUED[row * slots.MAX_SLOTS + worker.pd_column] = tokens
        slots.INFLIGHT[row * slots.MAX_SLOTS + worker.pd_column] = 1
    _exit(server, hooks, one)  # killed mid-call: its counts never released
    cells = slice(row * slots.MAX_SLOTS, row * slots.MAX_SLOTS + 2)
    assert slots.QUEUED[cells] == [0, 300] and slots.INFLIGHT[cells] == [0, 1]
    assert slots.COLUMNS.value == 2  # the other's column is still read
    # Its replacement takes the cleared column; once the last exits nothing is read.
    three = _fork(server, hooks, 103)
    assert three.pd_column == 0
    _exit(server, hooks, two)
    _exit(server, hooks, three)
    assert slots.COLUMNS.value == 0 and slots.QUEUED[cells] == [0, 0]


def test_a_reloads_new_workers_count_apart_from_the_old_ones_finishing(master):
    server, hooks = master
    old = [_fork(server, hooks, pid) for pid in (101, 102)]
    hooks["on_reload"](server)  # gunicorn starts the new set, then stops the old one
    gunicorn_conf._remove(server.pd_changes)
    new = [_fork(server, hooks, pid) for pid in (103, 104)]
    assert [w.pd_slot for w in old + new] == [0, 1, 0, 1]  # a slot each set, shared
    assert [w.pd_column for w in old + new] == [0, 1, 2, 3]  # a column each worker
    slots.QUEUED[2] = 900  # a new worker's work, row 0
    for worker in old:
        _exit(server, hooks, worker)
    assert slots.QUEUED[2] == 900 and slots.COLUMNS.value == 4
