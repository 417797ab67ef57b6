"""The KV port: a tiny HTTP protocol standing in for NIXL reads, both the serving side and the reader.

``POST /kv/pull``    {"remote_engine_id", "remote_request_id", "remote_block_ids", "first_block", "num_tokens"}
                     -> 200 {"engine_id", "request_id", "tokens": [...], "num_blocks"}; the lease is freed.
``POST /kv/release`` {"remote_engine_id", "remote_request_id"} -> 200; frees without reading (a declined read).
404: unknown, already handed over, or expired (a stale pull). 409: wrong engine or wrong block ids
(nothing is freed). 400: malformed body.
"""

from __future__ import annotations

import json
import logging
from typing import Callable, Iterable

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
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in flat):
        raise ValueError("remote_block_ids must hold integers")
    return tuple(flat)


def _reply(start_response: Callable, status: str, payload: dict) -> Iterable[bytes]:
    body = json.dumps(payload, separators=(",", ":")).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
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
            block_ids = flat_block_ids(body["remote_block_ids"]) if "remote_block_ids" in body else None
            first_block = int(body.get("first_block", 0))
            num_tokens = None if body.get("num_tokens") is None else int(body["num_tokens"])
            if first_block < 0 or not isinstance(request_id, str):
                raise ValueError("bad first_block or remote_request_id")
        except (ValueError, KeyError, TypeError) as exc:
            return _reply(start_response, "400 Bad Request", {"error": f"malformed KV request: {exc}"})
        if wanted_engine != engine_id:
            # A reader that reached the wrong engine (e.g. remote_host not rewritten) must not free
            # blocks that belong to someone else's request.
            return _reply(start_response, "409 Conflict",
                          {"error": f"engine {engine_id} is not {wanted_engine}"})
        try:
            lease = leases.take(request_id, block_ids)
        except LeaseGone:
            return _reply(start_response, "404 Not Found",
                          {"error": f"blocks of {request_id} were already read, released or expired"})
        except LeaseMismatch as exc:
            return _reply(start_response, "409 Conflict", {"error": str(exc)})
        if path == "/kv/release":
            return _reply(start_response, "200 OK", {"released": len(lease.block_ids)})
        end = len(lease.tokens) if num_tokens is None else max(0, min(num_tokens, len(lease.tokens)))
        tokens = list(lease.tokens[first_block * bs:end])
        return _reply(start_response, "200 OK", {
            "engine_id": engine_id, "request_id": request_id, "tokens": tokens,
            "cache_salt": lease.salt, "num_blocks": max(0, -(-end // bs) - first_block)})

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


def pull(session: requests.Session, params: dict, first_block: int,
         num_tokens: int) -> tuple[list[str], str | None]:
    """Read tokens [first_block * block_size, num_tokens) of the lease named by kv_transfer_params,
    and the cache_salt they were computed under."""
    body = {"remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"],
            "remote_block_ids": params["remote_block_ids"],
            "first_block": first_block, "num_tokens": num_tokens}
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
        tokens, salt = reply["tokens"], reply.get("cache_salt")
    except (ValueError, KeyError, TypeError) as exc:
        raise PullError(f"pull from {url} got a malformed reply") from exc
    return tokens, salt


def release(session: requests.Session, params: dict) -> None:
    """Tell the owner to free blocks we decided not to read; best effort, as vLLM's notification is."""
    body = {"remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"]}
    try:
        session.post(_url(params, "/kv/release"), json=body, timeout=PULL_TIMEOUT).close()
    except requests.RequestException as exc:
        log.debug("release of %s failed: %s", params["remote_request_id"], exc)
