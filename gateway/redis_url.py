"""The `--store` Redis URL, read in one place (its kind: one primary, a Cluster, a Sentinel set),
the client it names, and `Lazy`: a client made on first use, tried again a second after it
failed. The conversation store, the Responses chain, the key limits and the settings'
validation all read the URL here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlsplit

PRIMARY_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SCHEMES = PRIMARY_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES


@dataclass(frozen=True)
class RedisURL:
    """A store URL split: its scheme, what follows `://`, and the kind of Redis it names."""

    scheme: str
    rest: str

    @property
    def kind(self) -> str:
        """ "primary" (one primary), "cluster" or "sentinel"."""
        return self.scheme.partition("+")[2] or "primary"

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")

    def __str__(self) -> str:
        return f"{self.scheme}://{self.rest}"


def parse(url: str) -> RedisURL:
    """The URL split; ValueError naming the schemes if it is not a Redis URL."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"{url!r} is not a Redis URL ({', '.join(s + ':' for s in SCHEMES)})")
    return RedisURL(scheme, rest)


def _nodes(netloc: str, default_port: int) -> list[tuple[str, int]]:
    """host:port,host:port ([v6]:port) from a URL's host part, credentials removed."""
    hosts = netloc.rpartition("@")[2]
    nodes = []
    for item in filter(None, hosts.split(",")):
        if item.startswith("["):
            host, _, port = item[1:].partition("]")
            port = port.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        nodes.append((host, int(port) if port else default_port))
    if not nodes:
        raise ValueError("a Redis URL with no host")
    return nodes


def failures() -> tuple[type[Exception], ...]:
    """What a Redis call raises when Redis fails: a cluster unreachable when its client is made
    raises RedisClusterException, which is not a RedisError."""
    import redis

    return redis.RedisError, redis.exceptions.RedisClusterException


def redis_client(url: str, timeout: float):
    """(client, cluster?) for a store URL: `redis://` / `rediss://` / `unix://` (one primary),
    `redis+cluster://host:port,host:port` (Redis or Valkey Cluster: any nodes as seeds), or
    `redis+sentinel://host:port,host:port/primary-name[/db]` (Sentinel; the client asks the
    sentinels for the primary again after a failover). `rediss+…` is TLS to Redis (to the
    primary only, with Sentinel), `user:password@` an ACL user. Every call gives up after
    `timeout` and is never retried: a slow store makes misses, not waits, and a script the
    server may have run already (its reply lost) is never run twice (a put run again would
    report its own entry as replaced, and its blocks would be released)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    retry = Retry(NoBackoff(), 0)
    common: dict[str, Any] = dict(
        socket_timeout=timeout, socket_connect_timeout=timeout, retry=retry
    )
    parsed = parse(url)
    if parsed.kind == "primary":
        return redis.Redis.from_url(url, **common), False
    parts = urlsplit(url)
    auth: dict[str, Any] = dict(
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )
    if parsed.kind == "cluster":
        from redis.cluster import ClusterNode

        nodes = [ClusterNode(host, port) for host, port in _nodes(parts.netloc, 6379)]
        return LazyCluster(dict(startup_nodes=nodes, ssl=parsed.tls, **auth, **common)), True
    from redis.sentinel import Sentinel

    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ValueError("redis+sentinel:// needs the primary's name: .../mymaster[/db]")
    sentinels = Sentinel(
        _nodes(parts.netloc, 26379),
        sentinel_kwargs=dict(socket_timeout=timeout, socket_connect_timeout=timeout),
        **common,
    )
    db = int(path[1]) if len(path) > 1 else 0
    return sentinels.master_for(path[0], db=db, ssl=parsed.tls, **auth, **common), False


T = TypeVar("T")


class Lazy(Generic[T]):
    """A client made on first use, and made again after a failed try: made at once, a client
    that connects (a cluster's asks its seeds) would stop a worker that starts while its Redis
    is down. One caller makes it (each seed up to the timeout); the others wait for it up to
    `wait` seconds. For RETRY_SECONDS after a failure (its making failed, or its owner said a
    call failed: `failed()`), every `get` raises `unavailable` at once: a Redis down costs a
    turn at most one timeout."""

    RETRY_SECONDS = 1.0

    def __init__(
        self,
        make: Callable[[], T],
        wait: float,
        unavailable: Callable[[str], Exception] = ConnectionError,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make = make
        self._wait = wait
        self._unavailable = unavailable
        self._clock = clock
        self._made: T | None = None
        self._lock = threading.Lock()
        self._failed_at = -float("inf")

    def get(self) -> T:
        if self._clock() - self._failed_at < self.RETRY_SECONDS:
            raise self._unavailable("the Redis client failed a moment ago")
        made = self._made
        if made is not None:
            return made
        if not self._lock.acquire(timeout=self._wait):
            raise self._unavailable("the Redis client is not made yet")
        try:
            if self._made is None:
                self._made = self._make()
            return self._made
        except BaseException:
            self.failed()
            raise
        finally:
            self._lock.release()

    def failed(self) -> None:
        """A call on the client failed: every `get` fails at once for RETRY_SECONDS."""
        self._failed_at = self._clock()


class LazyCluster:
    """A RedisCluster client that stands in for one until it is made (`Lazy`): scripts
    register on it before any connection."""

    def __init__(self, kwargs: dict) -> None:
        from redis.cluster import RedisCluster
        from redis.exceptions import RedisClusterException

        self.kwargs = kwargs
        self._lazy: Lazy = Lazy(
            lambda: RedisCluster(**kwargs),
            kwargs.get("socket_timeout") or 1.0,
            RedisClusterException,
        )

    def get_encoder(self):
        """What a script needs before any connection (redis-py's default encoding)."""
        from redis.connection import Encoder

        return Encoder("utf-8", "strict", False)

    def __getattr__(self, name: str):
        return getattr(self._lazy.get(), name)
