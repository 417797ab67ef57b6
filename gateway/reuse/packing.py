"""A conversation entry in as few bytes as it takes: every worker keeps up to `--store-size`
of them (100,000 by default), and Redis keeps them for every gateway host.

An entry is mostly D's block ids (one per 16 tokens of history) and a few strings. vLLM hands
out blocks from a free list, so a request's ids come in runs, rising or falling by one: they are
kept as runs (7 bytes each) or, when they do not run, as 4 bytes an id, not as JSON numbers. The
other params are written as values in a fixed order (their names are known: the allowlist of
`kv_params`), deflated; the digests as their 16 bytes. Measured for the benchmark's
1,100-token entries: 157 bytes, against 804 as JSON (a worker with 100,000 of them: 100.6 MB
before the deflating, see docs/BENCHMARKS.md for after).
"""

from __future__ import annotations

import struct
import zlib
from array import array
from itertools import pairwise
from typing import Any

from gateway.support import jsonio

BLOCKS = "remote_block_ids"
# The order values are written in, stored entries (Redis) read by position: append only, any
# other change needs a new _VERSION. A name not here goes in a trailing object.
FIELDS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_port",
    "remote_host",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_control_host",
    "remote_control_port",
)
# Allowlisted names added since (remote_registration_generation) go in the trailing object, which
# every version-1 reader already takes: appending them here would break hosts not yet upgraded.
_ABSENT = False  # no allowlisted value is a boolean: `false` means "not in the params"
_VERSION = 1
# Version 2 adds the partial-reuse checkpoints (gateway.reuse.partial) after the token digest; an
# entry without them is still written as version 1, which hosts before version 2 read.
_VERSION_PREFIXES = 2
_HEAD = struct.Struct("<BBId")  # version, flags, history length, expiry
_RUN = struct.Struct("<IHb")  # first id, length, step (+1 or -1)
_PLAIN, _EXPIRES, _HISTORY_BYTES, _TOKENS_BYTES, _HAS_BLOCKS, _PREFIXES = 1, 2, 4, 8, 16, 32
_HEX = frozenset("0123456789abcdef")
# The values are deflated (zlib, raw, a 512-byte window) against a preset dictionary of what
# they hold: ids in hex, URLs, vLLM's request-id prefix, so that even a short entry shrinks
# (docs/BENCHMARKS.md, "The figures behind smaller choices"). Changing it needs a new _VERSION.
_ZDICT = b'0123456789abcdef-0123456789abcdef"http://127.0.0.1:","chatcmpl-,null,false,"pull"]'


def _deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, -9, 1, zdict=_ZDICT)
    return packer.compress(data) + packer.flush()


def _inflate(data: bytes) -> bytes:
    unpacker = zlib.decompressobj(-9, zdict=_ZDICT)
    return unpacker.decompress(data) + unpacker.flush()


def digest_bytes(value: str | None) -> bytes | None:
    """The 16 bytes of a digest in hex (what the gateway makes), else None (kept as text)."""
    if value and len(value) == 32 and _HEX.issuperset(value):
        return bytes.fromhex(value)
    return None


def pack(
    params: dict,
    decode_url: str,
    history_digest: str,
    history_len: int,
    plain: bool,
    token_digest: str | None,
    expires_at: float | None,
    prefixes: bytes | None = None,
) -> bytes:
    history_bytes, tokens_bytes = digest_bytes(history_digest), digest_bytes(token_digest)
    prefixes = prefixes if prefixes and len(prefixes) < 65536 else None
    flags = (
        (_PLAIN if plain else 0)
        | (_EXPIRES if expires_at is not None else 0)
        | (_HISTORY_BYTES if history_bytes else 0)
        | (_TOKENS_BYTES if tokens_bytes else 0)
        | (_HAS_BLOCKS if BLOCKS in params else 0)
        | (_PREFIXES if prefixes else 0)
    )
    groups = params.get(BLOCKS) or []
    values = [
        decode_url,
        None if history_bytes else history_digest,
        None if tokens_bytes else token_digest,
        *(params.get(name, _ABSENT) for name in FIELDS),
    ]
    extra = {k: v for k, v in params.items() if k != BLOCKS and k not in FIELDS}
    if extra:
        values.append(extra)
    version = _VERSION_PREFIXES if prefixes else _VERSION
    parts = [
        _HEAD.pack(version, flags, history_len, expires_at or 0.0),
        history_bytes or b"",
        tokens_bytes or b"",
        struct.pack("<H", len(prefixes)) + prefixes if prefixes else b"",
        struct.pack("<H", len(groups)),
        *(_pack_group(g) for g in groups),
        _deflate(jsonio.dumps(values)),
    ]
    return b"".join(parts)  # one exact-size object (orjson's own output keeps spare room)


