"""Releasing the blocks a D keeps for a conversation when no P will read them.

After every turn D keeps the conversation's blocks for the next turn's P, until that P reads them
or `decoder_kv_blocks_ttl` passes (480 s by default). An entry the gateway drops unread (the
exactness check refused it, a decode-only turn used D's own cache instead, it was evicted,
replaced, expired or over its D's pinned budget) would leave them pinned all that time.

vLLM frees them when a P request carries the entry's params and reads nothing: with
`remote_num_tokens` 0, P's connector counts nothing to load (`min(0, prompt) - hit <= 0`,
whatever `kv_recompute_threshold` is), still queues a receive with no blocks, and its worker
sends D the read notification, on which D frees the whole request (vLLM 0.33.0,
`nixl/pull_scheduler.py` ~L85-106 and ~L130-177, `nixl/pull_worker.py` ~L452-476 and ~L670-700).
That P request computes a one-token prompt, generates one token and keeps its one block for
`kv_lease_duration` (30 s): the price of a release on P.

Releases run in the background, one at a time, at most `rate` a second per worker; a failed
release is counted and the blocks are freed at D's TTL as before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable

from gateway.engines.instances import Pool
from gateway.engines.upstream import Upstream
from gateway.reuse.store import Entry, pinned_blocks
from gateway.support import metrics
from gateway.support.errors import GatewayError

log = logging.getLogger(__name__)

PATH = "/v1/completions"
# One token of any tokenizer, so P computes next to nothing and never fills a block whose hash
# could be found by a real prompt; no `model`: vLLM serves its own (serving.py
# `_is_model_supported`).
PROMPT = "."
BACKLOG = 10_000  # releases waiting; beyond, a new one is skipped (D's TTL frees it)
READ_TIMEOUT = 10.0  # a release is a one-token prefill: a P slower than this is in trouble
SWEEP_SECONDS = 1.0  # how often the store is asked for entries expired or over budget


def release_body(params: dict) -> dict:
    """A P request that reads nothing of `params`'s blocks and so makes D free them."""
    return {
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {
            **params,
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_num_tokens": 0,
        },
    }


class Releaser:
    """Sends the release of each dropped entry to a P, in the background, bounded in rate."""

    def __init__(
        self,
        upstream: Upstream,
        prefill_for: Callable[[Entry], Pool | None],
        rate: float,
        sweep: Callable[[], None] = lambda: None,
        backlog: int = BACKLOG,
    ) -> None:
        self.upstream = upstream
        self.prefill_for = prefill_for  # the P pool of the entry's model (None: no D there)
        self.rate = rate
        self.sweep = sweep  # the store's expiry and budgets, once a second
        self._jobs: queue.Queue[tuple[Entry, str] | None] = queue.Queue(backlog)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # The blocks the queued releases of each D's entries still hold there: a D's budget
        # counts them as released already (gateway.engines.d_budget).
        self._pending: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def drop(self, entry: Entry, reason: str) -> None:
        """`entry` will not be read: release its blocks soon. Never blocks, never raises."""
        if not self.enabled or not entry.params:
            return
        self._count(entry, 1)
        try:
            self._jobs.put_nowait((entry, reason))
        except queue.Full:
            self._count(entry, -1)
            metrics.RELEASES.labels(reason, "skipped").inc()
            return
        self.start()

    def pending(self, decode_url: str) -> int:
        """Blocks on that D whose releases are queued, not yet sent."""
        return self._pending.get(decode_url, 0)

    def _count(self, entry: Entry, sign: int) -> None:
        with self._lock:
            left = self._pending.get(entry.decode_url, 0) + sign * pinned_blocks(entry)
            if left > 0:
                self._pending[entry.decode_url] = left
            else:
                self._pending.pop(entry.decode_url, None)

    def start(self) -> None:
        """The background loop (a greenlet under gevent), once per process, after fork."""
        if self._thread is None and self.enabled:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="pd-gateway-release", daemon=True
                    )
                    self._thread.start()

    def stop(self, timeout: float = READ_TIMEOUT + 1) -> None:
        """End the loop, waiting for a release in flight (none outlives its gateway)."""
        self._stop.set()
        try:
            self._jobs.put_nowait(None)  # wakes the loop now, not at its next timeout
        except queue.Full:
            pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        pause = 1.0 / self.rate
        swept = time.monotonic()
        while not self._stop.is_set():
            # The store's sweep (expiry, each D's budget) once a second, releases or none.
            if time.monotonic() - swept >= SWEEP_SECONDS:
                self._sweep()
                swept = time.monotonic()
            try:
                job = self._jobs.get(timeout=SWEEP_SECONDS)
            except queue.Empty:
                continue
            if job is None:  # stop() woke it
                continue
            entry, reason = job
            started = time.monotonic()
            try:
                self.release(entry, reason)
            finally:
                self._count(entry, -1)
            self._stop.wait(max(0.0, pause - (time.monotonic() - started)))

    def _sweep(self) -> None:
        try:
            self.sweep()
        except Exception:  # a store's bug must not end the loop
            log.exception("sweeping expired entries failed")

    def release(self, entry: Entry, reason: str) -> bool:
        """Ask a P to notify `entry`'s D, now; True if P answered. Any P of the entry's model
        will do: a random key spreads the releases over them (each keeps a block of its own for
        30 s), skipping those down or overloaded."""
        request_id = f"release-{uuid.uuid4().hex}"
        prefill = self.prefill_for(entry)
        if prefill is None:  # its D left every model's pool: no P of its model is known
            metrics.RELEASES.labels(reason, "skipped").inc()
            return False
        try:
            instance = prefill.choose(request_id)
            prefill.acquire(instance)
            try:
                headers = self.upstream.headers(request_id, None)
                self.upstream.post_json(
                    instance, PATH, release_body(entry.params), headers, read_timeout=READ_TIMEOUT
                )
            finally:
                prefill.release(instance)
        except GatewayError as exc:
            log.info("release of a %s entry failed: %s", reason, exc.message)
            metrics.RELEASES.labels(reason, "failed").inc()
            return False
        except Exception:  # a bug must not end the loop: counted, logged
            log.exception("release of a %s entry failed", reason)
            metrics.RELEASES.labels(reason, "failed").inc()
            return False
        metrics.RELEASES.labels(reason, "released").inc()
        return True
