"""Synthetic conversation-store entries, shaped like real ones: the benchmark's cached-conversations
runs fill a worker's store with them, and the store tests size them."""

from __future__ import annotations

import secrets
import time
import uuid
from hashlib import blake2b

from gateway.reuse.store import ConversationStore, Entry

FILL_ENV = "BENCH_FILL_ENTRIES"  # read by bench.gunicorn_fill in the worker (bench.growth sets it)
HISTORY_TOKENS = 1100  # about what a 5-turn conversation of devtools.workload leaves in D
BLOCK_SIZE = 16


def synthetic_entry(i: int, decode_url: str) -> tuple[str, Entry]:
    """A store key and an entry with D's params as the emulator sends them after one turn.

    Strings and block ids are fresh objects per entry, as JSON parsing makes them in a real store;
    the params are what the gateway keeps of D's (`kv_params.clean_params`); the ids run, as the
    emulator's and a vLLM free list's do (gateway.reuse.packing).
    """
    blocks = -(-HISTORY_TOKENS // BLOCK_SIZE)
    params = {
        "remote_block_ids": [list(range(i * blocks + 1000, (i + 1) * blocks + 1000))],
        "remote_engine_id": str(uuid.uuid4()),
        "remote_request_id": f"chatcmpl-{uuid.uuid4().hex}-{secrets.token_hex(4)}",
        "remote_host": "127.0.0.3",
        "remote_port": 40000 + i % 20000,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": HISTORY_TOKENS,
        "remote_blocks_expiry_time": time.monotonic() + 480,
        "transfer_mode": "pull",
    }
    key = blake2b(f"bench-fill-{i}".encode(), digest_size=16).hexdigest()
    digest = blake2b(f"bench-history-{i}".encode(), digest_size=16).hexdigest()
    return key, Entry(params=params, decode_url=decode_url, history_digest=digest, history_len=10)


def fill(store: ConversationStore, count: int, decode_url: str) -> None:
    for i in range(count):
        store.put(*synthetic_entry(i, decode_url))
