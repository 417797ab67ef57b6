"""vLLM 0.33's V1 scheduler as the emulator runs it: which requests compute how many tokens in
each engine step, and how long a step takes.

vLLM's engine core runs one step after another; each step's batch is fixed when it starts
(`Scheduler.schedule()`, v1/core/sched/scheduler.py ~L699) and its tokens come out when it ends.
This class replays that loop lazily, without a thread of its own: whoever looks at it
(`advance(now)`) first runs every step that has ended by now, each one's batch chosen from the
state at its start, so a request that arrives during a step joins the next one as on vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class Seq:
    """One request in the scheduler: prompt tokens to compute, then tokens to sample."""

    prompt: int  # prompt tokens to compute here (neither cached nor loaded), at least 1
    output: int  # tokens to sample; the first comes with the step that ends the prompt
    computed: int = 0
    generated: int = 0
    removed: bool = False

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt

    @property
    def finished(self) -> bool:
        return self.generated >= max(self.output, 1)


class Scheduler:
    """The waiting queue, the running batch and the step in progress of one engine.

    step_s(prefill_tokens, decode_tokens) is a step's duration in seconds; on_step, if given, is
    told each step's (prefill_tokens, decode_tokens, duration) when it starts.
    """

    def __init__(
        self,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        step_s: Callable[[int, int], float],
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        on_step: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.step_s = step_s
        self.on_step = on_step
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.step_end: float | None = None  # when the step in progress ends; None: idle
        self._batch: list[tuple[Seq, int]] = []

    def add(self, seq: Seq, now: float) -> None:
        """A request ready to compute joins the back of the waiting queue."""
        self.advance(now)
        self.waiting.append(seq)
        if self.step_end is None:
            self._start(now)

    def remove(self, seq: Seq, now: float) -> None:
        """The request ended early (aborted): it leaves the queue or the batch; its share of the
        step in progress is wasted, as vLLM's is."""
        self.advance(now)
        if seq.removed:
            return
        seq.removed = True
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)

    def advance(self, now: float) -> None:
        """Run every step that has ended by `now`, starting each next one where the last ended."""
        while self.step_end is not None and self.step_end <= now:
            end = self.step_end
            self._finish()
            self._start(end)

    def until(self, done: Callable[[], bool], now: float) -> float:
        """Seconds to wait before `done()` can next change (0: it holds now)."""
        self.advance(now)
        if done():
            return 0.0
        if self.step_end is None:
            raise RuntimeError("waiting on a request the scheduler does not hold")
        return self.step_end - now

    def _start(self, at: float) -> None:
        self._batch = self._schedule()
        if not self._batch:
            self.step_end = None
            return
        prefill = sum(n for seq, n in self._batch if seq.prefilling)
        decode = len(self._batch) - sum(1 for seq, _ in self._batch if seq.prefilling)
        duration = self.step_s(prefill, decode)
        if self.on_step is not None:
            self.on_step(prefill, decode, duration)
        self.step_end = at + duration

    def _schedule(self) -> list[tuple[Seq, int]]:
        """One step's batch, as vLLM's schedule() picks it: running requests first, in the order
        they were admitted, one token for a decode and the rest of the prompt (up to the budget)
        for a prefill (scheduler.py ~L795-1002); then waiting ones, first come first served,
        while the budget lasts and fewer than max_num_seqs run (~L1062-1075, ~L1295-1346,
        ~L1549-1570)."""
        budget = self.max_num_batched_tokens
        # The cap applies only when another request could use the budget (~L754-763).
        threshold = (
            self.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0
        )
        batch: list[tuple[Seq, int]] = []
        for seq in self.running:
            if budget <= 0:
                break  # later running requests, decodes too, sit this step out (~L795)
            n = seq.prompt - seq.computed if seq.prefilling else 1
            n = min(threshold if 0 < threshold < n else n, budget)
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.prompt - seq.computed
            if 0 < threshold < n:
                n = threshold
            if not self.chunked and n > budget:
                break  # without chunked prefill a prompt goes whole or waits (~L1337-1344)
            self.waiting.popleft()
            self.running.append(seq)
            batch.append((seq, min(n, budget)))
            budget -= min(n, budget)
        return batch

    def _finish(self) -> None:
        """The step's tokens are out: prompts advance, a finished prompt samples its first
        token (a partial one's sample is discarded: v1/worker/gpu_model_runner.py ~L2060-2065),
        decodes their next; finished requests leave the batch (scheduler.py ~L2543-2544)."""
        done = False
        for seq, n in self._batch:
            if seq.removed:
                continue
            if seq.prefilling:
                seq.computed += n
                if not seq.prefilling:
                    seq.generated = 1
            else:
                seq.generated += 1
            done = done or seq.finished
        if done:
            self.running = [seq for seq in self.running if not seq.finished]
        self._batch = []
