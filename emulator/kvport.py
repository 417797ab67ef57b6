"""The KV port: a tiny HTTP protocol standing in for NIXL reads, both the serving side and the
reader.

``POST /kv/pull``    {"remote_engine_id", "remote_request_id", "block_ids": [ids to read, in order]}
                     -> 200 {"engine_id", "request_id", "blocks": [[tokens of each]], "tokens":
                     [...all of them], "cache_salt", "num_blocks"};
                     then the reader's notification frees the lease (a NIXL READ carries it).
``POST /kv/release`` {"remote_engine_id", "remote_request_id"} -> 200; the notification alone, as
                     vLLM's notify-only receive sends it (nothing to read, or a declined read).
404: unknown, already read and notified, or expired (a stale pull). 409: wrong engine or a block
id the lease does not hold (nothing is freed). 400: malformed body. A lease the owner does not
track (vLLM's leak, kvstore.py) is read but never freed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

import requests
from requests.adapters import HTTPAdapter

from .kvstore import LeaseGone, LeaseMismatch, LeaseStore

log = logging.getLogger(__name__)

PULL_TIMEOUT = (2.0, 30.0)  # (connect, read) seconds; a local pull answers in milliseconds


def flat_block_ids(remote_block_ids: object) -> tuple[int, ...]:
    """vLLM sends one list per KV-cache group ([[1, 2]]); very old versions sent a flat list."""
    if not isinstance(remote_block_ids, list):
        raise ValueError("remote_block_ids must be a list")
    flat: list[object] = []
    for item in remote_block_ids:
        flat.extend(item if isinstance(item, list) else [item])
    ids = [i for i in flat if isinstance(i, int) and not isinstance(i, bool)]
    if len(ids) != len(flat):
        raise ValueError("remote_block_ids must hold integers")
    return tuple(ids)


def _reply(start_response: Callable, status: str, payload: dict) -> Iterable[bytes]:
    body = json.dumps(payload, separators=(",", ":")).encode()
    start_response(
        status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    )
    return [body]


def create_kv_app(engine_id: str, leases: LeaseStore) -> Callable:
    """WSGI app serving this engine's leases to readers; each lease is handed over once."""
    bs = leases.block_size

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") != "POST" or path not in ("/kv/pull", "/kv/release"):
            return _reply(start_response, "404 Not Found", {"error": f"no endpoint {path}"})
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = json.loads(environ["wsgi.input"].read(length) or b"null")
            request_id = body["remote_request_id"]
            wanted_engine = body["remote_engine_id"]
            block_ids = flat_block_ids(body["block_ids"]) if path == "/kv/pull" else ()
            if not isinstance(request_id, str):
                raise ValueError("bad remote_request_id")
        except (ValueError, KeyError, TypeError) as exc:
            return _reply(
                start_response, "400 Bad Request", {"error": f"malformed KV request: {exc}"}
            )
        if wanted_engine != engine_id:
            # A reader that reached the wrong engine (e.g. remote_host not rewritten) must not free
            # blocks that belong to someone else's request.
            return _reply(
                start_response,
                "409 Conflict",
                {"error": f"engine {engine_id} is not {wanted_engine}"},
            )
        try:
            lease = leases.get(request_id)
            blocks = lease.read_blocks(list(block_ids), bs)
        except LeaseGone:
            return _reply(
                start_response,
                "404 Not Found",
                {"error": f"blocks of {request_id} were already read, released or expired"},
            )
        except LeaseMismatch as exc:
            return _reply(start_response, "409 Conflict", {"error": str(exc)})
        freed = leases.notify(request_id)
        if path == "/kv/release":
            return _reply(
                start_response, "200 OK", {"released": 0 if freed is None else len(freed.blocks)}
            )
        return _reply(
            start_response,
            "200 OK",
            {
                "engine_id": engine_id,
                "request_id": request_id,
                "blocks": blocks,
                "tokens": [t for block in blocks for t in block],
                "cache_salt": lease.salt,
                "num_blocks": len(block_ids),
            },
        )

    return app


class PullError(Exception):
    """A pull that brought no blocks; `stale` when the owner said they are gone (404)."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


def make_session(pool_size: int = 1024) -> requests.Session:
    """One pooled session per engine: hundreds of concurrent pulls go to one or two peers."""
    session = requests.Session()
    adapter = HTTPAdapter(pool_connections=16, pool_maxsize=pool_size)
    session.mount("http://", adapter)
    return session


def _url(params: dict, path: str) -> str:
    host = str(params["remote_host"])
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"http://{host}:{int(params['remote_port'])}{path}"


def pull(
    session: requests.Session, params: dict, block_ids: list[int]
) -> tuple[list[list[str]], str | None]:
    """Read the given blocks of the lease named by kv_transfer_params (then the owner frees it):
    the tokens each holds, in order, and the cache_salt they were computed under."""
    body = {
        "remote_engine_id": params["remote_engine_id"],
        "remote_request_id": params["remote_request_id"],
        "block_ids": block_ids,
    }
    url = _url(params, "/kv/pull")
    try:
        response = session.post(url, json=body, timeout=PULL_TIMEOUT)
    except requests.RequestException as exc:
        raise PullError(f"pull from {url} failed: {exc}") from exc
    if response.status_code == 404:
        raise PullError(f"stale pull from {url}: {response.text}", stale=True)
    if response.status_code != 200:
        raise PullError(f"pull from {url} got {response.status_code}: {response.text}")
    try:
        reply = response.json()
        blocks, salt = reply["blocks"], reply.get("cache_salt")
    except (ValueError, KeyError, TypeError) as exc:
        raise PullError(f"pull from {url} got a malformed reply") from exc
    return blocks, salt


def release(session: requests.Session, params: dict) -> None:
    """Tell the owner to free blocks we decided not to read; best effort, as vLLM's notification
    is."""
    body = {
        "remote_engine_id": params["remote_engine_id"],
        "remote_request_id": params["remote_request_id"],
    }
    try:
        session.post(_url(params, "/kv/release"), json=body, timeout=PULL_TIMEOUT).close()
    except requests.RequestException as exc:
        log.debug("release of %s failed: %s", params["remote_request_id"], exc)
