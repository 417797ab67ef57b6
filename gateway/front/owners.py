"""Which gunicorn worker owns a conversation, and forwarding a request to that worker.

Each worker has its own conversation store, and the kernel hands a new connection to any
worker. So every worker holds a stable slot (assigned by the master, see gunicorn_conf) and a
private loopback listener on `base + slot`; the owner of a conversation is the rendezvous
hash of its root key over the slots, and a non-owner forwards the whole request to the owner
once. A request that arrived on a private listener is always served where it landed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from urllib.parse import quote

from werkzeug.http import is_hop_by_hop_header

from gateway.config import Settings
from gateway.engines.instances import Instance
from gateway.engines.upstream import Upstream
from gateway.flow.reply import Reply, relayed
from gateway.slots import LIVE_SLOTS, PRIVATE_ENV, SLOT_ENV
from gateway.support import metrics
from gateway.support.errors import BadGateway, GatewayError, ServiceUnavailable

log = logging.getLogger(__name__)
# Besides hop-by-hop headers (RFC 9110 7.6.1, werkzeug's list): those requests recomputes.
_RECOMPUTED = frozenset({"host", "content-length"})
_RELAYED_BACK = (
    "Content-Type",
    "X-Request-Id",
    "X-Gateway-Cache",
    "X-Gateway-KV",
    "X-Gateway-Path",
    "Cache-Control",
    "X-Accel-Buffering",
    "Retry-After",
    "WWW-Authenticate",
    "retry-after-ms",
    *(
        f"x-ratelimit-{what}-{kind}"
        for what in ("limit", "remaining", "reset")
        for kind in ("requests", "tokens")
    ),
)


def owner(root: str, slots) -> int:
    """Rendezvous hash over `slots` (a count or the live slot numbers): each slot keeps its
    keys when others come or go."""
    key = root.encode()
    candidates = range(slots) if isinstance(slots, int) else slots
    return max(
        candidates,
        key=lambda s: hashlib.blake2b(key, digest_size=8, salt=s.to_bytes(16, "little")).digest(),
    )


class Owners:
    """This worker's slot and the way to every other worker's private listener."""

    def __init__(
        self, settings: Settings, upstream: Upstream, environ: Mapping[str, str] = os.environ
    ) -> None:
        self.slot = int(environ.get(SLOT_ENV, "-1"))
        # gunicorn_conf's post_fork says where the private listeners are when it opened them
        # (several workers, local stores, affinity on in the master's settings). Off without
        # them (one worker, outside gunicorn or without its hooks), with a shared store, or
        # when switched off.
        private = environ.get(PRIVATE_ENV, "")
        self.enabled = settings.forwards and self.slot >= 0 and bool(private)
        host, _, base = private.rpartition(":")
        self.private_host, self.base = host, int(base or 0)
        self.own_port = str(self.base + self.slot)
        self.targets: dict[int, Instance] = {}
        self.upstream = upstream
        self.owner_wait = settings.owner_wait
        self._live: tuple[bytes, list[int]] = (b"", [self.slot])

    def may_forward(self, port: str) -> bool:
        """Could a request that came on `port` belong to another worker? Never if it came on
        this worker's private port (only forwards arrive there)."""
        return self.enabled and port != self.own_port

    def forwarded(self, port: str) -> bool:
        """Did a request that came on `port` come from another worker (its client is there)?"""
        return self.enabled and port == self.own_port

    def live_slots(self) -> list[int]:
        """The slots that own conversations now (the master's table)."""
        table = bytes(LIVE_SLOTS)
        if table != self._live[0]:
            self._live = (table, [s for s, live in enumerate(table) if live] or [self.slot])
        return self._live[1]

    def forward_to(self, root: str) -> Instance | None:
        """The owner worker to forward to, or None if this worker owns the conversation."""
        slot = owner(root, self.live_slots())
        if slot == self.slot:
            return None
        if slot not in self.targets:
            self.targets[slot] = Instance(
                f"http://{self.private_host}:{self.base + slot}", "worker", slot
            )
        return self.targets[slot]

    def forward(
        self,
        target: Instance,
        route: str,
        raw: bytes,
        headers: Mapping[str, str],
        model: str = "unknown",
    ) -> Reply | None:
        """Relay the request through its owner, to `route`, the path it came on (an app may
        mount the routes under a prefix); None if the owner is away (serve it here). `model`
        labels a stream the owner could not finish.

        Only an owner that is away falls back to serving here. A client that left, or the
        request's deadline, propagate (the view answers 499/504): re-running the whole turn
        here would compute it for nobody, with nobody watching.
        """
        sent = {
            k: v
            for k, v in headers.items()
            if not is_hop_by_hop_header(k) and k.lower() not in _RECOMPUTED
        }
        deadline = time.monotonic() + self.owner_wait
        while True:
            try:
                response = self.upstream.post_raw(target, quote(route), raw, sent)
                break
            except (ServiceUnavailable, BadGateway):
                # Refused, or a pooled connection to a dead owner broke: the owner is
                # restarting (gunicorn respawns a dead worker in about a second). Waiting
                # keeps its conversations to one miss; serving here would leave the next
                # turn's entry in the wrong worker.
                if time.monotonic() >= deadline:
                    log.info("owner %s is away; serving here", target.name)
                    metrics.FORWARDED.labels("away").inc()
                    return None
                time.sleep(0.05)
            except GatewayError:
                metrics.FORWARDED.labels("failed").inc()  # client gone, deadline
                raise
        metrics.FORWARDED.labels("sent").inc()
        back = {h: response.headers[h] for h in _RELAYED_BACK if h in response.headers}
        sse = back.get("Content-Type", "").startswith("text/event-stream")

        # A stream cut here (its owner died mid-stream): the owner cannot count it; we do.
        def cut(exc: GatewayError) -> None:
            metrics.ERRORS.labels("stream", str(exc.status), model).inc()

        return Reply(
            headers=back,
            stream=relayed(response, sse, cut),
            status=response.status,
            close=response.close,
        )
