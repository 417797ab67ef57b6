"""Engine-reported load (gateway/engines/engine_load.py): each engine's /metrics read once per
interval per host, and the choice of P and D passing over an engine that is queueing or full by its
own report."""

from __future__ import annotations

import http.server
import itertools
import json
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from emulator.metrics import exposition
from emulator.process import EmulatorProcess, wait_until
from gateway.engines.engine_load import FIELDS, RECLAIM, EngineLoad, Facts, LoadTable, Page, parse
from gateway.engines.instances import Pool
from tests.helpers.servers import MODEL, QuietHandler, gateway_process, starts_processes

VLLM_PAGE = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 3.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="deferred"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.875
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 12.0
"""


# --- reading a page --------------------------------------------------------------------------


def test_a_vllm_page_gives_capacity_waiting_running_and_the_fullest_cache():
    # Two data-parallel ranks: counts summed, the fuller cache; deferred (loading remote KV)
    # is not a queue.
    assert parse(VLLM_PAGE)[:3] == (1.0, 12.0, 0.875)


def test_a_page_without_waiting_by_reason_gives_no_queue_signal():
    """Its total counts the remote-KV loads every D has: not a queue (-1: unknown)."""
    older = b"\n".join(line for line in VLLM_PAGE.splitlines() if b"by_reason" not in line)
    assert parse(older)[:3] == (-1.0, 12.0, 0.875)


def test_a_page_without_the_gauges_is_no_report():
    assert parse(b"# nothing here\nprocess_cpu_seconds_total 3.0\n") is None
    no_kv = b"\n".join(line for line in VLLM_PAGE.splitlines() if b"kv_cache" not in line)
    assert parse(no_kv) is None
    assert parse(VLLM_PAGE.replace(b"} 7.0", b"} seven")) is None


def test_the_emulators_page_reads_as_vllms():
    snapshot = {
        "requests_running": 3,
        "requests_waiting": 5,
        "requests_waiting_capacity": 2,
        "requests_waiting_deferred": 3,
        "kv_cache_usage": 0.5,
        "kv_lease_blocks": 0,
        "leaked_blocks": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "external_prefix_cache_queries": 0,
        "external_prefix_cache_hits": 0,
    }
    assert parse(exposition(lambda: snapshot, "m"))[:3] == (2.0, 3.0, 0.5)


CACHE_CONFIG = (
    b'vllm:cache_config_info{_block_size_resolved="True",block_size="32",'
    b'cache_dtype="auto",enable_prefix_caching="False",engine="%s",'
    b"hash_block_size=\"32\",kv_cache_dtype_skip_layers=\"['a', 'b']\","
    b'mamba_block_size="None",num_gpu_blocks="%s",num_gpu_blocks_override="None"} 1.0\n'
)


def test_the_cache_config_says_block_size_capacity_and_prefix_caching():
    """vllm:cache_config_info: every CacheConfig field a label, its str() (vLLM 0.33.0
    config/cache.py ~L440-443), one line per data-parallel rank, each with every rank's blocks
    together (the front end sums them: v1/engine/core_client.py ~L874-877)."""
    page = parse(VLLM_PAGE + CACHE_CONFIG % (b"0", b"1000") + CACHE_CONFIG % (b"1", b"1000"))
    assert (page.block_size, page.capacity, page.prefix_caching, page.ranks) == (
        32.0,
        1000.0,
        1.0,
        2.0,
    )
    assert page.facts() == Facts(32, 1000, False, 2)
    on = parse(VLLM_PAGE + CACHE_CONFIG.replace(b'"False"', b'"True"') % (b"0", b"600"))
    assert on.prefix_caching == 2.0
    assert parse(VLLM_PAGE)[3:] == (0.0, 0.0, 0.0, 0.0)  # an engine that does not say
    # Ranks that disagree on the block size leave it unknown.
    mixed = CACHE_CONFIG % (b"0", b"1") + CACHE_CONFIG.replace(
        b'block_size="32"', b'block_size="16"'
    ) % (b"1", b"1")
    assert parse(VLLM_PAGE + mixed).block_size == 0.0


def test_the_emulators_cache_config_reads_as_vllms():
    from emulator.config import EngineConfig

    snapshot = {
        "requests_running": 0,
        "requests_waiting": 0,
        "requests_waiting_capacity": 0,
        "requests_waiting_deferred": 0,
        "kv_cache_usage": 0.0,
        "kv_lease_blocks": 0,
        "leaked_blocks": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "external_prefix_cache_queries": 0,
        "external_prefix_cache_hits": 0,
    }
    config = EngineConfig(role="decode", port=8200, block_size=32, kv_capacity_blocks=1024)
    page = parse(exposition(lambda: snapshot, "m", config))
    assert (page.block_size, page.capacity, page.prefix_caching) == (32.0, 1024.0, 2.0)


def test_facts_stay_known_after_the_load_goes_stale():
    one, other = _tables()
    row = one.claim("http://d:1", now=100.0, interval=1.0)
    assert other.facts("http://d:1") is None  # never read
    one.write("http://d:1", row, Page(0.0, 1.0, 0.5, 16.0, 600.0, 2.0), now=100.0)
    assert other.read("http://d:1", now=200.0, stale=3.0) is None
    assert other.facts("http://d:1") == Facts(16, 600, True)


# --- one read per interval per host ----------------------------------------------------------


def _tables(rows: int = 64) -> tuple[LoadTable, LoadTable]:
    """Two workers' views of one shared table (as forked from the master)."""
    keys = multiprocessing.RawArray("q", rows)
    values = multiprocessing.RawArray("d", rows * len(FIELDS))
    return LoadTable(keys, values, rows), LoadTable(keys, values, rows)


