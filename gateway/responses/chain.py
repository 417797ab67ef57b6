"""Stored responses (`store`): each response the gateway made, with the chat messages it was
rendered from, kept for `previous_response_id`, GET, cancel and DELETE, in the conversation
store's backend (each worker's memory, or Redis), under a key of the tenant and the id, for
`--responses-ttl`.

vLLM keeps them in one engine's memory, never removed (serving.py L182-191): behind a P/D
gateway no engine saw the whole turn, so the gateway keeps the chain itself.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

from cachetools import TTLCache

from gateway import redis_url
from gateway.support import jsonio, metrics
from gateway.support.errors import GatewayError, NotFound

log = logging.getLogger(__name__)


def not_found(response_id: str) -> NotFound:
    """vLLM's answer for an id it does not hold (serving.py L1206-1212), as OpenAI's 404."""
    error = NotFound(f"Response with id '{response_id}' not found.", param="response_id")
    error.type = "invalid_request_error"
    return error


def _key(tenant: bytes, response_id: str) -> bytes:
    """A tenant's response under a key no other tenant can name."""
    return hashlib.sha256(tenant + b"\0" + response_id.encode()).digest()[:16]


def _fits(packed: bytes, largest: int, response_id: str) -> bool:
    """A record no larger than a request body may be (`--max-body-bytes`): expanding a
    previous_response_id then costs a turn no more than a body sent whole would."""
    if len(packed) <= largest:
        return True
    log.warning("response %s not stored: %d bytes, over --max-body-bytes", response_id, len(packed))
    return False


class LocalChain:
    """Stored responses in this worker's memory, packed: least recently used out first beyond
    `maxsize` bytes, each gone `ttl` seconds after it was stored, none over `largest`."""

    def __init__(
        self,
        maxsize: int,
        ttl: float,
        largest: int = 1 << 62,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache: TTLCache = TTLCache(maxsize=maxsize, ttl=ttl, timer=timer, getsizeof=len)
        self._lock = threading.Lock()  # the cache reorders itself on reads
        self.largest = largest

    def get(self, tenant: bytes, response_id: str) -> dict | None:
        with self._lock:
            packed = self._cache.get(_key(tenant, response_id))
        return None if packed is None else jsonio.loads_engine(packed)

    def put(self, tenant: bytes, response_id: str, record: dict) -> None:
        packed = jsonio.dumps(record)
        if not _fits(packed, self.largest, response_id):
            return
        with self._lock:
            try:
                self._cache[_key(tenant, response_id)] = packed
            except ValueError:  # larger than the whole budget: not kept
                log.warning("response %s not stored: %d bytes", response_id, len(packed))

    def delete(self, tenant: bytes, response_id: str) -> bool:
        with self._lock:
            return self._cache.pop(_key(tenant, response_id), None) is not None


class RedisChain:
    """Stored responses in Redis (SET with PX, GET, DEL), shared by every worker and host. A
    store that fails makes a GET a 503 (the response may exist), and a response unstored
    (logged and counted; its reply still goes out)."""

    PREFIX = b"pd-gateway:response:"

    def __init__(self, client, ttl: float, largest: int = 1 << 62) -> None:
        self.largest = largest
        self._errors = redis_url.failures()
        self._redis = client
        self._ttl_ms = int(ttl * 1000)

    def _call(self, operation: str, call):
        try:
            return call()
        except self._errors as exc:
            log.warning("Redis store %s of a response failed: %r", operation, exc)
            metrics.STORE_ERRORS.labels("responses").inc()
            raise GatewayError("The response store is unavailable", status=503) from exc

    def get(self, tenant: bytes, response_id: str) -> dict | None:
        packed = self._call("get", lambda: self._redis.get(self.PREFIX + _key(tenant, response_id)))
        return None if packed is None else jsonio.loads_engine(packed)

    def put(self, tenant: bytes, response_id: str, record: dict) -> None:
        packed = jsonio.dumps(record)
        if not _fits(packed, self.largest, response_id):
            return
        self._call(
            "put",
            lambda: self._redis.set(
                self.PREFIX + _key(tenant, response_id), packed, px=self._ttl_ms
            ),
        )

    def delete(self, tenant: bytes, response_id: str) -> bool:
        return bool(
            self._call(
                "delete", lambda: self._redis.delete(self.PREFIX + _key(tenant, response_id))
            )
        )


Chain = LocalChain | RedisChain


def create_chain(settings) -> Chain:
    """In the settings' store (`--store`), for `--responses-ttl`."""
    if settings.store == "local":
        return LocalChain(settings.responses_bytes, settings.responses_ttl, settings.max_body_bytes)
    return RedisChain(
        redis_url.redis_client(settings.store, settings.store_timeout)[0],
        settings.responses_ttl,
        settings.max_body_bytes,
    )
