"""`ConversationStore`: where each conversation's latest decode KV params wait for the next turn,
in one of three backends (each worker's memory, one Redis primary, a Redis Cluster); the store
the settings name (`create_store`)."""

from __future__ import annotations

from gateway import redis_url
from gateway.redis_url import CLUSTER_SCHEMES, SENTINEL_SCHEMES, redis_client
from gateway.reuse.store.base import (
    Budget,
    ConversationStore,
    Entry,
    decode,
    encode,
    fixed,
    pinned_blocks,
    stamped,
)
from gateway.reuse.store.local import LocalStore, Pinned
from gateway.reuse.store.redis_cluster import RedisClusterStore
from gateway.reuse.store.redis_primary import RedisStore

# Every name gateway/reuse/store.py had before it became this package.
__all__ = [
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "Budget",
    "ConversationStore",
    "Entry",
    "LocalStore",
    "Pinned",
    "RedisClusterStore",
    "RedisStore",
    "create_store",
    "decode",
    "encode",
    "fixed",
    "pinned_blocks",
    "redis_client",
    "stamped",
]


def create_store(settings) -> ConversationStore:
    """The store the settings name; each D's pinned budget is set on it by its owner
    (`store.budget`, gateway.engines.d_budget)."""
    if settings.store == "local":
        return LocalStore(settings.store_size, settings.store_ttl)
    cluster = redis_url.parse(settings.store).kind == "cluster"
    return (RedisClusterStore if cluster else RedisStore)(
        settings.store, settings.store_ttl, settings.store_timeout
    )