def test_an_engine_claimed_by_one_worker_is_not_read_by_another_within_the_interval():
    one, other = _tables()
    row = one.claim("http://d:1", now=100.0, interval=1.0)
    assert row is not None
    assert other.claim("http://d:1", now=100.5, interval=1.0) is None
    one.write("http://d:1", row, Page(2.0, 3.0, 0.5), now=100.1)
    report = other.read("http://d:1", now=100.6, stale=3.0)
    assert (report.waiting, report.running, report.kv_usage) == (2.0, 3.0, 0.5)
    assert other.claim("http://d:1", now=101.0, interval=1.0) == row  # its turn now
    assert other.read("http://d:1", now=103.2, stale=3.0) is None  # stale: no report
    assert other.read("http://never:1", now=100.0, stale=3.0) is None


def test_engines_whose_rows_collide_keep_their_own():
    one, other = _tables(rows=2)
    urls = [f"http://d:{port}" for port in range(2)]
    rows = [one.claim(url, 10.0, 1.0) for url in urls]
    assert sorted(rows) == [0, 1]
    for url, row, waiting in zip(urls, rows, (1.0, 2.0), strict=True):
        one.write(url, row, Page(waiting, 0.0, 0.0), 10.0)
    assert [other.read(url, 10.5, 3.0).waiting for url in urls] == [1.0, 2.0]
    assert other.claim("http://d:3", 10.0, 1.0) is None  # full: that one goes unread
    one.write("http://d:3", rows[0], Page(9.0, 9.0, 9.0), 11.0)  # not its row: nothing written
    assert other.read(urls[0], 11.0, 3.0).waiting == 1.0


def test_rows_of_engines_gone_are_taken_by_new_ones():
    """Engines come and go (DNS, admin): a row no worker has claimed for a minute is an engine
    gone, and a new engine takes it once the table is full (before, after as many engine URLs
    as rows, new engines got no report)."""
    one, other = _tables(rows=2)
    gone = ["http://gone:1", "http://gone:2"]
    for url in gone:
        row = one.claim(url, 10.0, 1.0)
        one.write(url, row, Page(0.0, 0.0, 0.5, 16.0, 600.0, 2.0), 10.0)
    assert other.claim("http://new:1", 40.0, 1.0) is None  # full, none gone yet
    row = other.claim("http://new:1", 10.0 + RECLAIM, 1.0)
    assert row is not None and other.facts("http://new:1") is None  # none of the gone one's
    other.write("http://new:1", row, Page(1.0, 0.0, 0.25), 71.0)
    assert one.read("http://new:1", 71.5, 3.0).waiting == 1.0
    assert sum(one.row(url) is not None for url in gone) == 1


