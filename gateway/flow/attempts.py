"""One engine call tried on the instances of a pool until one answers (`attempt`), and what a
request's engines have done for it so far (`Work`), for its key's limits."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

from gateway.engines.cost import Need
from gateway.engines.instances import Instance, Pool
from gateway.support import metrics
from gateway.support.errors import GatewayError, ServiceUnavailable, UpstreamRejected

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Work:
    """What the engines have done for a turn so far, for its key's limits: a turn an engine
    worked for (P prefilled it, or D answered it) is charged, whatever happens after; one
    no engine worked for is given back."""

    done: bool = False
    prompt_tokens: int | None = None  # as P reported them


class Answered(NamedTuple, Generic[T]):
    """The instance that answered, and what `call` returned there."""

    instance: Instance
    result: T


def attempt(
    pool: Pool,
    key: str,
    call: Callable[[Instance, GatewayError | None], T],
    attempts: int,
    prefer: str | None = None,
    hold: bool = False,
    only: Instance | None = None,
    work: Work | None = None,
    need: Need | None = None,
    exclude: Collection[Instance] = (),
) -> Answered[T]:
    """`call(instance, last failure)` on instances of `pool` until one answers, `attempts` at
    most (`key`, `prefer` and `need`, a P's estimate of the turn, choose them: `Pool.choose`;
    after a failure, `need.retried()`: a retried P reads none of D's blocks). Never one of
    `exclude` (unless nothing else is left: `Pool.choose`).

    Only failures before the client got a byte come here, so retrying is safe; a 4xx is the
    request's fault and is not retried. With `hold`, the instance stays counted in flight
    (the caller releases it when the stream ends). With `only`, that instance, once.
    `work` hears of an engine that got the request and may have computed for it before it
    failed, or before its client left (all but a connection never made and a 4xx refusal).
    """
    tried: list[Instance] = []
    failure = None
    while True:
        asked = need if need is None or failure is None else need.retried()
        instance = only or pool.choose(key, prefer=prefer, exclude=[*exclude, *tried], need=asked)
        # A P's queued work, for the next turns' choice (held, the stream is D's: none).
        queued = pool.work(instance, key, asked) if asked is not None and not hold else 0
        pool.acquire(instance, queued)
        try:
            result = call(instance, failure)
        except GatewayError as exc:
            pool.release(instance, queued)
            if work is not None and not isinstance(exc, (ServiceUnavailable, UpstreamRejected)):
                work.done = True
            if not exc.instance_fault:
                raise
            pool.failed(instance, unreachable=isinstance(exc, ServiceUnavailable))
            tried.append(instance)
            if only or len(tried) >= min(attempts, pool.reach):
                raise
            log.info("retrying %s after: %s", pool.role, exc.message)
            metrics.RETRIES.labels(pool.role).inc()
            failure = exc
            continue
        except BaseException:
            pool.release(instance, queued)  # a bug, or the worker stopping: never a leaked count
            raise
        pool.succeeded(instance)
        if not hold:
            pool.release(instance, queued)
        return Answered(instance, result)
