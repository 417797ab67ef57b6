"""Where reading D's blocks pays: pd-gateway beside vllm-router (cache_aware, its default, and
round robin) and the seed proxy, over engines with vLLM's defaults (docs/BENCHMARKS.md, first
section).

Every system gets fresh engines, 2 P and 2 D emulated with vLLM 0.33's defaults: prefix caching
on, kv_recompute_threshold 64, decoder_kv_blocks_ttl 480 s, a KV cache of a stated size. What
differs is what each system's users run: the gateway and the seed need bidirectional KV transfer
(`bidirectional_kv_xfer`, the README's `vllm serve` command), vllm-router runs standard P/D (D
keeps nothing after a turn). The axes that decide the answer:

- reply length: 32, 256, 1,024 tokens;
- how many conversations are live and how long each thinks between turns (0, or 2 s while 64
  conversations take turns: vLLM evicts by use, not by time, so a think time turns P's cache
  over only through the other conversations' turns meanwhile);
- P's KV cache against the live conversations' histories: room for twice them (`fits`), or a
  quarter of them (`4x over`);
- the workload's shape: every conversation alike, or skewed, a few long-context conversations
  (histories growing to some 10,000 tokens) beside many short ones, all at once, where a router
  that pins a conversation to one P can pile the long ones onto the same P.

Per row: prompt tokens computed (P + D, and the turns whose P read D's blocks), TTFT p50/p99
(all turns; turns 2+, what vLLM's multi-turn benchmark measures after its --warmup-step has
sent every conversation's first turn at once, as scenarios 0-2 start them (the skewed one spreads
its short conversations' starts over a think time); and the short conversations' of a skewed
workload: the victims), inter-token
latency p50/p99, D's pinned blocks at their peak (kept for a next turn), D's wait for KV memory,
errors. TTFT and ITL are the client's, the same for every system: TTFT from sending the request
to the first content event, ITL the gaps between a stream's content events (bench.loadgen).
After the table, a line per scenario and reply length checks issue 44's goal (printed, never
asserted): the gateway's TTFT p99 at most 0.7x vllm-router cache_aware's where the gateway
computes at least 2x fewer prompt tokens, and never above round_robin's; on every turn, and on
turns 2+. With `--repeats N` every system runs N times per row, the systems taking turns, and a
row is the median of its runs (one run's p99 of a few hundred turns moves by tens of percent).

    python -m bench.reuse [--quick] [--systems gateway,vllm-router] [--replies 32,256]
                          [--scenarios 1,3] [--seed 0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from bench import venvs
from bench.metrics import percentile
from bench.systems import _spawn, slug, stop_process
from devtools.processes import GatewayProcess
from devtools.workload import FIRST_WORDS, TURN_WORDS, Conversation, benchmark_conversation
from emulator.process import EmulatorProcess, free_port

HOSTS = ("127.0.0.80", "127.0.0.81", "127.0.0.82", "127.0.0.83")  # P, P, D, D
PROXY_HOST = "127.0.0.1"
# Engine timings of an 8B model on one 80 GB GPU, so TTFT and ITL mean what they mean there: a
# 10 ms decode step (the emulator's default), 0.05 ms a computed prompt token (20,000 tokens a
# second: a 1,000-token miss costs 50 ms), 0.05 ms a pulled block; steps under vLLM's scheduler
# limits (the emulator's defaults). A 2 ms step, as before issue 44, measured the proxies' CPU
# per relayed event more than the engines' queues.
ENGINE = {
    "itl_ms": 10,
    "prefill_ms_per_token": 0.05,
    "pull_ms_per_block": 0.05,
    "max_model_len": 16384,
}
D_CAPACITY = 20_000  # blocks of 16 per D: the emulator's default (an 8B model, 80 GB)
TURNS = 6
BLOCK = 16


@dataclass(frozen=True)
class System:
    label: str
    kind: str  # gateway | router | seed
    bidirectional: bool
    ids: bool = False
    argv: tuple = ()
    settings: tuple = ()  # the gateway's, as (name, value) pairs


SYSTEMS = {
    "gateway": System("pd-gateway", "gateway", True),
    # The fixed budget every D had before it was derived from D's reports (docs/d-memory.md).
    "gateway-static": System(
        "pd-gateway (--pinned-blocks 8192)", "gateway", True, settings=(("pinned_blocks", 8192),)
    ),
    # A later turn kept on its own P: a pull priced so high that it leaves only for a queue 1,000
    # times its history (docs/routing.md). First turns, turns without an entry and D still go by
    # cost: not quite the gateway before costs.
    "gateway-affinity": System(
        "pd-gateway (affinity only)", "gateway", True, settings=(("route_pull_cost", 1000.0),)
    ),
    # Ds take prefills where that costs less than every P (docs/routing.md): the start burst.
    "gateway-pod": System(
        "pd-gateway (--prefill-on-decode)", "gateway", True, settings=(("prefill_on_decode", True),)
    ),
    "vllm-router": System("vllm-router (cache_aware)", "router", False),
    "vllm-router-rr": System(
        "vllm-router (round_robin)", "router", False, argv=("--policy", "round_robin")
    ),
    "seed": System("seed proxy (ids)", "seed", True, ids=True),
}


@dataclass(frozen=True)
class Scenario:
    label: str
    live: int  # conversations in flight at once
    think: float  # seconds between a reply and the next question
    p_cache: float  # P's cache as a share of the live conversations' histories
    long: int = 0  # of the live ones, long-context conversations (a skewed workload)


SCENARIOS = (
    Scenario("16 live, no think, P cache fits", 16, 0.0, 2.0),
    Scenario("64 live, think 2 s, P cache fits", 64, 2.0, 2.0),
    Scenario("64 live, think 2 s, P cache 4x over", 64, 2.0, 0.25),
    # Three long ones over two Ps: any router that pins conversations to a P puts two
    # of them on the same P.
    Scenario("skewed: 3 long + 32 short, think 1 s, P cache fits", 35, 1.0, 2.0, long=3),
)
REPLIES = (32, 256, 1024)
# What `make bench` runs; gateway-static on ask (docs/d-memory.md compares the two budgets).
DEFAULT_SYSTEMS = ("gateway", "vllm-router", "vllm-router-rr", "seed")
# The skewed workload at 256-token replies, where reading D's blocks pays (the goal's first
# part applies): four runs, about two minutes.
QUICK_SCENARIOS = (3,)
QUICK_REPLIES = (256,)

# The skewed workload in words (= emulator tokens). A long conversation's first message is sized
# so that its last prompt is about LONG_PROMPT tokens whatever the reply length; a short one
# starts at 150 + i words and adds 30-60 a turn (a few hundred tokens at 32-token replies).
LONG_PROMPT = 10_000
LONG_TURN_WORDS = (600, 800)
SHORT_FIRST_WORDS = 150
SHORT_TURN_WORDS = (30, 60)
DURATION = 300  # seconds after which no turn starts (a request may take 120 more)


def _last_prompt(first: int, turn_words: tuple[int, int], reply: int) -> int:
    """Tokens of a conversation's longest prompt (its last turn), template tokens included."""
    return first + 64 + (TURNS - 1) * (max(turn_words) + 16) + (TURNS - 1) * (reply + 4)


