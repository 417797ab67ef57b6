"""`python -m emulator.cli` (from a checkout): serve one emulated engine (HTTP API and KV port) from
one gevent process."""

from __future__ import annotations

from gevent import monkey

# Before anything imports socket or ssl: pulls (requests) and sleeps must yield to the hub, so one
# process can hold hundreds of streams. Tests never import this module; they spawn it.
monkey.patch_all()

import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402

import gevent  # noqa: E402
from gevent.event import Event  # noqa: E402
from gevent.pywsgi import WSGIHandler, WSGIServer  # noqa: E402

from .app import SOCKET_KEY, create_app  # noqa: E402
from .config import config_from_args  # noqa: E402
from .engine import Engine  # noqa: E402
from .kvport import create_kv_app  # noqa: E402

log = logging.getLogger("emulator")

BACKLOG = 2048  # hundreds of clients connect at once in the load test; the default 256 drops SYNs


class _SocketHandler(WSGIHandler):
    """Expose the client socket so faults can cut the connection or watch for the client leaving."""

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ[SOCKET_KEY] = self.socket
        return environ


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format=f"%(asctime)s {config.role}:{config.port} %(levelname)s %(name)s: %(message)s",
    )
    engine = Engine(config)
    assert config.kv_port is not None, "Config.__post_init__ sets the KV port"
    access = "default" if config.access_log else None
    api = WSGIServer(
        (config.host, config.port),
        create_app(engine),
        handler_class=_SocketHandler,
        backlog=BACKLOG,
        log=access,
    )
    kv = WSGIServer(
        (config.host, config.kv_port),
        create_kv_app(engine.engine_id, engine.leases),
        backlog=BACKLOG,
        log=access,
    )
    log.info(
        "%s engine %s serving %s on http://%s:%d, KV port %d (advertised as %s:%d), fault %s",
        config.role,
        engine.engine_id,
        config.model,
        config.host,
        config.port,
        config.kv_port,
        config.advertise_host,
        config.kv_port,
        config.fault.mode,
    )
    for server in (api, kv):
        server.start()  # binding errors (port taken) surface here and end the process
        # vLLM serves through uvicorn, whose sockets send small writes at once. Without this a
        # token written right after the role chunk waits for the reader's delayed ACK on a
        # kept-alive connection: 40 ms on every turn's TTFT. Accepted sockets inherit it.
        server.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stopping = Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        gevent.signal_handler(signum, stopping.set)
    stopping.wait()
    log.info("stopping")
    api.stop(timeout=1)  # open streams get a second, then their greenlets are killed
    kv.stop(timeout=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