def test_every_engine_of_every_pool_is_read_once_a_round():
    pools = [Pool("prefill", ["http://p:1"]), Pool("decode", ["http://d:1", "http://d:2"])]
    pages = {"http://p:1": VLLM_PAGE, "http://d:1": VLLM_PAGE, "http://d:2": b"not vllm"}
    asked = []

    def get(instance, timeout):
        asked.append(instance.url)
        return pages[instance.url]

    table, _ = _tables()
    clock = itertools.count(100)  # each engine read from a thread of its own
    load = EngineLoad(
        get,
        pools,
        interval=1.0,
        queue_limit=0,
        kv_full=0.95,
        table=table,
        clock=lambda: float(next(clock)),
    )
    try:
        load.read_all()
    finally:
        load.stop()
    assert sorted(asked) == ["http://d:1", "http://d:2", "http://p:1"]  # at once, any order
    # d:1 waits for capacity (1 > 0): busy; d:2's page is no report: not busy.
    assert [load.busy(i) for i in pools[1].instances] == [True, False]


# --- the choice ------------------------------------------------------------------------------


def _pool_with(busy: set[str]) -> Pool:
    pool = Pool("decode", ["http://d:1", "http://d:2", "http://d:3"])
    pool.busy = lambda instance: instance.url in busy
    return pool


def test_a_conversation_leaves_the_d_that_holds_it_when_that_d_is_busy():
    pool = _pool_with(busy={"http://d:1"})
    assert pool.choose("c", prefer="http://d:2").url == "http://d:2"
    assert pool.choose("c", prefer="http://d:1").url != "http://d:1"
    assert pool.readiness("http://d:1") == (None, "busy")


def test_new_conversations_pass_over_busy_engines():
    pool = _pool_with(busy={"http://d:1", "http://d:2"})
    assert {pool.choose(f"c{n}").url for n in range(50)} == {"http://d:3"}


def test_when_every_engine_is_busy_the_choice_is_in_flight_counts_alone():
    everyone = _pool_with(busy={"http://d:1", "http://d:2", "http://d:3"})
    nobody = _pool_with(busy=set())
    for n in range(50):
        assert everyone.choose(f"c{n}").url == nobody.choose(f"c{n}").url


# --- end to end: a D whose KV memory is full -------------------------------------------------


@pytest.fixture
@starts_processes
def full_d():
    """P, a roomy D1 and a D2 of 100 blocks that one long request fills, so the next waits
    there for KV memory (vLLM's waiting for capacity)."""
    with (
        EmulatorProcess("prefill", host="127.0.0.64", itl_ms=1, bidirectional_kv_xfer=True) as p,
        EmulatorProcess("decode", host="127.0.0.65", itl_ms=1, bidirectional_kv_xfer=True) as d1,
        EmulatorProcess(
            "decode",
            host="127.0.0.66",
            itl_ms=50,
            bidirectional_kv_xfer=True,
            kv_capacity_blocks=100,
            max_model_len=1600,
        ) as d2,
    ):
        yield p, d1, d2


def _fill(d2, pool: ThreadPoolExecutor) -> list:
    """A long request that takes ~94 of D2's 100 blocks for 10 s, and one that waits for them."""

    def send(word: str, words: int, max_tokens: int):
        return requests.post(
            d2.url + "/v1/completions",
            stream=True,
            timeout=30,
            json={
                "model": MODEL,
                "prompt": word * words,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            },
        )

    held = [pool.submit(send, "w ", 1300, 200)]
    wait_until(lambda: d2.stats()["streams_in_flight"] == 1, 10, "D2's long stream")
    held.append(pool.submit(send, "x ", 200, 10))  # other words: no prefix of the first
    wait_until(lambda: d2.stats()["requests_waiting_capacity"] == 1, 10, "a request waiting")
    return held


