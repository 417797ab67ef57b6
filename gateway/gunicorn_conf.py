"""gunicorn settings for pd-gateway, read from the same GATEWAY_* settings as the app.

`pd-gateway` runs gunicorn with `-c python:gateway.gunicorn_conf`; the top-level
`gunicorn.conf.py` imports this so `gunicorn -c gunicorn.conf.py` works from a checkout.
"""
import os

from gateway.config import Settings

_settings = Settings.from_env()

# Prometheus multiprocess mode: every worker writes its metrics to files in this directory,
# and /metrics in any worker sums them. Must be set before prometheus_client is imported.
# A directory made here is this master's own: on_exit removes it.
_own_metrics_dir = None
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    import tempfile

    _own_metrics_dir = tempfile.mkdtemp(prefix="pd-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = _own_metrics_dir

if _settings.worker_class == "gevent":
    # Patch before anything imports ssl/urllib3; gunicorn's own patching comes too late
    # for modules the master already imported (gunicorn #2177, gevent #1016).
    from gevent import monkey

    monkey.patch_all()

import itertools  # noqa: E402
import multiprocessing  # noqa: E402
import socket  # noqa: E402

from gunicorn.sock import TCPSocket  # noqa: E402

from gateway import affinity  # noqa: E402  (after patching: imports requests)
from gateway.affinity import MAX_SLOTS, SLOT_ENV, base_port  # noqa: E402

wsgi_app = "gateway.wsgi:app"
bind = [f"{_settings.host}:{_settings.port}"]
workers = _settings.workers
# Streams last as long as decode does: a sync worker would be killed at `timeout` mid-stream.
# gevent serves thousands of idle streams per worker; gthread one thread per stream.
# gevent: gunicorn's worker, except that a graceful stop does not wait out idle keep-alives.
worker_class = ("gateway.workers.GeventWorker" if _settings.worker_class == "gevent"
                else _settings.worker_class)
threads = _settings.threads
worker_connections = _settings.worker_connections
# The worker heartbeat, not a request limit: streams may run much longer than this.
timeout = 60
graceful_timeout = int(_settings.graceful_timeout)
# Above a fronting proxy's idle timeout, so it never reuses a connection we are closing.
keepalive = _settings.keepalive
# Recycling a worker wipes its conversation cache.
max_requests = 0
loglevel = _settings.log_level
accesslog = None
# gunicorn 25.1+ opens a control socket at one fixed path per user; several gateways on one
# machine (tests, benchmarks) would fight over it, and nothing here uses it.
control_socket_disable = True


# Stable worker slots (the pattern of gunicorn issue #1352): the master hands each new worker
# the smallest free slot, and a replacement for a dead worker gets the slot it left. A slot
# owns a share of conversations (gateway.affinity) and a private port, base + slot.
# Which slots own conversations now, shared with every worker (forked from the master, which
# alone writes it): a worker stopped by TTOU or a smaller reload stops owning at once, so no
# request waits for an owner that is not coming back.
LIVE_SLOTS = multiprocessing.RawArray("b", MAX_SLOTS)


def on_starting(server):
    server.pd_slots = {}    # slot -> the worker holding it
    # Every configured slot owns its share from the start: a request that reaches the first
    # worker up waits for its owner (owner_wait) rather than moving once all have started.
    for slot in range(min(server.num_workers, MAX_SLOTS)):
        LIVE_SLOTS[slot] = 1


def on_reload(server):
    # SIGHUP: gunicorn starts a whole new set of workers, then stops the old set. The new set
    # takes slots 0..n-1 again; new and old worker of a slot share its private port
    # (SO_REUSEPORT) until the old one has stopped.
    server.pd_slots = {}


def pre_fork(server, worker):
    # Runs in the single-threaded master, so taking a slot needs no lock.
    worker.pd_slot = next(slot for slot in itertools.count() if slot not in server.pd_slots)
    if worker.pd_slot >= MAX_SLOTS:
        raise RuntimeError(f"pd-gateway supports at most {MAX_SLOTS} workers")
    server.pd_slots[worker.pd_slot] = worker
    LIVE_SLOTS[worker.pd_slot] = 1


def nworkers_changed(server, new_value, old_value):
    # TTOU (or TTIN): gunicorn's manage_workers stops the oldest workers beyond the new count;
    # their slots stop owning conversations now, not when their last stream has ended.
    if old_value is None or new_value >= old_value:
        return
    workers = sorted(server.WORKERS.values(), key=lambda w: w.age)
    for worker in workers[:max(0, len(workers) - new_value)]:
        LIVE_SLOTS[worker.pd_slot] = 0


def post_fork(server, worker):
    os.environ[SLOT_ENV] = str(worker.pd_slot)
    affinity.LIVE_SLOTS = LIVE_SLOTS
    if _settings.forwards:
        # Appended before the worker's accept loop starts, so gunicorn serves it like the
        # public socket; only this process listens on it.
        address = (_settings.private_host, base_port(_settings) + worker.pd_slot)
        worker.sockets = [*worker.sockets, _PrivateSocket(address, worker.cfg, worker.log)]


class _PrivateSocket(TCPSocket):
    def set_options(self, sock, bound=False):
        # Only for the overlap of a reload (see on_reload); the public socket keeps
        # gunicorn's own setting, so no other process can bind it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return super().set_options(sock, bound)


def child_exit(server, worker):
    holder = server.pd_slots.get(worker.pd_slot)
    if holder is worker:                    # not if a reload gave it away
        del server.pd_slots[worker.pd_slot]
    # A crashed worker's slot stays live: the master refills the smallest free slots at once
    # (pre_fork), and its conversations wait for the replacement instead of moving twice.
    # A slot nobody will refill (TTOU, a smaller reload) stops owning.
    missing = max(0, server.num_workers - len(server.WORKERS))
    free = (slot for slot in itertools.count() if slot not in server.pd_slots)
    refilled = set(itertools.islice(free, missing))
    if holder is None or (holder is worker and worker.pd_slot not in refilled):
        LIVE_SLOTS[worker.pd_slot] = 0
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server):
    # The master, after its workers have stopped. A USR2 re-exec gets a directory of its own
    # (gunicorn starts it with the environment from before this file ran).
    if _own_metrics_dir:
        import shutil

        shutil.rmtree(_own_metrics_dir, ignore_errors=True)
