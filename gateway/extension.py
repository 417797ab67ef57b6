"""`PDGateway`: the gateway as a Flask extension, mounted on an app of its own or on a host's.

As Flask-SQLAlchemy or Flask-Limiter: ``PDGateway(app)``, or ``pd = PDGateway()`` then
``pd.init_app(app, url_prefix="/llm")`` in an app factory. Settings: defaults, then GATEWAY_*
variables, then the app's PD_GATEWAY_* config keys, then keyword arguments. Each process builds
its own `Gateway` on first use (a pid check), so an app made before gunicorn forks (--preload)
gives every worker its own engine pools, store, prober and worker slot.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any

from flask import Flask

from gateway.config import Settings
from gateway.engines.transport import EngineTransport
from gateway.reuse.store import ConversationStore
from gateway.service import Gateway
from gateway.slots import SLOT_ENV
from gateway.views import create_blueprint

log = logging.getLogger(__name__)
EXTENSION = "pd_gateway"  # the key in app.extensions


class PDGateway:
    """Mounts the gateway's routes on Flask apps; keeps nothing per app itself."""

    def __init__(
        self,
        app: Flask | None = None,
        *,
        url_prefix: str | None = None,
        conversation_store: ConversationStore | None = None,
        transport: EngineTransport | None = None,
        **settings: Any,
    ) -> None:
        """`settings` are Settings fields, over the app's config; `conversation_store`
        replaces the store the `store` setting describes, `transport` the engine calls' own
        (tests: gateway.engines.transport)."""
        self.url_prefix = url_prefix
        self.conversation_store = conversation_store
        self.transport = transport
        self.settings = settings
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask, *, url_prefix: str | None = None) -> None:
        """Mount the routes on `app` (under `url_prefix`, default the constructor's); the app's
        `app.extensions["pd_gateway"]` is then its `MountedGateway`."""
        mounted = MountedGateway(
            Settings.from_mapping(app.config, **self.settings),
            self.conversation_store,
            self.transport,
        )
        app.extensions[EXTENSION] = mounted
        prefix = url_prefix if url_prefix is not None else self.url_prefix
        # Under a prefix, every path below it is the gateway's to answer, unknown ones too;
        # at a host app's root, the host's own 404 stays its own.
        app.register_blueprint(
            create_blueprint(lambda: mounted.gateway, unknown=bool(prefix and prefix.strip("/"))),
            url_prefix=prefix,
        )


class MountedGateway:
    """One app's settings, and the `Gateway` of the process serving it, built on first use."""

    def __init__(
        self,
        settings: Settings,
        store: ConversationStore | None = None,
        transport: EngineTransport | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._transport = transport
        self._current: tuple[int, Gateway] | None = None  # (pid, its Gateway): read at once
        self._lock = threading.Lock()

    @property
    def gateway(self) -> Gateway:
        """This process's Gateway. One built before a fork belongs to the parent: a worker
        builds its own, after gunicorn's hooks have given it its slot."""
        current = self._current
        if current is None or current[0] != os.getpid():
            # Building does no I/O, so a gevent worker never switches while holding the lock.
            with self._lock:
                current = self._current
                if current is None or current[0] != os.getpid():
                    current = (os.getpid(), self._build())
                    self._current = current
        return current[1]

    def _build(self) -> Gateway:
        if SLOT_ENV not in os.environ and "gunicorn.arbiter" in sys.modules:
            log.warning(
                "pd-gateway runs under gunicorn without its hooks: no worker affinity "
                "(a conversation hits only on the worker it lands on), /metrics of one "
                "worker, no check against sync workers. Add `install(globals())` from "
                "gateway.gunicorn_conf to gunicorn.conf.py (docs/embedding.md)."
            )
        gateway = Gateway(self.settings, self._store, self._transport)
        atexit.register(self._close_at_exit, os.getpid())
        return gateway

    def _close_at_exit(self, pid: int) -> None:
        if pid == os.getpid():  # not in a child forked after the build: not its Gateway
            self.close()

    def close(self) -> None:
        """Stop this process's Gateway (its prober, its pooled engine connections); the next
        use builds a new one. Runs at exit, not per request."""
        with self._lock:
            current, self._current = self._current, None
        if current is not None and current[0] == os.getpid():
            current[1].close()
