"""What a client gets (`Reply`) and the relay of D's stream to it (`StreamRelay`), with the
cleanup that releases what a reply holds exactly once, however it ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from gateway.engines.instances import Instance, Pool
from gateway.engines.upstream import Stream
from gateway.flow.decoded import Decoded
from gateway.flow.sse import EventFilter
from gateway.support import metrics
from gateway.support.errors import BadGateway, ClientGone, GatewayError, error_event

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


@dataclass
class Reply:
    """What the client gets: a JSON body, or a stream of bytes; plus the status and response
    headers. `close` releases what the reply holds (the engine stream, its place, the
    watcher): call it once the reply has ended, or was dropped unsent; calling again is a no-op."""

    headers: dict
    body: dict | bytes | None = None  # bytes: an engine's body as it came (`content_type`)
    stream: Iterator[bytes] | None = None
    content_type: str = "application/json"
    status: int = 200
    close: Callable[[], None] = _nothing
    decoded: Decoded | None = None  # what D produced, once the reply has ended (None: relayed)


def relayed(
    stream: Stream, sse: bool, failed: Callable[[GatewayError], None] = lambda exc: None
) -> Iterator[bytes]:
    """An engine's (or an owner worker's) bytes as they arrive. Once bytes are out the status
    can't change: a failure after them ends an event stream (`sse`) with an error event, other
    bodies just end; `failed` hears of it. The stream is closed however it ends."""
    try:
        yield from stream.chunks()
    except GatewayError as exc:
        failed(exc)
        if sse:
            yield error_event(exc)
    finally:
        stream.close()


class StreamRelay:
    """One stream's way to its client: D's bytes out (params taken out), the entry put before
    [DONE], and `finish`, which runs once however the stream ends: completed, failed, the
    client gone, or the reply closed before its first byte."""

    def __init__(
        self,
        stream: Stream,
        decoded: Decoded,
        decode: Instance,
        pool: Pool,
        started: float,
        model: str,
        remember: Callable[[], None],
        log_turn: Callable[[float | None, str], None],
    ) -> None:
        self.stream, self.decoded, self.decode, self.pool = stream, decoded, decode, pool
        self.started = started
        self.model = model  # the metrics' label
        self.remember = remember  # puts the next turn's entry
        self.log_turn = log_turn  # the access-log line, with TTFT and outcome
        self.ttft: float | None = None
        self.outcome = "client_gone"  # until the relay ends otherwise
        self._finished = False
        # The gaps between chunks sent, counted here and observed once at the end.
        self._gaps = metrics.bucket_counts(metrics.ITL_BUCKETS)
        self._gaps_total = 0.0

    def chunks(self) -> Generator[bytes, None, None]:
        decoded, decode = self.decoded, self.decode
        relay = EventFilter(decoded)
        gaps, bounds = self._gaps, metrics.ITL_BUCKETS
        sent = 0.0  # when the last chunk went out
        done_at = None  # when [DONE] went out: the turn's end, as its client sees it
        try:
            for chunk in self.stream.chunks():
                out = relay.feed(chunk)
                if decoded.done and not decoded.stored:
                    # Store before the client sees [DONE]: its next turn may come at once.
                    decoded.stored = True
                    self.remember()
                if out:
                    now = time.perf_counter()
                    if self.ttft is None:
                        self.ttft = now - self.started
                        metrics.FIRST_BYTE_SECONDS.labels(self.model).observe(self.ttft)
                    else:
                        metrics.count_into(gaps, bounds, now - sent)
                        self._gaps_total += now - sent
                    sent = now
                    if decoded.done and done_at is None:
                        done_at = now
                    yield out
            if not decoded.done:
                raise BadGateway(f"{decode.name} ended the stream before it was complete")
            self.outcome = "completed"
            self._ended(done_at)
        except ClientGone:
            if decoded.done:
                # [DONE] went out: the client had the whole reply and left before D's stream
                # ended (the OpenAI SDK closes its response at [DONE], and the watch then cuts
                # D's connection while the relay waits for D's last bytes). A completed turn.
                self.outcome = "completed"
                self._ended(done_at)
            else:
                metrics.DISCONNECTS.inc()  # noticed by the watcher: nobody to tell
        except GatewayError as exc:
            self.outcome = f"error_{exc.status}"
            # Bytes are out, so the status can't change: finish with an error event instead.
            if exc.instance_fault:
                self.pool.failed(decode, unreachable=False)
            metrics.ERRORS.labels("stream", str(exc.status), self.model).inc()
            yield error_event(exc)
        except GeneratorExit:
            if decoded.done:
                # Closed after [DONE] went out: its reader had the whole reply (an edge that
                # converts the stream to another API stops reading there). A completed turn.
                self.outcome = "completed"
                self._ended(done_at)
            else:
                metrics.DISCONNECTS.inc()
            raise
        finally:
            self.finish()

    def _ended(self, done_at: float | None) -> None:
        end = done_at if done_at is not None else time.perf_counter()
        metrics.E2E_SECONDS.labels(self.model).observe(end - self.started)

    def finish(self) -> None:
        """Close D's stream, release D's count, log the turn; once, and never raising (it runs
        inside a generator's close, where an error would stop the rest of the cleanup)."""
        if self._finished:
            return
        self._finished = True
        try:
            self.stream.close()
        except Exception:
            log.exception("closing %s's stream failed", self.decode.name)
        self.pool.release(self.decode)
        try:
            if any(self._gaps):
                metrics.INTER_TOKEN_SECONDS.labels(self.model).observe_many(
                    self._gaps, self._gaps_total
                )
            self.log_turn(self.ttft, self.outcome)
        except Exception:
            log.exception("logging the turn failed")
