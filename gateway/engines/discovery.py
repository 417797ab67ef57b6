"""Instance URLs whose host is a DNS name, resolved into one instance per address.

A Kubernetes headless Service answers its name with one A (or AAAA) record per ready pod, so
`http://decode.ns.svc:8200` stands for every D pod: each address becomes an instance
(`http://10.1.2.3:8200`, its `host` the address P is told to pull from), re-resolved every
`--resolve-interval` seconds. IP literals and `localhost` are used exactly as given, as are
https URLs (connecting to an address would fail the certificate's name check).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from urllib.parse import urlsplit, urlunsplit

from gateway.config import split_nameserver
from gateway.engines.instances import Pool, public_url
from gateway.support import metrics

log = logging.getLogger(__name__)


class ResolveError(Exception):
    """The lookup failed (no answer, a server failure, a timeout): keep what was known."""


def resolvable(url: str) -> bool:
    """Does `url` name its host by a DNS name that resolution expands into addresses?"""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "http" or host == "localhost":
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return True
    return False


def with_address(url: str, address: str) -> str:
    """`url` with its host replaced by `address` (IPv6 in brackets), port and path kept."""
    parts = urlsplit(url)
    host = f"[{address}]" if ":" in address else address
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))


def _preferred(addresses: set[str]) -> list[str]:
    """IPv4 addresses if there are any, else IPv6: a dual-stack pod has one of each, and two
    instances for one engine would split its load and its KV."""
    parsed = sorted(ipaddress.ip_address(a) for a in addresses)
    v4 = [a for a in parsed if a.version == 4]
    return [str(a) for a in (v4 or parsed)]


class Resolver:
    """The addresses of a host name: the system resolver (getaddrinfo: /etc/hosts, the search
    domains of resolv.conf, what a connection by name would reach), or, with `nameserver`
    ("address" or "address:port"), that DNS server asked directly (dnspython, made for the job:
    getaddrinfo cannot be pointed at a server). Under gevent both are cooperative (gevent patches
    getaddrinfo and the sockets dnspython uses)."""

    def __init__(self, nameserver: str = "", timeout: float = 2.0) -> None:
        self.timeout = timeout
        self._dns = None
        if nameserver:
            import dns.resolver

            address, port = split_nameserver(nameserver)
            self._dns = dns.resolver.Resolver(configure=False)
            self._dns.nameservers = [address]
            self._dns.port = port
            self._dns.lifetime = timeout

    def addresses(self, host: str, port: int) -> list[str]:
        """Every address of `host` (IPv4 preferred), possibly none; raises ResolveError."""
        if self._dns is not None:
            return self._ask_server(host)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
                return []
            raise ResolveError(f"{host}: {exc}") from exc
        except OSError as exc:
            raise ResolveError(f"{host}: {exc}") from exc
        return _preferred({str(info[4][0]).split("%")[0] for info in infos})

    def _ask_server(self, host: str) -> list[str]:
        import dns.exception
        import dns.resolver

        resolver = self._dns
        assert resolver is not None  # asked only with a server (`addresses`)
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = resolver.resolve(host, rdtype, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:
                raise ResolveError(f"{host} {rdtype}: {exc!r}") from exc
            found.update(record.address for record in answer)
            if found:  # A records found: no AAAA query
                break
        return _preferred(found)


class Discovery:
    """Keeps the instances each DNS name of the settings stands for, in their pools.

    `seed` at start puts every settings URL in its pool: a name as the addresses it resolves
    to, or, if that lookup fails or finds none, as the name itself (connections resolve it, as
    before). `refresh` re-resolves: addresses that appeared are added, those gone are removed
    (the streams on them finish). A failed lookup, or an empty answer, keeps the last known set
    (logged when it starts failing, counted each time): an answer that empties a role is more
    likely a DNS fault than a deployment, and instances that really went are marked down by
    the failures on them and probed.
    """

    def __init__(self, resolver: Resolver, enabled: bool = True) -> None:
        self.resolver = resolver
        self.enabled = enabled
        self.names: list[tuple[Pool, str]] = []  # (pool, settings URL with a DNS name)
        self._failing: set[str] = set()

    def seed(self, pool: Pool, urls: list[str]) -> None:
        for url in urls:
            if not (self.enabled and resolvable(url)):
                pool.add(url)
                continue
            self.names.append((pool, url))
            if not self._resolve(pool, url):
                pool.add(url, origin=f"dns:{url}")  # replaced by its addresses once known

    def refresh(self) -> None:
        for pool, url in self.names:
            self._resolve(pool, url)

    def _resolve(self, pool: Pool, url: str) -> bool:
        parts = urlsplit(url)
        try:
            addresses = self.resolver.addresses(parts.hostname or "", parts.port or 80)
            if not addresses:
                raise ResolveError(f"{parts.hostname}: no address")
        except ResolveError as exc:
            metrics.RESOLUTIONS.labels("failed").inc()
            (log.debug if url in self._failing else log.warning)(
                "resolving %s failed (%s); its %s instances stay as they are",
                public_url(url),
                exc,
                pool.role,
            )
            self._failing.add(url)
            return False
        metrics.RESOLUTIONS.labels("ok").inc()
        if url in self._failing:
            self._failing.discard(url)
            log.info("resolving %s works again", public_url(url))
        added, removed = pool.sync(f"dns:{url}", [with_address(url, a) for a in addresses])
        for kind, instances in (("added", added), ("removed", removed)):
            if instances:
                metrics.INSTANCE_CHANGES.labels(pool.role, kind, "dns").inc(len(instances))
        return True