def expiry(packed: bytes) -> float:
    """The expiry `pack` stored, read from the header alone (0.0 if none)."""
    return _HEAD.unpack_from(packed)[3]


def unpack(packed: bytes) -> dict[str, Any]:
    """The fields `pack` took, by the names of the entry's fields (store.Entry); ValueError if
    `packed` is not one of its outputs."""
    try:
        version, flags, history_len, expires = _HEAD.unpack_from(packed)
        if version not in (_VERSION, _VERSION_PREFIXES):
            raise ValueError(f"entry version {version}")
        at = _HEAD.size
        history_digest = token_digest = None
        if flags & _HISTORY_BYTES:
            history_digest, at = packed[at : at + 16].hex(), at + 16
        if flags & _TOKENS_BYTES:
            token_digest, at = packed[at : at + 16].hex(), at + 16
        prefixes = None
        if flags & _PREFIXES and version == _VERSION_PREFIXES:
            (size,) = struct.unpack_from("<H", packed, at)
            prefixes, at = packed[at + 2 : at + 2 + size], at + 2 + size
            if len(prefixes) != size:
                raise IndexError("checkpoints cut short")
        (count,) = struct.unpack_from("<H", packed, at)
        at += 2
        groups = []
        for _ in range(count):
            group, at = _unpack_group(packed, at)
            groups.append(group)
        decode_url, history_text, tokens_text, *values = jsonio.loads(_inflate(packed[at:]))
        params: dict[str, Any] = {BLOCKS: groups} if flags & _HAS_BLOCKS else {}
        params.update(
            (name, value)
            for name, value in zip(FIELDS, values, strict=False)
            if value is not _ABSENT
        )
        if len(values) > len(FIELDS):
            params.update(values[-1])
    except (struct.error, IndexError, TypeError, zlib.error, ValueError) as exc:
        raise ValueError("not a conversation entry") from exc
    history_digest = history_digest or history_text
    if not isinstance(decode_url, str) or not isinstance(history_digest, str):
        raise ValueError("not a conversation entry")
    return {
        "params": params,
        "decode_url": decode_url,
        "history_digest": history_digest,
        "history_len": history_len,
        "plain": bool(flags & _PLAIN),
        "token_digest": token_digest or tokens_text,
        "expires_at": expires if flags & _EXPIRES else None,
        "prefixes": prefixes,
    }


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    first, last, n = ids[0], ids[-1], len(ids)
    if n < 65536 and abs(last - first) == n - 1 and n > 1:  # one run, checked in C
        step = 1 if last > first else -1
        if ids == list(range(first, last + step, step)):
            return [(first, n, step)]
    runs: list[tuple[int, int, int]] = []
    start, length, step = ids[0], 1, 0
    for previous, current in pairwise(ids):
        difference = current - previous
        if length < 65535 and difference in (1, -1) and (step == 0 or difference == step):
            length, step = length + 1, difference
        else:
            runs.append((start, length, step or 1))
            start, length, step = current, 1, 0
    runs.append((start, length, step or 1))
    return runs


def _pack_group(ids: list[int]) -> bytes:
    if not ids:
        return b"\x00\x00\x00\x00\x00"
    runs = _runs(ids)
    low, high = min(ids), max(ids)
    if high >= 1 << 63 or low < -(1 << 63):
        raise ValueError("a block id beyond 64 bits")  # kv_params.clean_params bars them
    wide = high >= 1 << 32 or low < 0
    if not wide and len(runs) * _RUN.size < len(ids) * 4:
        return b"\x01" + struct.pack("<I", len(runs)) + b"".join(_RUN.pack(*r) for r in runs)
    if wide:
        return b"\x02" + struct.pack("<I", len(ids)) + array("q", ids).tobytes()
    return b"\x00" + struct.pack("<I", len(ids)) + array("I", ids).tobytes()


def _unpack_group(packed: bytes, at: int) -> tuple[list[int], int]:
    mode, count = packed[at], struct.unpack_from("<I", packed, at + 1)[0]
    at += 5
    if mode in (0, 2):
        ids = array("I" if mode == 0 else "q")
        size = ids.itemsize * count
        ids.frombytes(packed[at : at + size])
        if len(ids) != count:
            raise IndexError("block ids cut short")
        return ids.tolist(), at + size
    ids_out: list[int] = []
    for start, length, step in _RUN.iter_unpack(packed[at : at + _RUN.size * count]):
        ids_out.extend(range(start, start + step * length, step))
    return ids_out, at + _RUN.size * count
