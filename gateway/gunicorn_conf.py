"""pd-gateway's gunicorn hooks, added to any gunicorn config by one call: `install(globals())`.

They give each worker a stable slot and, with several workers, a private loopback listener (the
worker affinity of gateway.front.owners), a column of the host's in-flight counts (cleared when
it exits: gateway.engines.host_counts), set up the directory where every worker writes its
metrics (so /metrics sums them), open the metrics listener (--metrics-port: gateway.metrics_port
says why the workers answer it), and refuse to start under sync workers. Hooks the config
already has keep running, after pd-gateway's. The gateway's own config (standalone_conf.py) is
its settings and the same call; a host app's `gunicorn.conf.py` ends with it (docs/embedding.md).

Importing this module imports neither requests nor the app, so gevent can still be patched
after it.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from gunicorn.sock import TCP6Socket, TCPSocket
from gunicorn.util import get_arity, load_class

from gateway.config import Settings
from gateway.slots import (
    APPLIED,
    CHANGES_ENV,
    COLUMN_ENV,
    COLUMNS,
    LIVE_SLOTS,
    MAX_SLOTS,
    PRIVATE_ENV,
    SLOT_ENV,
    THREADS_ENV,
    clear_column,
)

# prometheus_client's own variable; it reads it once, when first imported.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
HOOKS = (
    "on_starting",
    "on_reload",
    "pre_fork",
    "post_fork",
    "post_worker_init",
    "nworkers_changed",
    "child_exit",
    "on_exit",
)
_MARK = "_pd_gateway_hook"
_own_metrics_dir: str | None = None  # made by install(), removed by on_exit


def install(config: dict[str, Any], **settings: Any) -> None:
    """Add pd-gateway's hooks to the gunicorn config namespace `config`: `install(globals())`,
    last in the file, after the config's own hooks (each keeps running, after pd-gateway's).

    `settings` override the GATEWAY_* environment for what the master needs to know: `affinity`,
    `store` (a shared Redis store needs no private listeners), `private_host`,
    `private_base_port` (default: the first bound port + 1), `metrics_port` and
    `metrics_host` (a host app's own PD_GATEWAY_* config is read in the workers, too late).
    """
    if any(getattr(config.get(name), _MARK, False) for name in HOOKS):
        raise RuntimeError("pd-gateway: install() was already called on this gunicorn config")
    _metrics_dir()
    worker_class = config.get("worker_class")
    if worker_class is not None and _is_gevent(load_class(worker_class)):
        # Patch before the app (--preload) imports ssl/urllib3: the worker's own patching,
        # after fork, comes too late for modules the master already imported (gunicorn #2177,
        # gevent #1016). Once: a reload (SIGHUP) runs the config file, and install(), again.
        from gevent import monkey

        if not monkey.is_module_patched("socket"):
            monkey.patch_all()
    ours = _hooks(Settings.from_env(**settings))
    for name in HOOKS:
        config[name] = _chain(ours[name], config.get(name))


def _chain(ours: Callable, theirs: Callable | None) -> Callable:
    """`ours`, then the config's own hook of the same name. gunicorn checks a hook's arity, so
    the pair keeps the signature of `ours` (functools.wraps)."""
    setattr(ours, _MARK, True)
    if theirs is None:
        return ours
    if get_arity(theirs) != get_arity(ours):
        raise RuntimeError(
            f"pd-gateway: this config's {ours.__name__} takes "
            f"{get_arity(theirs)} arguments; gunicorn passes {get_arity(ours)}"
        )

    @functools.wraps(ours)
    def both(*args: Any) -> None:
        ours(*args)
        theirs(*args)

    return both


def _hooks(settings: Settings) -> dict[str, Callable]:
    """The hooks, over the master's view of `settings`."""

    def on_starting(server):
        _refuse_what_cannot_work(server)
        # Stable worker slots (the pattern of gunicorn issue #1352): the master hands each new
        # worker the smallest free slot, and a replacement for a dead worker gets the slot it
        # left. A slot owns a share of conversations (gateway.front.owners) and a private port.
        server.pd_slots = {}  # slot -> the worker holding it
        # column -> the living worker counting its in-flight work there (gateway.slots.QUEUED):
        # kept across reloads, whose old workers finish their streams beside the new ones.
        server.pd_columns = {}
        server.pd_private = _private_base(settings, server)
        # slot -> the master's hold on its private port: a socket bound with SO_REUSEPORT and
        # never listening, kept while the slot lives. Linux lets only sockets of the same uid
        # share such a port, so no other local user can bind it while its worker is away (a
        # crash, a restart), and with nobody listening a forward to it is refused at once,
        # as before (the forwarder waits --owner-wait for the replacement, then serves).
        server.pd_holds = {}
        server.pd_changes = _new_changes(None)
        server.pd_metrics = _metrics_listener(settings, server, None)
        # Every configured slot owns its share from the start: a request that reaches the first
        # worker up waits for its owner (owner_wait) rather than moving once all have started.
        for slot in range(min(server.num_workers, MAX_SLOTS)):
            LIVE_SLOTS[slot] = server.pd_private is None or _hold(server, slot)

    def on_reload(server):
        # SIGHUP: gunicorn starts a whole new set of workers, then stops the old set. The new
        # set takes slots 0..n-1 again; new and old worker of a slot share its private port
        # (SO_REUSEPORT) until the old one has stopped.
        server.pd_slots = {}
        # Admin changes are reset with the settings: the new workers start from those alone.
        # Old workers notice their file was unlinked and stop reporting progress in APPLIED.
        server.pd_changes = _new_changes(getattr(server, "pd_changes", None))
        # The reloaded settings' metrics listener; the one there stays if they did not move it.
        server.pd_metrics = _metrics_listener(settings, server, getattr(server, "pd_metrics", None))

    def pre_fork(server, worker):
        if not hasattr(server, "pd_slots"):  # on_starting was not ours: it says why
            _refuse_what_cannot_work(server)
        # Runs in the single-threaded master, so taking a slot needs no lock.
        worker.pd_slot = next(slot for slot in itertools.count() if slot not in server.pd_slots)
        if worker.pd_slot >= MAX_SLOTS:
            raise RuntimeError(f"pd-gateway supports at most {MAX_SLOTS} workers")
        server.pd_slots[worker.pd_slot] = worker
        worker.pd_column = _take_column(server, worker)
        # A slot whose port is taken serves what it receives and owns nothing.
        LIVE_SLOTS[worker.pd_slot] = server.pd_private is None or _hold(server, worker.pd_slot)

    def nworkers_changed(server, new_value, old_value):
        # TTOU (or TTIN): gunicorn's manage_workers stops the oldest workers beyond the new
        # count; their slots stop owning conversations now, not when their last stream ends.
        if old_value is None or new_value >= old_value:
            return
        workers = sorted(server.WORKERS.values(), key=lambda w: w.age)
        for worker in workers[: max(0, len(workers) - new_value)]:
            LIVE_SLOTS[worker.pd_slot] = 0

    def post_fork(server, worker):
        os.environ[SLOT_ENV] = str(worker.pd_slot)
        if _is_gevent(type(worker)):
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = str(worker.cfg.threads)
        os.environ[CHANGES_ENV] = server.pd_changes
        if worker.pd_column >= 0:
            os.environ[COLUMN_ENV] = str(worker.pd_column)
        else:
            os.environ.pop(COLUMN_ENV, None)
        listener = getattr(server, "pd_metrics", None)
        # Its address now: gunicorn's gevent worker takes the descriptor out of the object.
        worker.pd_metrics = listener.getsockname() if listener is not None else None
        if listener is not None:
            # Accepted by every worker, as gunicorn's own listeners are; answered by
            # gateway.metrics_port in front of the app (post_worker_init).
            worker.sockets = [*worker.sockets, listener]
        os.environ.pop(PRIVATE_ENV, None)
        if server.pd_private is not None:
            host, base = server.pd_private
            for hold in server.pd_holds.values():  # the master's, not this worker's
                hold.close()
            os.environ[PRIVATE_ENV] = f"{host}:{base}"
            # Appended before the worker's accept loop starts, so gunicorn serves it like the
            # public socket; only this process listens on it. The worker keeps the object too:
            # gunicorn 20's gevent worker swaps its sockets for copies of their descriptors,
            # and a dropped original would close the descriptor under the copy.
            address = (host, base + worker.pd_slot)
            if worker.pd_slot not in server.pd_holds:  # taken before the master got it
                return
            try:
                # why the ignore: types-gunicorn types a socket's address as str; a TCP one
                # takes (host, port), as gunicorn's own sock.create_sockets passes it.
                worker.pd_private_socket = _PrivateSocket(
                    address,  # type: ignore[arg-type]
                    worker.cfg,
                    worker.log,
                )
            except OSError as exc:  # never a reason to halt the gateway
                worker.log.error(
                    "pd-gateway: worker slot %d cannot listen on %s:%d (%s); it "
                    "serves without owning conversations",
                    worker.pd_slot,
                    *address,
                    exc,
                )
                LIVE_SLOTS[worker.pd_slot] = 0
                return
            worker.sockets = [*worker.sockets, worker.pd_private_socket]

    def post_worker_init(worker):
        # The worker's Gateway built now, not at its first request: its engines are probed
        # from its start, and its /health says 503 until some P and D answer.
        extensions = getattr(getattr(worker, "wsgi", None), "extensions", None)
        mounted = extensions.get("pd_gateway") if isinstance(extensions, dict) else None
        if mounted is not None:
            mounted.gateway  # noqa: B018  (built on first use)
        listener = getattr(worker, "pd_metrics", None)  # its address
        if listener is not None:
            if mounted is None:
                raise RuntimeError(
                    "pd-gateway: the metrics listener (--metrics-port) needs gunicorn's app to "
                    "be the Flask app PDGateway is mounted on (its /health is that gateway's); "
                    "this worker's app has no app.extensions['pd_gateway']"
                )
            from gateway.metrics_port import MetricsPort

            worker.wsgi = MetricsPort(worker.wsgi, listener, mounted)
        elif mounted is not None and mounted.settings.metrics_port:
            worker.log.warning(
                "pd-gateway: the app's settings name a metrics port (%d), but "
                "gunicorn's master opened none: set GATEWAY_METRICS_PORT for "
                "the master, or install(globals(), metrics_port=...)",
                mounted.settings.metrics_port,
            )

    def child_exit(server, worker):
        holder = server.pd_slots.get(worker.pd_slot)
        if holder is worker:  # not if a reload gave it away
            del server.pd_slots[worker.pd_slot]
        # A crashed worker's slot stays live: the master refills the smallest free slots at
        # once (pre_fork), and its conversations wait for the replacement instead of moving
        # twice. A slot nobody will refill (TTOU, a smaller reload) stops owning.
        missing = max(0, server.num_workers - len(server.WORKERS))
        free = (slot for slot in itertools.count() if slot not in server.pd_slots)
        refilled = set(itertools.islice(free, missing))
        if holder is None or (holder is worker and worker.pd_slot not in refilled):
            LIVE_SLOTS[worker.pd_slot] = 0
            if worker.pd_slot not in server.pd_slots:  # a slot nobody will refill
                hold = getattr(server, "pd_holds", {}).pop(worker.pd_slot, None)
                if hold is not None:
                    hold.close()
        _free_column(server, worker)
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)

    def on_exit(server):
        # The master, after its workers have stopped. A USR2 re-exec gets a directory of its
        # own (gunicorn starts it with the environment from before install() ran).
        _remove(getattr(server, "pd_changes", None))
        if _own_metrics_dir:
            import shutil

            shutil.rmtree(_own_metrics_dir, ignore_errors=True)

    hooks: dict[str, Callable[..., Any]] = dict(
        on_starting=on_starting,
        on_reload=on_reload,
        pre_fork=pre_fork,
        post_fork=post_fork,
        post_worker_init=post_worker_init,
        nworkers_changed=nworkers_changed,
        child_exit=child_exit,
        on_exit=on_exit,
    )
    assert tuple(hooks) == HOOKS
    return hooks


