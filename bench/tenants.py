"""Tenants under overload, per-key limits shared through Redis, and what the checks cost.

1. Fair admission: a quiet key sends 4 turns a second, a noisy key 10 times as many, through one
   gateway worker whose --max-turns (8) the noisy key alone would fill. The quiet key's
   refusals and TTFT, against the quiet key alone; the noisy key's 429s through the OpenAI SDK
   (max_retries=2) and how long the SDK waited before each retry against the Retry-After it was
   given.
2. Two gateway processes on one Redis, one key at rpm=300: 600 requests to both as fast as they
   go; how many were admitted.
3. Cost of the checks per turn (µs): a key's limits, requests and tokens per minute in memory and
   in Redis, a place taken and given back with several tenants.

    python -m bench.tenants [--seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import requests

from devtools.processes import GatewayProcess, RedisProcess
from emulator.process import EmulatorProcess

MODEL = "emulated-model"


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def stream_turn(url: str, key: str, n: int) -> tuple[int, float | None]:
    """One streamed turn: (status, TTFT s)."""
    started = time.monotonic()
    with requests.post(
        url + "/v1/chat/completions",
        stream=True,
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": MODEL,
            "max_tokens": 16,
            "stream": True,
            "messages": [{"role": "user", "content": f"{key} turn {n}"}],
        },
    ) as response:
        if response.status_code != 200:
            return response.status_code, None
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                ttft = time.monotonic() - started
                for _ in response.iter_lines():
                    pass
                return 200, ttft
    return 200, None


def open_loop(rate: float, seconds: float, work, pool: ThreadPoolExecutor) -> list:
    """Start `work(n)` `rate` times a second for `seconds`, whatever the answers' pace."""
    futures, start = [], time.monotonic()
    for n in range(int(rate * seconds)):
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        futures.append(pool.submit(work, n))
    return [f.result() for f in futures]


class Attempts:
    """The OpenAI SDK's attempts, seen by its HTTP client's hooks: when each came back, how."""

    def __init__(self) -> None:
        self.log: list[tuple[float, int, str]] = []
        self.lock = threading.Lock()

    def on_response(self, response) -> None:
        with self.lock:
            self.log.append(
                (
                    time.monotonic(),
                    response.status_code,
                    response.headers.get("retry-after-ms")
                    or str(float(response.headers.get("retry-after", "0")) * 1000),
                )
            )


@contextmanager
def engines_and_keys(hosts: tuple[str, str], keys_text: str, itl_ms: float):
    """An emulated P and D on `hosts`, and a keys file of `keys_text`: (p, d, its path)."""
    flags = dict(bidirectional_kv_xfer=True, itl_ms=itl_ms)
    with (
        tempfile.NamedTemporaryFile("w") as keys,
        EmulatorProcess("prefill", host=hosts[0], **flags) as p,
        EmulatorProcess("decode", host=hosts[1], **flags) as d,
    ):
        keys.write(keys_text)
        keys.flush()
        yield p, d, keys.name


def fairness(args) -> None:
    with engines_and_keys(("127.0.0.200", "127.0.0.201"), "quiet\nnoisy\n", 20) as (p, d, keys):
        with (
            GatewayProcess([p.url], [d.url], api_keys_file=keys, max_turns=8) as gateway,
            ThreadPoolExecutor(96) as pool,
        ):

            def quiet(n):
                return stream_turn(gateway.url, "quiet", n)

            alone = open_loop(4, args.seconds, quiet, pool)
            attempts = Attempts()
            sdk = openai.OpenAI(
                base_url=gateway.url + "/v1",
                api_key="noisy",
                max_retries=2,
                timeout=60,
                http_client=openai.DefaultHttpxClient(
                    event_hooks={"response": [attempts.on_response]}
                ),
            )

            def noisy(n):
                try:
                    sdk.chat.completions.create(
                        model=MODEL,
                        max_tokens=16,
                        messages=[{"role": "user", "content": f"noisy turn {n}"}],
                    )
                    return 200
                except openai.RateLimitError:
                    return 429

            done = threading.Event()
            noisy_results = []

            def run_noisy():
                noisy_results.extend(open_loop(40, args.seconds, noisy, pool))
                done.set()

            threading.Thread(target=run_noisy).start()
            together = open_loop(4, args.seconds, quiet, pool)
            done.wait()
    for label, rows in (("quiet alone", alone), ("quiet beside noisy", together)):
        ttfts = [t * 1000 for status, t in rows if t is not None]
        print(
            f"{label}: {len(rows)} turns, {sum(s != 200 for s, _ in rows)} refused, TTFT p50 "
            f"{statistics.median(ttfts):.0f} ms, p99 {p99(ttfts):.0f} ms"
        )
    # Gaps the SDK left after a 429 before its next attempt, against the wait it was told.
    with attempts.lock:
        log = sorted(attempts.log)
    refusals = sum(1 for _, status, _ in log if status == 429)
    print(
        f"noisy: {len(noisy_results)} calls (SDK, max_retries=2), "
        f"{sum(r == 200 for r in noisy_results)} answered, {sum(r == 429 for r in noisy_results)} "
        f"refused after its retries; {len(log)} attempts, {refusals} of them 429 "
        f"(Retry-After {sorted({v for _, s, v in log if s == 429})} ms)"
    )


