"""Partial reuse: when the new prompt shares only the first K tokens of what D holds, P reads
those K and computes the rest.

Templates that drop earlier reasoning (Qwen3, QwQ, DeepSeek-R1), move the system prompt into the
last user message (Mistral), put an empty think block in the generation prompt only, or
re-render tool calls leave D holding `prompt_N + reply` while turn N+1's prompt shares only a
prefix of it. vLLM 0.33.0 lets P read just that prefix (`nixl/`, under
vllm/distributed/kv_transfer/kv_connector/v1/):

- P pulls `min(remote_num_tokens, prompt) - its own hit` tokens (`nixl/pull_scheduler.py`
  ~L85-103), and its worker pairs its new blocks with the *last* entries of each remote group
  (`nixl/base_worker.py` ~L3786-3793, the suffix trim; a shorter group is an assert there). So
  the cut is both: `remote_num_tokens = K` and each group cut to its first K / block_size
  entries. `remote_num_tokens` alone maps D's last blocks onto P's first positions (vLLM issue
  #43094).
- Only for full-attention (or MLA) models: a sliding-window or chunked-local group holds only D's
  last window, a Mamba group D's last state (`nixl/base_scheduler.py` ~L141-154, ~L270-292).
  The gateway cuts only entries with one group whose list is position-exact: one id per block of
  `remote_num_tokens` (`v1/core/kv_cache_manager.py` ~L740-758) and no null block (id 0: what
  vLLM puts where a sliding window freed a block, `nixl/pull_scheduler.py` ~L281-284).

To find K without keeping D's tokens, an entry keeps 8-byte digests of D's token ids at a few
block boundaries ("checkpoints"): every block for the last `DENSE` blocks of turn N's prompt
(where reasoning, think blocks and tool calls begin), then at doubling distances before it and
after it. Each digest is of the whole prefix up to its boundary, so the shared checkpoints are
the leading ones and the largest one the new prompt's ids also give is K. A checkpoint set costs
8 bytes a digest, ~45 digests for a 10,000-token history (docs/exactness.md, "Partial reuse").
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

# Blocks before the end of turn N's prompt that each get a checkpoint: the divergence of every
# template behaviour above lies there, or at the start of the last user message before it.
DENSE = 16
DIGEST = 8  # bytes kept per checkpoint
_HEAD = struct.Struct("<IH")  # turn N's prompt length, the block size
NULL_BLOCK = 0  # vLLM's null block (v1/core/block_pool.py)


def checkpoints(prompt_len: int, held: int, block_size: int) -> list[int]:
    """The block boundaries (in blocks, ascending) an entry keeps digests at: each of the last
    DENSE blocks of the prompt, then every doubling distance before and after, up to `held`."""
    end, last = prompt_len // block_size, held // block_size
    points = set(range(max(1, end - DENSE + 1), min(end, last) + 1))
    point, step = end - DENSE, 1
    while point >= 1:
        points.add(point)
        point, step = point - step, step * 2
    point, step = end + 1, 1
    while point <= last:
        points.add(point)
        point, step = point + step, step * 2
    if last >= 1:
        points.add(last)
    return sorted(p for p in points if p <= last)


def ids_bytes(ids: Sequence[int]) -> bytes | None:
    try:
        return array("q", ids).tobytes()
    except (OverflowError, TypeError):
        return None


def held_digests(
    prompt_ids: list | None, output_ids: list | None, held: object, block_size: int
) -> tuple[str | None, bytes | None]:
    """The digest of the tokens D holds (prompt + output - 1, `remote_num_tokens`) and the
    checkpoint digests for partial reuse, in one pass; (None, None) unless D's ids are complete.

    vLLM before PR #29074 left out the ids of tokens a reasoning or tool parser swallowed while
    streaming, so the count must be exactly held + 1, or a gap would shift everything after it.
    The full digest is blake2b-128 of the ids as int64, which token_digest computes too."""
    if (
        not isinstance(prompt_ids, list)
        or not isinstance(output_ids, list)
        or not isinstance(held, int)
    ):
        return None, None
    if len(prompt_ids) + len(output_ids) != held + 1:
        return None, None
    data = ids_bytes((prompt_ids + output_ids)[:held])
    if data is None:
        return None, None
    running = hashlib.blake2b(digest_size=16)
    kept = [_HEAD.pack(len(prompt_ids), block_size)] if block_size else []
    at = 0
    for point in checkpoints(len(prompt_ids), held, block_size) if block_size else ():
        end = point * block_size * 8
        running.update(data[at:end])
        at = end
        kept.append(running.copy().digest()[:DIGEST])
    running.update(data[at:])
    return running.hexdigest(), (b"".join(kept) if block_size else None)


def shared_tokens(
    prefixes: bytes, held: int, tokens: Sequence[int] | bytes, block_size: int
) -> int:
    """K: the most tokens, a whole number of blocks, that `tokens` (the new prompt's ids, or
    their int64 bytes) shares with what D holds, by the entry's checkpoints; fewer than the
    prompt (P computes at least its last token); 0 if none or the checkpoints do not fit."""
    try:
        prompt_len, size = _HEAD.unpack_from(prefixes)
    except struct.error:
        return 0
    if size != block_size:
        return 0
    data = tokens if isinstance(tokens, bytes) else ids_bytes(tokens)
    if data is None:
        return 0
    count = len(data) // 8
    points = checkpoints(prompt_len, held, block_size)
    if len(prefixes) != _HEAD.size + DIGEST * len(points):
        return 0
    running = hashlib.blake2b(digest_size=16)
    at, shared = 0, 0
    for i, point in enumerate(points):
        if point * block_size >= count:
            break
        end = point * block_size * 8
        running.update(data[at:end])
        at = end
        start = _HEAD.size + DIGEST * i
        if running.copy().digest()[:DIGEST] != prefixes[start : start + DIGEST]:
            break  # digests of prefixes: once one differs, every later one does
        shared = point * block_size
    return shared


def cut(params: dict, tokens: int, block_size: int) -> dict | None:
    """D's params for reading only its first `tokens` (a whole number of blocks), or None where
    that read would not be position-exact: more than one KV group, a list that is not one id per
    block of what D holds (another block size, a clipped window), or a null block in the cut."""
    groups, held = params.get("remote_block_ids"), params.get("remote_num_tokens")
    if (
        not isinstance(groups, list)
        or len(groups) != 1
        or not isinstance(held, int)
        or tokens <= 0
        or tokens % block_size
        or tokens >= held
    ):
        return None
    group = groups[0]
    if len(group) != -(-held // block_size):
        return None
    kept = group[: tokens // block_size]
    if NULL_BLOCK in kept:
        return None
    return {**params, "remote_num_tokens": tokens, "remote_block_ids": [kept]}