def _refuse_what_cannot_work(server) -> None:
    """Stop gunicorn at startup, saying why, rather than serve broken streams or lose affinity."""
    from gunicorn.workers.sync import SyncWorker

    if issubclass(server.worker_class, SyncWorker):
        raise RuntimeError(
            "pd-gateway cannot run under gunicorn's sync worker: it kills a request at "
            "--timeout, mid-stream. Use worker_class = 'gateway.workers.GeventWorker' (gevent) "
            "or 'gateway.workers.ThreadWorker' (gthread with client timeouts) with threads >= the "
            "concurrent streams per worker."
        )
    replaced = [name for name in HOOKS if not getattr(getattr(server.cfg, name), _MARK, False)]
    if replaced:
        raise RuntimeError(
            f"pd-gateway: gunicorn's {', '.join(replaced)} hook(s) were set after "
            "install(globals()) and replaced pd-gateway's; call install(globals()) at the end of "
            "gunicorn.conf.py, where it chains the hooks defined before it."
        )


def _take_column(server, worker) -> int:
    """The smallest column no living worker holds, now `worker`'s; -1 (logged) if there is
    none: that worker's in-flight work stays its own."""
    column = next(column for column in itertools.count() if column not in server.pd_columns)
    if column >= MAX_SLOTS:
        server.log.error(
            "pd-gateway: more than %d workers alive at once; a new one counts its in-flight "
            "work alone",
            MAX_SLOTS,
        )
        return -1
    server.pd_columns[column] = worker
    COLUMNS.value = max(COLUMNS.value, column + 1)
    return column