def history_blocks(reply: int) -> int:
    """Blocks of a uniform conversation's longest prompt (its last turn)."""
    return math.ceil(_last_prompt(FIRST_WORDS, TURN_WORDS, reply) / BLOCK)


def long_first_words(reply: int) -> int:
    """A long conversation's first message: what leaves its last prompt near LONG_PROMPT."""
    later = (TURNS - 1) * (sum(LONG_TURN_WORDS) // 2 + 16 + reply + 4)
    return max(1000, LONG_PROMPT - later)


def live_blocks(scenario: Scenario, reply: int) -> int:
    """Blocks of the live conversations' longest prompts, all together."""
    if not scenario.long:
        return scenario.live * history_blocks(reply)
    long = _last_prompt(long_first_words(reply), LONG_TURN_WORDS, reply)
    short = _last_prompt(SHORT_FIRST_WORDS, SHORT_TURN_WORDS, reply)
    return math.ceil((scenario.long * long + (scenario.live - scenario.long) * short) / BLOCK)


def p_capacity(scenario: Scenario, reply: int) -> int:
    """Each P's cache: its half of the live conversations' histories times the scenario's
    share, and never less than one request of max_model_len (vLLM's own floor)."""
    wanted = live_blocks(scenario, reply) / 2 * scenario.p_cache
    return max(ENGINE["max_model_len"] // BLOCK, math.ceil(wanted))


def conversations(scenario: Scenario, reply: int, salt: str, ids: bool) -> list:
    """The scenario's conversations as (kind, Conversation), their text and ids fixed by `salt`:
    the same for every system, so that each system sees the same requests (each on engines of
    its own) and a router that pins by conversation places them the same way in every run."""

    def sized(conv: Conversation) -> Conversation:
        conv.max_tokens = reply
        return conv

    if not scenario.long:
        return [
            ("uniform", sized(benchmark_conversation(salt, i, ids))) for i in range(scenario.live)
        ]
    out = []
    for i in range(scenario.live):
        kind = "long" if i < scenario.long else "short"
        first = long_first_words(reply) if kind == "long" else SHORT_FIRST_WORDS
        out.append(
            (
                kind,
                Conversation(
                    cid=f"{kind}-{salt}-{i}",
                    seed=f"{salt}/{i}",
                    first_words=first + i,
                    turn_words=LONG_TURN_WORDS if kind == "long" else SHORT_TURN_WORDS,
                    explicit=ids,
                    session_header=ids,
                    max_tokens=reply,
                    stream_options={"include_usage": False},
                ),
            )
        )
    return out


def start_delay(scenario: Scenario, index: int) -> float:
    """When conversation `index` starts: all at once, but for a skewed workload's short ones,
    spread evenly over one think time (the long ones first), so that they arrive throughout
    the long ones' turns rather than in waves."""
    if not scenario.long or index < scenario.long:
        return 0.0
    return scenario.think * (index - scenario.long) / (scenario.live - scenario.long)


# The client's process: bench.loadgen first, its import patches the standard library for gevent.
CLIENT = "import bench.loadgen, bench.reuse, sys; bench.reuse.client(sys.argv[1:])"


def client(argv: list[str] | None = None) -> None:
    """The load: every conversation of a scenario, one greenlet and keep-alive connection each,
    TURNS turns, `think` seconds between a reply and the next question; each turn tagged with
    its conversation's kind. Runs in a process of its own, gevent's monkey patching done first
    by importing bench.loadgen (see run())."""
    import gevent

    from bench import clients, loadgen

    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    scenario = Scenario(**spec["scenario"])
    convs = conversations(scenario, spec["reply"], spec["salt"], spec["ids"])
    results: list[list[dict]] = [[] for _ in convs]
    errors: list[str] = []
    started = time.monotonic()
    gevent.joinall(
        [
            gevent.spawn_later(
                start_delay(scenario, i),
                loadgen.conversation,
                spec["url"],
                conv,
                TURNS,
                started + DURATION,
                done,
                errors,
                scenario.think,
            )
            for i, ((kind, conv), done) in enumerate(zip(convs, results, strict=True))
        ]
    )
    turns = [
        {**turn, "kind": kind, "turn": index}
        for (kind, _), done in zip(convs, results, strict=True)
        for index, turn in enumerate(done)
    ]
    clients.write_results(spec["out"], started, turns, errors)


@contextlib.contextmanager
def cluster(system: System, scenario: Scenario, reply: int):
    flags = {**ENGINE, "bidirectional_kv_xfer": system.bidirectional}
    with contextlib.ExitStack() as stack:
        engines = [
            stack.enter_context(
                EmulatorProcess(
                    role,
                    host=host,
                    advertise_host=host,
                    **flags,
                    kv_capacity_blocks=p_capacity(scenario, reply)
                    if role == "prefill"
                    else D_CAPACITY,
                )
            )
            for role, host in zip(("prefill", "prefill", "decode", "decode"), HOSTS, strict=True)
        ]
        yield engines[:2], engines[2:]


@contextlib.contextmanager
def started(system: System, prefills: list, decodes: list, log_dir: str):
    """The system in front of the engines; yields its URL."""
    if system.kind == "gateway":
        with GatewayProcess(
            [p.url for p in prefills],
            [d.url for d in decodes],
            host=PROXY_HOST,
            workers=1,
            **dict(system.settings),
        ) as gateway:
            yield gateway.url
        return
    port = free_port(PROXY_HOST, 2)
    url = f"http://{PROXY_HOST}:{port}"
    log = os.path.join(log_dir, f"{slug(system.label)}.log")
    if system.kind == "router":
        argv = [
            venvs.ROUTER.bin("vllm-router"),
            "--host",
            PROXY_HOST,
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "nixl",
            *[a for p in prefills for a in ("--prefill", p.url)],
            *[a for d in decodes for a in ("--decode", d.url)],
            "--prometheus-host",
            PROXY_HOST,
            "--prometheus-port",
            str(port + 1),
            "--worker-startup-timeout-secs",
            "20",
            *system.argv,
        ]
    else:
        hosts = lambda engines: [urlsplit(e.url).hostname for e in engines]  # noqa: E731
        ports = lambda engines: [str(urlsplit(e.url).port) for e in engines]  # noqa: E731
        argv = [
            venvs.SEED.python(),
            venvs.seed_script(),
            "--host",
            PROXY_HOST,
            "--port",
            str(port),
            "--prefiller-hosts",
            *hosts(prefills),
            "--prefiller-ports",
            *ports(prefills),
            "--decoder-hosts",
            *hosts(decodes),
            "--decoder-ports",
            *ports(decodes),
        ]
    process = _spawn(argv, log, url, "/health")
    try:
        yield url
    finally:
        stop_process(process)


class Sampler:
    """The Ds' pinned blocks (kept for a next turn) at their peak, sampled every 0.2 s."""

    def __init__(self, decodes: list) -> None:
        self.decodes = decodes
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            pinned = 0
            for d in self.decodes:
                stats = d.stats()
                pinned += stats["kv_lease_blocks"] + stats["leaked_blocks"]
            self.peak = max(self.peak, pinned)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run(
    system: System, scenario: Scenario, reply: int, out_dir: str, seed: int = 0, repeat: int = 0
) -> dict:
    with (
        cluster(system, scenario, reply) as (prefills, decodes),
        started(system, prefills, decodes, out_dir) as url,
    ):
        tag = f"{scenario.live}-{scenario.long}-{scenario.p_cache}-{reply}"
        out = os.path.join(out_dir, f"reuse-{slug(system.label)}-{tag}-r{repeat}.json")
        spec = {
            "url": url,
            "out": out,
            "reply": reply,
            "ids": system.ids,
            "salt": f"s{seed}-{tag}",
            "scenario": dataclasses.asdict(scenario),
        }
        argv = [sys.executable, "-c", CLIENT, json.dumps(spec)]
        sampler = Sampler(decodes)
        subprocess.run(argv, check=True, timeout=DURATION + 300)
        pinned = sampler.stop()
        stats = [e.stats() for e in (*prefills, *decodes)]
    with open(out) as f:
        load = json.load(f)
    turns = load["turns"]
    p_stats, d_stats = stats[:2], stats[2:]
    elapsed = load["ended"] - load["started"]
    return {
        "scenario": scenario.label,
        "reply": reply,
        "system": system.label,
        "turns": len(turns),
        "errors": len(load["errors"]),
        "computed": sum(s["computed_prompt_tokens"] for s in stats),
        "prompt": sum(t["prompt_tokens"] for t in turns),
        "read_turns": sum(s["hits"] for s in p_stats),
        **latencies(turns, scenario),
        "d_pinned_peak": pinned,
        "d_wait_s": round(sum(s["kv_wait_seconds"] for s in d_stats), 2),
        "wrong_reuse": sum(s["wrong_reuse"] for s in stats),
        "p_capacity": p_capacity(scenario, reply),
        # Near 1 the client, not the system, would set the pace (and the ITL); the machine's
        # load average (other users included) says how far CPU was contended.
        "client_core_share": round(load["cpu_s"] / elapsed, 2) if elapsed > 0 else None,
        "load_avg": round(os.getloadavg()[0], 1),
        "first_error": (load["errors"] or [None])[0],
    }


def latencies(turns: list[dict], scenario: Scenario) -> dict:
    """TTFT p50/p99 (all turns; the turns after each conversation's first, which vLLM's
    multi-turn benchmark measures with --warmup-step: it sends every conversation's first turn
    at once and leaves them out, benchmarks/multi_turn/benchmark_serving_multi_turn.py:876-877
    and 1403-1407 in vLLM 0.33.0; the short conversations' where the workload is skewed) and ITL
    p50/p99 over every gap of every stream (pooled as vLLM's benchmark pools them,
    vllm/benchmarks/serve.py:661 and 797-799 in vLLM 0.33.0), in ms."""

    def ms(values: list[float], q: float) -> float | None:
        return round(percentile(values, q) * 1000, 1) if values else None

    ttft = [t["first"] - t["sent"] for t in turns]
    short = [t["first"] - t["sent"] for t in turns if t["kind"] == "short"]
    later = [t["first"] - t["sent"] for t in turns if t.get("turn", 0) > 0]
    gaps = [g for t in turns for g in t["gaps"]]
    return {
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "later_ttft_p50_ms": ms(later, 50),
        "later_ttft_p99_ms": ms(later, 99),
        "short_ttft_p50_ms": ms(short, 50) if scenario.long else None,
        "short_ttft_p99_ms": ms(short, 99) if scenario.long else None,
        "itl_p50_ms": ms(gaps, 50),
        "itl_p99_ms": ms(gaps, 99),
    }


COLUMNS = (
    "scenario",
    "reply",
    "system",
    "turns",
    "errors",
    "computed",
    "read_turns",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "later_ttft_p50_ms",
    "later_ttft_p99_ms",
    "short_ttft_p50_ms",
    "short_ttft_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "d_pinned_peak",
    "d_wait_s",
    "wrong_reuse",
)
HEADINGS = {
    "reply": "reply tokens",
    "computed": "prompt tokens computed (P + D)",
    "read_turns": "turns P read D's blocks",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "later_ttft_p50_ms": "TTFT p50 ms, turns 2+",
    "later_ttft_p99_ms": "TTFT p99 ms, turns 2+",
    "short_ttft_p50_ms": "short conv. TTFT p50 ms",
    "short_ttft_p99_ms": "short conv. TTFT p99 ms",
    "itl_p50_ms": "ITL p50 ms",
    "itl_p99_ms": "ITL p99 ms",
    "d_pinned_peak": "D pinned blocks (peak)",
    "d_wait_s": "D memory wait s",
    "wrong_reuse": "wrong reuse",
}


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(HEADINGS.get(c, c) for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [
            f"{row[c]:,}"
            if isinstance(row[c], int) and c != "reply"
            else "–"
            if row[c] is None
            else str(row[c])
            for c in COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


GOAL_AGAINST_CACHE_AWARE = 0.7  # issue 44: TTFT p99 at most 0.7x cache_aware's ...
GOAL_FEWER_TOKENS = 2.0  # ... wherever the gateway computes at least 2x fewer tokens


def goal(
    ours: dict, cache_aware: dict | None, round_robin: dict | None, key: str = "ttft_p99_ms"
) -> str:
    """Issue 44's goal for one row: the gateway's TTFT p99 (`key`: of every turn, or of turns
    2+) against each bound that applies, PASS or FAIL."""

    def p99(row: dict) -> float:
        return row[key] if row.get(key) is not None else math.inf

    def verdict(bound: float) -> str:
        # No figure on either side (no turns 2+ in a run, or every one failed): no verdict.
        if math.isinf(p99(ours)) or math.isinf(bound):
            return "n/a (no figure)"
        return "PASS" if p99(ours) <= bound else "FAIL"

    parts = [f"TTFT p99 {p99(ours)} ms"]
    if cache_aware is not None:
        fewer = cache_aware["computed"] / ours["computed"] if ours["computed"] else math.inf
        bound = GOAL_AGAINST_CACHE_AWARE * p99(cache_aware)
        parts.append(
            f"against {GOAL_AGAINST_CACHE_AWARE} x cache_aware's ({bound:.1f} ms; "
            f"{fewer:.2f}x fewer tokens) {verdict(bound)}"
            if fewer >= GOAL_FEWER_TOKENS
            else f"against cache_aware's not checked ({fewer:.2f}x fewer tokens, under "
            f"{GOAL_FEWER_TOKENS:g}x)"
        )
    if round_robin is not None:
        parts.append(f"against round_robin's ({p99(round_robin)} ms) {verdict(p99(round_robin))}")
    return ", ".join(parts)


def summary(rows: list[dict]) -> str:
    """Two lines per scenario and reply length: the gateway against vllm-router's default, and
    issue 44's goal (TTFT p99 against cache_aware's and round_robin's, ITL p99 beside them)."""
    by = {(r["scenario"], r["reply"], r["system"]): r for r in rows}
    gateways = {s.label for s in SYSTEMS.values() if s.kind == "gateway"}
    lines = []
    for (scenario, reply, system), ours in by.items():
        if system not in gateways:
            continue
        # A variant is named on its lines.
        shown = scenario if system == SYSTEMS["gateway"].label else f"{scenario} [{system}]"
        peer = by.get((scenario, reply, SYSTEMS["vllm-router"].label))
        rr = by.get((scenario, reply, SYSTEMS["vllm-router-rr"].label))
        if peer is not None and ours["computed"]:
            victims = (
                ""
                if ours["short_ttft_p99_ms"] is None
                else f", the short conversations' {ours['short_ttft_p99_ms']} against "
                f"{peer['short_ttft_p99_ms']} ms"
            )
            lines.append(
                f"- {shown}, {reply}-token replies: the gateway computed "
                f"{ours['computed']:,} prompt tokens, vllm-router (cache_aware) "
                f"{peer['computed']:,} ({peer['computed'] / ours['computed']:.2f}x); TTFT p50 "
                f"{ours['ttft_p50_ms']} against {peer['ttft_p50_ms']} ms, p99 "
                f"{ours['ttft_p99_ms']} against {peer['ttft_p99_ms']} ms{victims}; ITL p99 "
                f"{ours['itl_p99_ms']} against {peer['itl_p99_ms']} ms; P read D's blocks on "
                f"{ours['read_turns']} of {ours['turns']} turns; D's pinned blocks peaked at "
                f"{ours['d_pinned_peak']:,} (vllm-router: {peer['d_pinned_peak']:,})."
            )
        if peer is not None or rr is not None:
            itl = ", ".join(
                f"{label} {row['itl_p99_ms']}"
                for label, row in (("cache_aware", peer), ("round_robin", rr))
                if row is not None
            )
            lines.append(
                f"  - goal, {shown}, {reply}-token replies: {goal(ours, peer, rr)}; "
                f"ITL p99 {ours['itl_p99_ms']} ms ({itl})."
            )
            lines.append(
                f"  - goal on turns 2+ (vLLM's multi-turn benchmark with --warmup-step), "
                f"{shown}, {reply}-token replies: "
                f"{goal(ours, peer, rr, 'later_ttft_p99_ms')}."
            )
    return "\n".join(lines)


def available(keys: list[str], notes: list[str]) -> list[System]:
    problems = {"router": venvs.ROUTER.ensure(), "seed": venvs.seed_problem()}
    out = []
    for key in keys:
        system = SYSTEMS[key]
        problem = problems.get(system.kind)
        if problem:
            notes.append(f"{system.label} was skipped: {problem}")
        else:
            out.append(system)
    return out


# What a row of repeats says of a count that must not hide in a median: every run's errors and
# wrong reuses added up, D's pinned blocks at their highest.
SUMMED = ("errors", "wrong_reuse")
HIGHEST = ("d_pinned_peak",)


def median_row(runs: list[dict]) -> dict:
    """One row from a system's repeats: each figure's median over the runs that have it (errors
    and wrong reuses summed, the pinned peak the highest; the first error any run met), with
    every run's TTFT p99s kept beside it."""
    row = dict(runs[0])
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        if not values or isinstance(values[0], bool) or not isinstance(values[0], int | float):
            continue
        if key in SUMMED:
            row[key] = sum(values)
        elif key in HIGHEST:
            row[key] = max(values)
        else:
            median = statistics.median(values)
            row[key] = round(median) if isinstance(values[0], int) else round(median, 1)
    row["first_error"] = next((r["first_error"] for r in runs if r.get("first_error")), None)
    row["runs"] = len(runs)
    for key in ("ttft_p99_ms", "later_ttft_p99_ms"):
        row[f"{key}_runs"] = [r.get(key) for r in runs]
    return row


def measure(
    keys: list[str], scenarios, replies, out_dir: str, seed: int = 0, repeats: int = 1
) -> tuple[list[dict], list[str]]:
    """Every system on every scenario and reply length, `repeats` times, the systems taking
    turns (in reverse order every other repeat) so that each sees the machine as the others do;
    a row per system, the median of its repeats."""
    notes: list[str] = []
    os.makedirs(out_dir, exist_ok=True)
    systems = available(keys, notes)
    rows = []
    for scenario in scenarios:
        for reply in replies:
            runs: dict[str, list[dict]] = {system.label: [] for system in systems}
            for repeat in range(repeats):
                for system in systems if repeat % 2 == 0 else systems[::-1]:
                    row = run(system, scenario, reply, out_dir, seed, repeat)
                    runs[system.label].append(row)
                    _print_run(row, scenario, reply, system, repeat)
            rows += [median_row(runs[system.label]) for system in systems]
    return rows, notes


def _print_run(row: dict, scenario: Scenario, reply: int, system: System, repeat: int) -> None:
    print(
        f"{scenario.label:>36} {reply:>5} {system.label:>26}: "
        f"{row['computed']:>8,} computed, {row['read_turns']:>3} read, "
        f"TTFT p50 {row['ttft_p50_ms']} ms p99 {row['ttft_p99_ms']} ms "
        f"(turns 2+ {row['later_ttft_p99_ms']}) "
        f"(short p99 {row['short_ttft_p99_ms']}), ITL p99 {row['itl_p99_ms']} ms, "
        f"D pinned {row['d_pinned_peak']:,}, {row['errors']} errors "
        f"(repeat {repeat})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the skewed workload, 256-token replies"
    )
    parser.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma separated, of {', '.join(SYSTEMS)}",
    )
    parser.add_argument("--replies", help="comma separated reply lengths")
    parser.add_argument(
        "--scenarios",
        help="comma separated scenario numbers: "
        + ", ".join(f"{i} ({s.label})" for i, s in enumerate(SCENARIOS)),
    )
    parser.add_argument("--seed", type=int, default=0, help="the conversations' text and ids")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of every system per row, taking turns; a row is their median",
    )
    parser.add_argument(
        "--itl-ms",
        type=float,
        default=ENGINE["itl_ms"],
        help="the engines' decode step (their inter-token latency alone)",
    )
    parser.add_argument("--out", default=tempfile.mkdtemp(prefix="bench-reuse-"))
    args = parser.parse_args(argv)
    ENGINE["itl_ms"] = args.itl_ms
    scenarios = (
        tuple(SCENARIOS[int(i)] for i in args.scenarios.split(","))
        if args.scenarios
        else tuple(SCENARIOS[i] for i in QUICK_SCENARIOS)
        if args.quick
        else SCENARIOS
    )
    replies = (
        tuple(int(r) for r in args.replies.split(","))
        if args.replies
        else QUICK_REPLIES
        if args.quick
        else REPLIES
    )
    os.makedirs(args.out, exist_ok=True)
    rows, notes = measure(
        args.systems.split(","), scenarios, replies, args.out, args.seed, args.repeats
    )
    print("\n" + table(rows) + "\n\n" + summary(rows))
    for note in notes:
        print("note:", note)
    with open(os.path.join(args.out, "reuse.json"), "w") as f:
        json.dump({"rows": rows, "notes": notes}, f, indent=1)


if __name__ == "__main__":
    main()