@pytest.mark.parametrize("interval", [0.2, 0])
def test_new_conversations_go_to_the_d_that_is_not_full(full_d, interval):
    """Reading the engines, none of 16 new conversations goes to the D that is full; without
    (interval 0: in-flight counts alone, which see nothing there), some do and wait."""
    p, d1, d2 = full_d
    with (
        gateway_process(
            [p.url], [d1.url, d2.url], workers=2, engine_metrics_interval=interval
        ) as gateway,
        ThreadPoolExecutor(4) as pool,
    ):
        held = _fill(d2, pool)
        if interval:
            for port in (gateway.port + 1, gateway.port + 2):  # each worker sees it busy
                wait_until(
                    lambda port=port: next(
                        i for i in gateway.status(port)["decode"] if i["url"] == d2.url
                    )["reported"]["busy"],
                    10,
                    "D2 reported busy",
                )
        before = d2.stats()["requests"]
        turns = [
            pool.submit(
                requests.post,
                gateway.url + "/v1/chat/completions",
                timeout=30,
                json={
                    "model": MODEL,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"conversation {n}"}],
                },
            )
            for n in range(16)
        ]
        if interval:
            assert all(turn.result().status_code == 200 for turn in turns)
            assert d2.stats()["requests"] == before
        else:
            wait_until(lambda: d2.stats()["requests"] > before, 20, "a turn sent to D2")
        for response in held:
            response.result().close()
        assert all(turn.result().status_code == 200 for turn in turns)


# --- an engine's page, bounded ----------------------------------------------------------------


class _BadPages(QuietHandler):
    """An engine whose /metrics trickles (a byte every 0.2 s, for as long as anyone reads) or
    is larger than any page should be; /health and /v1/models as vLLM's."""

    protocol_version = "HTTP/1.1"
    kind = "trickle"

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path != "/metrics":
            self.answer(
                200,
                b""
                if self.path == "/health"
                else json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode(),
            )
            return
        # A page vLLM could send, but for its 9 MiB of comment lines.
        page = VLLM_PAGE + b"# padding\n" * (9 * 1024 * 1024 // 10)
        self.send_response(200)
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        try:
            if self.kind == "large":
                self.wfile.write(page)
                return
            for _ in range(300):  # a minute at most: the test is long over by then
                self.wfile.write(b"#")
                self.wfile.flush()
                time.sleep(0.2)
        except OSError:  # the reader gave up: what it should do
            pass


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["trickle", "large"])
def test_an_engine_whose_page_trickles_or_is_too_large_delays_no_other(kind):
    """One D's /metrics trickles, or weighs 9 MiB: its read fails within its timeout (2 s) or
    at 8 MiB, and the P's reports go on being read each second meanwhile (before, the trickle
    held the one reader for good, and every engine's report went stale)."""
    handler = type("Pages", (_BadPages,), {"kind": kind})
    server = http.server.ThreadingHTTPServer(("127.0.0.195", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bad = f"http://127.0.0.195:{server.server_address[1]}"
    try:
        with (
            EmulatorProcess("prefill", host="127.0.0.196") as p,
            gateway_process([p.url], [bad]) as gateway,
        ):
            wait_until(
                lambda: (
                    gateway.metric(
                        "pd_gateway_engine_metrics_reads_total", role="prefill", result="read"
                    )
                    >= 4
                ),
                15,
                "the P's reports, read each second",
            )
            wait_until(
                lambda: (
                    gateway.metric(
                        "pd_gateway_engine_metrics_reads_total", role="decode", result="failed"
                    )
                    >= 1
                ),
                15,
                "the D's page given up",
            )
            assert (
                gateway.metric(
                    "pd_gateway_engine_metrics_reads_total", role="decode", result="read"
                )
                == 0
            )
            assert gateway.metric("pd_gateway_engine_kv_blocks", role="prefill") == 20000
    finally:
        server.shutdown()
        server.server_close()