def _free_column(server, worker) -> None:
    """`worker` has exited: what it had in flight is gone, and its column is free."""
    column = getattr(worker, "pd_column", -1)
    if server.pd_columns.get(column) is not worker:
        return
    del server.pd_columns[column]
    clear_column(column)
    COLUMNS.value = max(server.pd_columns, default=-1) + 1


def _private_base(settings: Settings, server) -> tuple[str, int] | None:
    """Where slot 0 listens privately, or None when the workers never forward (one worker, a
    shared store, affinity off)."""
    if not settings.forwards or server.num_workers < 2:
        return None
    public = [address[1] for address in server.cfg.address if isinstance(address, tuple)]
    if not settings.private_base_port and not public:
        raise RuntimeError(
            "pd-gateway: no TCP address bound to put the private listeners "
            "after; set GATEWAY_PRIVATE_BASE_PORT"
        )
    base = settings.private_base_port or public[0] + 1
    taken = {*public, settings.metrics_port} - {0}
    clash = sorted(taken & set(range(base, base + server.num_workers)))
    if clash:
        raise RuntimeError(
            f"pd-gateway: the private listeners ({base}..) would take the bound "
            f"port(s) {clash}; set GATEWAY_PRIVATE_BASE_PORT elsewhere"
        )
    return settings.private_host, base