def sdk_retry_gaps(args) -> None:
    """One call of the SDK at a time for the noisy key, so each 429's retry is its own."""
    with engines_and_keys(("127.0.0.202", "127.0.0.203"), "limited rpm=2\n", 1) as (p, d, keys):
        with GatewayProcess([p.url], [d.url], api_keys_file=keys) as gateway:
            hooks = {"request": [], "response": []}
            sent: list[float] = []
            told: list[float] = []
            hooks["request"].append(lambda request: sent.append(time.monotonic()))
            hooks["response"].append(
                lambda response: (
                    told.append(float(response.headers.get("retry-after-ms", 0)))
                    if response.status_code == 429
                    else None
                )
            )
            sdk = openai.OpenAI(
                base_url=gateway.url + "/v1",
                api_key="limited",
                max_retries=1,
                timeout=120,
                http_client=openai.DefaultHttpxClient(event_hooks=hooks),
            )
            for n in range(3):  # the third waits out the window, then is answered
                sdk.chat.completions.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": f"turn {n}"}]
                )
    gap = (sent[-1] - sent[-2]) * 1000
    print(
        f"rpm=2, third call: 429 with retry-after-ms {told[0]:.0f}; the SDK's retry went "
        f"{gap:.0f} ms later and was answered"
    )


def shared(args) -> None:
    redis = RedisProcess("127.0.0.1")
    key = f"shared-{time.time_ns()}"
    try:
        with engines_and_keys(("127.0.0.204", "127.0.0.205"), f"{key} rpm=300\n", 1) as (
            p,
            d,
            keys,
        ):
            with (
                GatewayProcess([p.url], [d.url], api_keys_file=keys, store=redis.url) as a,
                GatewayProcess([p.url], [d.url], api_keys_file=keys, store=redis.url) as b,
                ThreadPoolExecutor(8) as pool,
            ):

                def one(n):
                    url = (a, b)[n % 2].url
                    return requests.post(
                        url + "/v1/chat/completions",
                        timeout=30,
                        headers={"Authorization": f"Bearer {key}"},
                        json={
                            "model": MODEL,
                            "max_tokens": 2,
                            "messages": [{"role": "user", "content": f"s {n}"}],
                        },
                    ).status_code

                started = time.monotonic()
                codes = list(pool.map(one, range(600)))
                took = time.monotonic() - started
    finally:
        redis.stop()
    print(
        f"two gateways, one Redis, rpm=300: 600 requests in {took:.1f} s, "
        f"{codes.count(200)} admitted, {codes.count(429)} refused"
    )


def cost(args) -> None:
    from gateway.front.admission import Admission
    from gateway.front.auth import ApiKeys
    from gateway.front.tenants import KeyLimits, Tenants

    def per_call(fn, n=5000) -> float:
        started = time.perf_counter()
        for i in range(n):
            fn(i)
        return (time.perf_counter() - started) / n * 1e6

    keys = ApiKeys([f"k{i}" for i in range(10)], defaults=KeyLimits(rpm=10**9, tpm=10**12))
    admission = Admission(limit=64, queue=32, wait=0.01, retry_after=1)
    rows = [
        ("a key's tenant and limits", per_call(lambda i: keys.tenant("Bearer k3"))),
        (
            "a place taken and given back, 8 tenants",
            per_call(lambda i: admission.enter(f"t{i % 8}")()),
        ),
    ]
    redis = RedisProcess("127.0.0.1")
    try:
        for label, store in (("memory", "local"), ("Redis on loopback", redis.url)):
            tenants = Tenants(store, 0.5)
            limits = KeyLimits(rpm=10**9, tpm=10**12)
            rows.append(
                (
                    f"requests and tokens per minute, {label}",
                    per_call(
                        lambda i, tenants=tenants, limits=limits: tenants.admit(
                            f"t{i % 8}", limits, 4000
                        ),
                        2000,
                    ),
                )
            )
            rows.append(
                (
                    f"requests per minute only, {label}",
                    per_call(
                        lambda i, tenants=tenants: tenants.admit(
                            f"t{i % 8}", KeyLimits(rpm=10**9), 4000
                        ),
                        2000,
                    ),
                )
            )
    finally:
        redis.stop()
    for label, us in rows:
        print(f"| {label} | {us:.1f} µs |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--part", choices=("all", "fairness", "sdk", "shared", "cost"), default="all"
    )
    args = parser.parse_args(argv)
    for name, part in (
        ("fairness", fairness),
        ("sdk", sdk_retry_gaps),
        ("shared", shared),
        ("cost", cost),
    ):
        if args.part in ("all", name):
            part(args)


if __name__ == "__main__":
    main()
