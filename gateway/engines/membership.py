"""This worker's instance set as it changes at run time: admin changes (POST/DELETE
/admin/instances), shared by every worker of the gunicorn master, and DNS names re-resolved.

How an admin change reaches every worker: gunicorn runs several worker processes, each with its
own pools, and an admin call reaches one of them. The master makes one file for its workers
(gateway.slots, `CHANGES_ENV`); the worker that is asked appends the change, one JSON
line, and every worker applies every line in file order, the asked one at once, the others
within `TICK` seconds (a background thread, a greenlet under gevent). Each worker publishes how
far it has applied (`APPLIED[slot]`), and the asked worker waits, bounded, until every live slot
has the change before it answers. Why a file rather than relaying the call to each worker's
private listener: it needs no listener (a Redis store has none), a worker that restarts
replays it and comes up with the same set as its siblings, and applying one ordered log in
every worker keeps them identical.

Admin changes live as long as the master: a restart, or a reload (SIGHUP), starts again from
the settings. Outside gunicorn's hooks (one process, an embedder without `install`), a file of
this process's own: the change applies here only.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from urllib3.exceptions import LocationParseError
from urllib3.util import parse_url

from gateway.config import Settings, _url_list, split_host_port
from gateway.engines.discovery import Discovery, Resolver
from gateway.engines.instances import Pool, public_url
from gateway.slots import APPLIED, CHANGES_ENV, LIVE_SLOTS, MAX_SLOTS, SLOT_ENV
from gateway.support import metrics
from gateway.support.errors import BadRequest, NotFound

log = logging.getLogger(__name__)
TICK = 0.5  # seconds between looks at the changes file
CONFIRM_WAIT = 5.0  # seconds an admin call waits for the other workers to apply its change


class ChangeLog:
    """The ordered admin changes of one gunicorn master's workers: a file every worker appends
    to (under an exclusive lock, one write per line) and reads from where it stopped."""

    def __init__(self, path: str | None) -> None:
        if path:
            self.shared = True
            self._fd = os.open(path, os.O_RDWR | os.O_APPEND)
        else:
            self.shared = False
            self._fd, own = tempfile.mkstemp(prefix="pd-gateway-instances-")
            os.unlink(own)  # this process's alone; gone when it exits
        self.offset = 0  # bytes read and applied

    def append(self, change: dict) -> None:
        line = (json.dumps(change, separators=(",", ":")) + "\n").encode()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            os.write(self._fd, line)  # O_APPEND: at the end, whatever another worker wrote
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def unread(self) -> list[dict]:
        """The whole lines written since the last call, in order."""
        data = os.pread(self._fd, 1 << 20, self.offset)
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

    def retired(self) -> bool:
        """Has the master replaced this file (a reload)? This worker is one of the old set."""
        return self.shared and os.fstat(self._fd).st_nlink == 0

    def close(self) -> None:
        os.close(self._fd)


class Allowed:
    """Is a URL's host (and port) one of these networks or names (`*.domain`: any name under
    it), each with its port where it names one? A name is matched as written, never resolved:
    it could resolve anywhere by the time it is used."""

    def __init__(self, hosts: list[str]) -> None:
        self.networks: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]] = []
        self.names: list[tuple[str, int | None]] = []
        self.domains: list[tuple[str, int | None]] = []
        for item in hosts:
            host, port = split_host_port(item)
            try:
                self.networks.append((ipaddress.ip_network(host, strict=False), port))
            except ValueError:
                if host.startswith("*."):
                    self.domains.append((host[1:].lower(), port))
                else:
                    self.names.append((host.lower(), port))

    def __call__(self, url: str) -> bool:
        """`url` as `added_url` gives it (one parse: urllib3's, the connection's own)."""
        parsed = parse_url(url)
        host, port = (parsed.host or "").strip("[]").lower(), parsed.port
        fits = lambda allowed: allowed is None or allowed == port  # noqa: E731
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(host == name and fits(p) for name, p in self.names) or any(
                host.endswith(domain) and fits(p) for domain, p in self.domains
            )
        # An IPv4 address written as IPv6 (::ffff:169.254.169.254) is the IPv4 host it maps.
        address = getattr(address, "ipv4_mapped", None) or address
        return any(address in network and fits(p) for network, p in self.networks) or any(
            host == name and fits(p) for name, p in self.names
        )


def added_url(url: object) -> str:
    """An engine URL given through /admin/instances, parsed once with the parser the
    connection uses (urllib3's) and refused unless it is `scheme://host:port`: no user:password
    (an `EVIL:PORT\\@ALLOWED:1` would be read as one host by one parser and another by the
    next), no backslash, path, query or fragment. Returns it as the gateway keeps it."""
    if not isinstance(url, str):
        raise ValueError("url must be a string")
    if "\\" in url or not url.isprintable() or any(c.isspace() for c in url):
        raise ValueError("a URL with a backslash, a space or a control character")
    try:
        parsed = parse_url(url if "://" in url else "http://" + url)
    except LocationParseError:
        raise ValueError(f"{url!r} is not an http://host:port URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.port is None:
        raise ValueError(f"{url!r} is not an http://host:port URL")
    if parsed.auth is not None:
        raise ValueError("no user:password in an added engine's URL")
    if (
        parsed.path not in (None, "", "/")
        or parsed.query is not None
        or parsed.fragment is not None
    ):
        raise ValueError("an added engine's URL is scheme://host:port, with no path or query")
    (checked,) = _url_list(f"{parsed.scheme}://{parsed.host}:{parsed.port}")
    return checked


class Membership:
    """Fills the pools from the settings (names resolved), then keeps them current."""

    def __init__(
        self,
        settings: Settings,
        pools: dict[str, dict[str, Pool]],
        environ=os.environ,
        on_tick: Callable[[], None] = lambda: None,
    ) -> None:
        """`pools`: each model's ("" for the one pool of --prefill/--decode) by role;
        `on_tick` runs after each look at the changes file (the engine gauges)."""
        self.models = pools
        self.on_tick = on_tick
        self.slot = int(environ.get(SLOT_ENV, "-1"))
        self.interval = settings.resolve_interval
        self.discovery = Discovery(Resolver(settings.resolve_nameserver), enabled=self.interval > 0)
        for spec in settings.model_specs():
            for role, pool in pools[spec.name].items():
                self.discovery.seed(pool, getattr(spec, role))
        self.allowed = Allowed(
            settings.admin_instance_hosts
            or [urlsplit(url).hostname or "" for url in settings.engine_urls()]
        )
        self.changes = ChangeLog(environ.get(CHANGES_ENV))
        self._lock = threading.Lock()  # one applier at a time: the file's order holds
        self.apply_pending()  # a worker that (re)starts catches up with the rest
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.changes.shared or self.discovery.names:
            self._thread = threading.Thread(
                target=self._run, name="pd-gateway-membership", daemon=True
            )
            self._thread.start()

    # --- the admin endpoint's calls ----------------------------------------------------------

    def add(self, role: object, url: object, model: object = None) -> tuple[dict, bool]:
        """Add an instance in every worker: (its report and which workers have it, new?)."""
        pool, url = self._pool(role, model), self._url(url)
        if not self.allowed(url):
            raise BadRequest(
                f"{public_url(url)} is not on a host --admin-instance-hosts allows",
                param="url",
                status=403,
            )
        if pool.get(url) is not None:
            return self._confirmed(pool, url), False
        self.changes.append({"op": "add", "role": role, "url": url, **self._tag(pool)})
        self.apply_pending()
        return self._confirmed(pool, url), True

    def remove(self, role: object, url: object, model: object = None) -> dict:
        """Remove an instance in every worker; what runs on it finishes there."""
        pool, url = self._pool(role, model), self._known_url(url)
        instance = pool.get(url)
        if instance is None:
            raise NotFound(f"no {role} instance at {public_url(url)}")
        if instance.origin.startswith("dns:"):
            raise BadRequest(
                f"{instance.name} is an address of "
                f"{public_url(instance.origin)[4:]}: it comes and goes with DNS",
                status=409,
            )
        if len(pool.instances) == 1:
            raise BadRequest(f"{instance.name} is the last {role} instance", status=409)
        self.changes.append({"op": "remove", "role": role, "url": url, **self._tag(pool)})
        self.apply_pending()
        return {**self._confirmed(pool, url), "name": instance.name, "inflight": instance.inflight}

    def report(self) -> dict:
        out = {"worker": self.slot, "shared": self.changes.shared}
        if "" in self.models:  # one pool: as before there were models
            return {**out, **{role: pool.report() for role, pool in self.models[""].items()}}
        return {
            **out,
            "models": {
                name: {role: pool.report() for role, pool in pools.items()}
                for name, pools in self.models.items()
            },
        }

    def _pool(self, role: object, model: object) -> Pool:
        if "" in self.models:
            if model is not None:
                raise BadRequest(
                    "this gateway has one pool (--prefill, --decode): name no model", param="model"
                )
            pools = self.models[""]
        elif model is None:
            raise BadRequest(f"model is required: one of {', '.join(self.models)}", param="model")
        elif not isinstance(model, str) or model not in self.models:
            raise NotFound(f"no model {model!r} (one of {', '.join(self.models)})")
        else:
            pools = self.models[model]
        if role not in pools:
            raise BadRequest(f"role must be one of {', '.join(pools)}", param="role")
        return pools[role]

    @staticmethod
    def _tag(pool: Pool) -> dict:
        return {"model": pool.model} if pool.model else {}

    @staticmethod
    def _url(url: object) -> str:
        try:
            return added_url(url)
        except ValueError as exc:
            raise BadRequest(f"url: {exc}", param="url") from exc

    @staticmethod
    def _known_url(url: object) -> str:
        """A URL naming an instance to remove, as the settings may have given it (a path, a
        user:password): it only names what is there."""
        try:
            return added_url(url)  # as an added one was kept
        except ValueError:
            pass
        try:
            if not isinstance(url, str):
                raise ValueError("url must be a string")
            (parsed,) = _url_list(url)
        except ValueError as exc:
            raise BadRequest(f"url: {exc}", param="url") from exc
        return parsed

    def _confirmed(self, pool: Pool, url: str) -> dict:
        """Wait (bounded) until every live worker has applied the file as far as this one."""
        target = self.changes.offset
        pending = self._pending(target)
        deadline = time.monotonic() + CONFIRM_WAIT
        while pending and time.monotonic() < deadline:
            time.sleep(0.05)
            pending = self._pending(target)
        instance = pool.get(url)
        return {
            **self._tag(pool),
            "role": pool.role,
            "url": public_url(url),
            "name": instance.name if instance else None,
            "workers_pending": pending,
        }

    def _pending(self, target: int) -> list[int]:
        if not self.changes.shared or self.slot < 0:
            return []
        return [
            slot
            for slot in range(MAX_SLOTS)
            if LIVE_SLOTS[slot] and slot != self.slot and APPLIED[slot] < target
        ]

    # --- applying ------------------------------------------------------------------------------

    def apply_pending(self) -> None:
        """Apply every change other workers (or this one) logged since the last call."""
        with self._lock:
            for change in self.changes.unread():
                self._apply(change)
            if self.changes.shared and 0 <= self.slot < MAX_SLOTS and not self.changes.retired():
                APPLIED[self.slot] = self.changes.offset

    def _apply(self, change: dict) -> None:
        pool = self.models.get(change.get("model", ""), {}).get(change.get("role", ""))
        if pool is None:
            return
        url = change.get("url", "")
        if change.get("op") == "add":
            if pool.add(url, origin="admin")[1]:
                metrics.INSTANCE_CHANGES.labels(pool.role, "added", "admin").inc()
        elif change.get("op") == "remove":
            # Checked where it was asked; here too, so no worker's pool ever empties.
            if len(pool.instances) > 1 and pool.remove(url) is not None:
                metrics.INSTANCE_CHANGES.labels(pool.role, "removed", "admin").inc()

    def _run(self) -> None:
        next_resolve = time.monotonic() + self.interval
        tick = min(TICK, self.interval) if self.discovery.names else TICK
        while not self._stop.wait(tick):
            try:
                self.apply_pending()
                self.on_tick()
                if self.discovery.names and time.monotonic() >= next_resolve:
                    self.discovery.refresh()
                    next_resolve = time.monotonic() + self.interval
            except Exception:  # a bad line, a full disk: logged, and the loop goes on
                log.exception("updating the instance set failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(TICK + self.discovery.resolver.timeout * 2 + 1)
        self.changes.close()