def _hold(server, slot: int) -> bool:
    """Does the master hold `slot`'s private port (bound now if it was not)? False (logged) if
    another process has it: that worker then owns no conversations, and the gateway goes on."""
    if slot in server.pd_holds:
        return True
    host, base = server.pd_private
    # Not SO_REUSEADDR: a socket of another uid with it could share a port whose other sockets
    # all have it and none listens. Not inheritable: a re-exec'd master (USR2) binds its own.
    hold = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hold.bind((host, base + slot))
    except OSError as exc:
        hold.close()
        server.log.error(
            "pd-gateway: worker slot %d cannot have its private port %s:%d (%s); "
            "it serves without owning conversations",
            slot,
            host,
            base + slot,
            exc,
        )
        return False
    server.pd_holds[slot] = hold
    return True


def _metrics_listener(settings: Settings, server, old: TCPSocket | None) -> TCPSocket | None:
    """The master's metrics listener where `settings` put it (None: no --metrics-port):
    `old` if it is there already, else a new one (`old` closed)."""
    address = settings.metrics_address
    if old is not None:
        if old.cfg_addr == address:
            return old
        old.close()
    if address is None:
        return None
    # gunicorn's own kind of listener. Not SO_REUSEPORT (unless gunicorn's reuse_port asks for
    # it): a port another process holds stops the gateway, saying which, rather than scrapes
    # shared with it. So a re-exec'd master (USR2) cannot bind it while the old one runs: it
    # stops, saying so, and the old master goes on serving.
    kind = TCP6Socket if ":" in address[0] else TCPSocket
    try:
        # why the ignore: types-gunicorn types the address as str; TCP takes (host, port).
        listener = kind(address, server.cfg, server.log)  # type: ignore[arg-type]
    except OSError as exc:
        raise RuntimeError(
            f"pd-gateway: cannot listen for metrics on {address[0]}:{address[1]} "
            f"(--metrics-host, --metrics-port): {exc.strerror or exc}"
        ) from exc
    # The workers get it by fork; nothing exec'd needs it.
    listener.sock.set_inheritable(False)
    server.log.info(
        "pd-gateway: metrics and health on http://%s:%d (/metrics, /health)",
        *listener.getsockname()[:2],
    )
    return listener


def _new_changes(old: str | None) -> str:
    """A new, empty admin-changes file (mode 0600: only the gateway's user may add instances);
    the old one unlinked."""
    _remove(old)
    for slot in range(MAX_SLOTS):
        APPLIED[slot] = 0
    fd, path = tempfile.mkstemp(prefix="pd-gateway-instances-", suffix=".jsonl")
    os.close(fd)
    return path


def _remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _is_gevent(worker_class: type) -> bool:
    from gunicorn.workers.ggevent import GeventWorker

    return issubclass(worker_class, GeventWorker)


def _metrics_dir() -> None:
    """Prometheus multiprocess mode: every worker writes its metrics to files in one directory,
    and /metrics in any worker sums them. prometheus_client reads the variable when first
    imported, so it must be set before the app is. A directory made here is this master's own."""
    global _own_metrics_dir
    if os.environ.get(MULTIPROC_ENV):
        return
    if "prometheus_client.values" in sys.modules:
        raise RuntimeError(
            f"pd-gateway: prometheus_client was imported before install(), without "
            f"{MULTIPROC_ENV}: each worker's metrics would stay its own. Import "
            "it (or your app) inside your hooks rather than at the top of "
            f"gunicorn.conf.py, or set {MULTIPROC_ENV} in the environment."
        )
    _own_metrics_dir = tempfile.mkdtemp(prefix="pd-gateway-metrics-")
    os.environ[MULTIPROC_ENV] = _own_metrics_dir


class _PrivateSocket(TCPSocket):
    def set_options(self, sock, bound=False):
        # Beside the master's hold, and for the overlap of a reload (see on_reload); Linux
        # shares the port with sockets of this uid only. The public socket keeps gunicorn's
        # own setting.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        return super().set_options(sock, bound)
