"""Tenants (client API keys): requests and tokens per minute with OpenAI's headers
(gateway/front/tenants.py), and places shared fairly when a worker is at --max-turns
(gateway/front/admission.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from emulator.process import EmulatorProcess, wait_until
from gateway.engines.instances import Pool
from gateway.front.admission import Admission
from gateway.front.auth import ApiKeys
from gateway.front.tenants import KeyLimits, RateLimited, Tenants, duration
from gateway.support.errors import Overloaded
from tests.helpers.servers import MODEL, gateway_process, starts_processes

CHAT = "/v1/chat/completions"


# --- a key's limits ---------------------------------------------------------------------------


def test_a_keys_file_line_gives_its_key_limits_of_its_own(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# tenants\nnoisy rpm=60 tpm=1000 turns=2 weight=0.5\nquiet\n")
    keys = ApiKeys(["from-settings"], str(path), defaults=KeyLimits(rpm=600))
    assert keys.tenant("Bearer noisy")[1] == KeyLimits(rpm=60, tpm=1000, turns=2, weight=0.5)
    assert keys.tenant("Bearer quiet")[1] == KeyLimits(rpm=600)
    assert keys.tenant("Bearer from-settings")[1] == KeyLimits(rpm=600)
    # One key however the header spells it; another key, another tenant.
    assert keys.tenant("bearer  noisy")[0] == keys.tenant("Bearer noisy")[0]
    assert keys.tenant("Bearer quiet")[0] != keys.tenant("Bearer noisy")[0]


@pytest.mark.parametrize("line", ["k rpm=ten", "k rpm=-1", "k speed=3", "k weight=0", "k rpm"])
def test_a_bad_limit_makes_the_file_accept_none_of_its_keys(tmp_path, line):
    path = tmp_path / "keys"
    path.write_text(f"good\n{line}\n")
    keys = ApiKeys([], str(path))
    with pytest.raises(Exception, match="Incorrect API key"):
        keys.check("Bearer good")  # fails closed, as an unreadable file does


@pytest.mark.parametrize(
    "seconds, text", [(0.12, "120ms"), (1, "1s"), (59.2, "1m0s"), (61, "1m1s"), (360, "6m0s")]
)
def test_reset_times_are_written_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text


def test_requests_beyond_the_limit_get_429_with_openais_headers_and_count_nothing():
    tenants = Tenants("local", 0.5)
    limits = KeyLimits(rpm=3)
    remaining = [
        tenants.admit("t", limits, 100).headers["x-ratelimit-remaining-requests"] for _ in range(3)
    ]
    assert remaining == ["2", "1", "0"]
    for _ in range(2):  # a refused request is not counted: still refused
        with pytest.raises(RateLimited) as refused:
            tenants.admit("t", limits, 100)
    headers = refused.value.headers()
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(headers["Retry-After"]) <= 60 and 1 <= int(headers["retry-after-ms"]) <= 60_000
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert refused.value.status == 429 and refused.value.type == "rate_limit_exceeded"
    assert tenants.admit("other", limits, 100).headers["x-ratelimit-remaining-requests"] == "2"


def test_tokens_are_estimated_then_corrected_by_what_the_turn_used():
    tenants = Tenants("local", 0.5)
    limits = KeyLimits(tpm=1000)
    ticket = tenants.admit("t", limits, 400)  # 400 bytes: 100 tokens estimated
    assert ticket.headers["x-ratelimit-remaining-tokens"] == "900"
    ticket.charge(30)  # it used 30: 70 given back
    assert tenants.admit("t", limits, 400).headers["x-ratelimit-remaining-tokens"] == "870"
    with pytest.raises(RateLimited, match="requested 1000"):
        tenants.admit("t", limits, 4000)  # 1000 more do not fit in 870


def test_a_turn_that_never_ran_gives_its_count_back():
    tenants = Tenants("local", 0.5)
    limits = KeyLimits(rpm=2, tpm=1000)
    ticket = tenants.admit("t", limits, 400)
    ticket.refund()  # refused for a place, or its engine failed first
    ticket.charge(50)  # too late: the first of the two counts
    again = tenants.admit("t", limits, 400)
    assert again.headers["x-ratelimit-remaining-requests"] == "1"
    assert again.headers["x-ratelimit-remaining-tokens"] == "900"


def test_tokens_are_given_back_only_within_their_window():
    """After the window has ended a give-back would start the next one below zero."""
    late = Tenants("local", 0.5, clock=lambda: time.time() + 3600)
    ticket = late.admit("t", KeyLimits(tpm=1000), 400)
    ticket.charge(0)
    assert (
        late.admit("t", KeyLimits(tpm=1000), 400).headers["x-ratelimit-remaining-tokens"] == "800"
    )


def test_a_storage_that_fails_admits_uncounted():
    tenants = Tenants("redis://127.0.0.1:9/0", 0.2)  # nothing listens there
    before = _errors()
    assert tenants.admit("t", KeyLimits(rpm=1), 10).headers == {}
    assert tenants.admit("t", KeyLimits(rpm=1), 10).headers == {}
    assert _errors() > before


def _errors() -> float:
    from prometheus_client import REGISTRY

    return (
        REGISTRY.get_sample_value("pd_gateway_store_errors_total", {"operation": "limits"}) or 0.0
    )


# --- fair admission -------------------------------------------------------------------------


def test_a_tenant_far_over_its_share_leaves_the_quiet_ones_their_places():
    admission = Admission(limit=8, queue=0, wait=0, retry_after=1)
    quiet = admission.enter("quiet")  # active: it may need its place again
    quiet()
    noisy = []
    with pytest.raises(Overloaded):
        for _ in range(8):
            noisy.append(admission.enter("noisy"))
    assert len(noisy) == 7  # one place kept for the quiet tenant
    admission.enter("quiet")  # at once, not refused
    assert admission.inflight == 8


def test_one_tenant_alone_takes_every_place_as_before():
    admission = Admission(limit=4, queue=0, wait=0, retry_after=1)
    for _ in range(4):
        admission.enter()
    with pytest.raises(Overloaded):
        admission.enter()
    admission.leave()
    admission.enter()


def test_weights_set_the_shares():
    admission = Admission(limit=8, queue=0, wait=0, retry_after=1)
    admission.enter("light", weight=1)()  # active, light's share is 2 of 8
    admission.enter("heavy", weight=3)()
    heavy = 0
    with pytest.raises(Overloaded):
        while True:
            admission.enter("heavy", weight=3)
            heavy += 1
    assert heavy == 7  # light's 1 place (its need) kept
    admission2 = Admission(limit=8, queue=0, wait=0, retry_after=1)
    for _ in range(3):  # light needs 3 at once, has a share of 2
        admission2.enter("light", weight=1)
    admission2.enter("heavy", weight=3)
    with pytest.raises(Overloaded):
        for _ in range(8):
            admission2.enter("heavy", weight=3)
    assert admission2.tenants["heavy"].inflight == 5  # 8 - light's 3


def test_a_freed_place_goes_to_the_tenant_with_the_fewest_turns_for_its_weight():
    admission = Admission(limit=2, queue=4, wait=10.0, retry_after=1)
    first, second = admission.enter("noisy"), admission.enter("noisy")
    order = []

    def wait_for(tenant: str) -> None:
        admission.enter(tenant)
        order.append(tenant)

    threads = [threading.Thread(target=wait_for, args=("noisy",))]
    threads[0].start()
    wait_until(lambda: admission.waiting == 1, 5, "noisy waiting")
    threads.append(threading.Thread(target=wait_for, args=("quiet",)))
    threads[1].start()
    wait_until(lambda: admission.waiting == 2, 5, "quiet waiting")
    first()  # one place: quiet, which has none, before noisy, which has one
    wait_until(lambda: order, 5, "a place given")
    assert order == ["quiet"]
    second()  # the next: noisy's
    for thread in threads:
        thread.join(5)
    assert order == ["quiet", "noisy"]


def test_a_full_queue_of_one_tenant_does_not_refuse_another_a_free_place():
    admission = Admission(limit=4, queue=2, wait=10.0, retry_after=1)
    for give_back in [admission.enter("b"), admission.enter("b")]:
        give_back()  # b is active, with nothing in flight
    admission.enter("a")
    admission.enter("a")
    waiters = [threading.Thread(target=admission.enter, args=("a",)) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    wait_until(lambda: admission.waiting == 2, 5, "a's turns waiting")
    admission.enter("b")  # b's reserved place, at once
    assert admission.tenants["b"].inflight == 1
    admission._leave(admission.tenants["b"])
    admission._leave(admission.tenants["a"])
    admission._leave(admission.tenants["a"])
    for waiter in waiters:
        waiter.join(5)
    assert admission.tenants["a"].inflight == 2 and admission.waiting == 0


def test_a_key_under_its_share_waits_for_the_next_freed_place_ahead_of_others():
    """Places held by another key's long turns: a key back after a pause (or new) waits up to
    fair_wait for the next freed place, where other turns wait `wait` (here none); a second
    such turn beyond `patient` is refused at once."""
    admission = Admission(limit=2, queue=2, wait=0, retry_after=1, fair_wait=10.0, patient=1)
    noisy = [admission.enter("noisy"), admission.enter("noisy")]
    got = []
    quiet = threading.Thread(target=lambda: got.append(admission.enter("quiet")))
    quiet.start()
    wait_until(lambda: admission.waiting_for_share == 1, 5, "quiet waiting")
    with pytest.raises(Overloaded):
        admission.enter("noisy")  # over its share: no wait
    with pytest.raises(Overloaded):
        admission.enter("other")  # under its share, but one waits already
    noisy.pop()()
    quiet.join(5)
    assert got and admission.tenants["quiet"].inflight == 1
    assert admission.waiting == admission.waiting_for_share == 0


def test_one_turn_of_a_key_at_a_time_waits_for_its_share():
    admission = Admission(limit=2, queue=4, wait=0, retry_after=1, fair_wait=10.0, patient=4)
    noisy = [admission.enter("noisy"), admission.enter("noisy")]
    waiters = [threading.Thread(target=admission.enter, args=(key,)) for key in ("x", "y")]
    waiters[0].start()
    wait_until(lambda: admission.waiting_for_share == 1, 5, "x waiting")
    with pytest.raises(Overloaded):
        admission.enter("x")  # x waits already: no second long wait
    waiters[1].start()  # y, back after a pause, still may
    wait_until(lambda: admission.waiting_for_share == 2, 5, "y waiting")
    for give_back in noisy:
        give_back()
    for waiter in waiters:
        waiter.join(5)
    assert admission.tenants["x"].inflight == admission.tenants["y"].inflight == 1


def test_a_waiting_turn_counts_against_its_keys_turns_at_once():
    admission = Admission(limit=1, queue=4, wait=10.0, retry_after=1)
    admission.enter("t", turns=2)
    waiter = threading.Thread(target=admission.enter, args=("t", 1.0, 2))
    waiter.start()
    wait_until(lambda: admission.waiting == 1, 5, "t's second turn waiting")
    with pytest.raises(Overloaded, match="2 turns at once"):
        admission.enter("t", turns=2)  # one in flight, one waiting: its two
    admission._leave(admission.tenants["t"])
    waiter.join(5)
    assert admission.tenants["t"].inflight == 1


def test_a_key_refused_after_its_wait_keeps_its_claim_for_its_retry(clock):
    """Refused after a long wait (30 s on the clock here), a key is still entitled to its
    place when its client retries: the claim runs from the refusal, not from the arrival."""
    admission = Admission(
        limit=2, queue=2, wait=0, retry_after=1, fair_wait=30.0, patient=4, clock=clock
    )
    noisy = [admission.enter("noisy"), admission.enter("noisy")]
    refused = []

    def quiet() -> None:
        try:
            admission.enter("quiet")
        except Overloaded as exc:
            refused.append(exc)

    waiter = threading.Thread(target=quiet)
    waiter.start()
    wait_until(lambda: admission.waiting_for_share == 1, 5, "quiet waiting")
    clock.advance(31)
    with admission._ready:
        admission._ready.notify_all()
    waiter.join(5)
    assert refused and admission.waiting == admission.waiting_for_share == 0
    clock.advance(9)  # 40 s after it came, 9 after its refusal
    noisy.pop()()
    with pytest.raises(Overloaded):
        admission.enter("noisy")  # the freed place is quiet's claim
    admission.enter("quiet")  # its retry takes it at once


def test_a_claim_outlasts_a_long_retry_after(clock):
    admission = Admission(limit=2, queue=0, wait=0, retry_after=8, clock=clock)
    admission.enter("quiet")()  # active: its need is one place
    clock.advance(12)  # past 10 s, within twice Retry-After
    admission.enter("noisy")
    with pytest.raises(Overloaded):
        admission.enter("noisy")


def test_a_waiting_turn_whose_client_left_gives_up():
    admission = Admission(limit=1, queue=2, wait=0, retry_after=1, fair_wait=30.0, patient=4)
    admission.enter("noisy")
    left = threading.Event()
    refused = []

    def quiet() -> None:
        try:
            admission.enter("quiet", gone=left.is_set)
        except Overloaded as exc:
            refused.append(exc)

    waiter = threading.Thread(target=quiet)
    waiter.start()
    wait_until(lambda: admission.waiting_for_share == 1, 5, "quiet waiting")
    left.set()
    waiter.join(5)  # asked at least once a second
    assert refused and admission.waiting == 0


def test_a_keys_turns_at_once_are_bounded():
    admission = Admission(limit=8, queue=0, wait=0, retry_after=1)
    admission.enter("t", turns=2)
    admission.enter("t", turns=2)
    with pytest.raises(Overloaded, match="2 turns at once"):
        admission.enter("t", turns=2)
    admission.enter("other", turns=2)


# --- through gunicorn, the OpenAI SDK, real engines ------------------------------------------


@pytest.fixture(scope="module")
@starts_processes
def engines():
    with (
        EmulatorProcess("prefill", host="127.0.0.67", itl_ms=1, bidirectional_kv_xfer=True) as p,
        EmulatorProcess("decode", host="127.0.0.68", itl_ms=1, bidirectional_kv_xfer=True) as d,
    ):
        yield p, d


def _sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_a_key_over_its_rate_gets_429_the_sdk_reads_and_others_go_on(engines, tmp_path):
    p, d = engines
    keys = tmp_path / "keys"
    keys.write_text("noisy rpm=3\nquiet\n")
    with gateway_process(
        [p.url], [d.url], api_keys_file=str(keys), key_rpm=100, key_tpm=100_000
    ) as gateway:
        noisy, quiet = _sdk(gateway, "noisy"), _sdk(gateway, "quiet")
        messages = [{"role": "user", "content": "hello"}]
        for left in ("2", "1", "0"):
            raw = noisy.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=4
            )
            assert raw.headers["x-ratelimit-limit-requests"] == "3"
            assert raw.headers["x-ratelimit-remaining-requests"] == left
            assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
            assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 100_000
        # (P also gets background releases of dropped entries: D is the turn's witness.)
        requests_before = d.stats()["requests"]
        with pytest.raises(openai.RateLimitError) as refused:
            noisy.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["code"] == 429
        assert d.stats()["requests"] == requests_before  # no engine call
        assert gateway.metric("pd_gateway_rate_limited_total", limit="requests") == 1
        # The key, however its header is written, is one budget.
        for header in ("bearer noisy", "Bearer  noisy"):
            refused = requests.post(
                gateway.url + CHAT,
                headers={"Authorization": header},
                json={"model": MODEL, "messages": messages},
                timeout=20,
            )
            assert refused.status_code == 429
        raw = quiet.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        assert raw.headers["x-ratelimit-remaining-requests"] == "99"
        # The same request again: the estimate counted twice, the first turn's estimate replaced
        # by the tokens the engines reported once it ended.
        again = quiet.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        used = raw.parse().usage.total_tokens
        assert (
            int(raw.headers["x-ratelimit-remaining-tokens"])
            - int(again.headers["x-ratelimit-remaining-tokens"])
        ) == used


def test_two_gateways_on_one_redis_share_a_keys_budget(engines, redis_server, tmp_path):
    p, d = engines
    keys = tmp_path / "keys"
    keys.write_text(f"shared-{time.time_ns()} rpm=10\n")
    key = keys.read_text().split()[0]
    with (
        gateway_process([p.url], [d.url], api_keys_file=str(keys), store=redis_server.url) as one,
        gateway_process([p.url], [d.url], api_keys_file=str(keys), store=redis_server.url) as two,
    ):
        codes = []
        for gateway in (one, two, one, two, one, two, one, two, one, two, one, two):
            codes.append(
                requests.post(
                    gateway.url + CHAT,
                    timeout=20,
                    headers={"Authorization": f"Bearer {key}"},
                    json={
                        "model": MODEL,
                        "max_tokens": 2,
                        "messages": [{"role": "user", "content": "hi"}],
                    },
                ).status_code
            )
        assert codes == [200] * 10 + [429] * 2


def test_a_forwarded_turn_carries_its_keys_headers(engines, tmp_path):
    p, d = engines
    keys = tmp_path / "keys"
    keys.write_text("k rpm=50\n")
    with (
        gateway_process([p.url], [d.url], api_keys_file=str(keys), workers=2) as gateway,
        ThreadPoolExecutor(1) as pool,
    ):
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "f"}]}
        headers = {"Authorization": "Bearer k"}
        with gateway.forwarded(body, headers) as arrived:
            turn = pool.submit(
                requests.post, gateway.url + CHAT, json=body, headers=headers, timeout=20
            )
            arrived()
            reply = turn.result()
        assert reply.status_code == 200
        assert reply.headers["x-ratelimit-limit-requests"] == "50"
        assert reply.headers["x-ratelimit-remaining-requests"] == "49"
        assert gateway.metric("pd_gateway_forwarded_total", result="sent") == 1


def test_one_keys_long_turn_releases_none_of_another_keys_conversations(engines, tmp_path):
    """D's budget of 100 blocks: a key's 10 conversations of a block or two each, then another
    key's turn of 3,300 words (some 200 blocks, over the budget alone). Before, that turn's
    entry stayed and every conversation of the first key was released to make room (their next
    turns missed); tenants sharing the budget, it is that turn's entry that goes."""
    p, d = engines
    keys = tmp_path / "keys"
    keys.write_text("victim\nnoisy\n")
    with gateway_process([p.url], [d.url], api_keys_file=str(keys), pinned_blocks="100") as gateway:
        histories = [[{"role": "user", "content": f"conversation {n}: hello"}] for n in range(10)]
        for history in histories:
            reply = _post(gateway, "victim", {"max_tokens": 8, "messages": history})
            history += [reply.json()["choices"][0]["message"], {"role": "user", "content": "and?"}]
        long_turn = {"max_tokens": 8, "messages": [{"role": "user", "content": "word " * 3300}]}
        assert _post(gateway, "noisy", long_turn).status_code == 200
        caches = [
            _post(gateway, "victim", {"max_tokens": 8, "messages": history}).headers[
                "X-Gateway-Cache"
            ]
            for history in histories
        ]
        assert caches == ["hit"] * 10
        wait_until(
            lambda: gateway.metric("pd_gateway_releases_total", reason="budget"),
            10,
            "the long turn's entry released",
        )
        assert gateway.metric("pd_gateway_releases_total", reason="budget") == 1


# --- a turn an engine worked for is charged; a key over its rate costs no parse -----------------

SLOW_HOSTS = ("127.0.0.185", "127.0.0.186")  # P, D (D decoding at 50 ms a token)


@pytest.fixture(scope="module")
@starts_processes
def slow_engines():
    with (
        EmulatorProcess("prefill", host=SLOW_HOSTS[0], itl_ms=1, bidirectional_kv_xfer=True) as p,
        EmulatorProcess("decode", host=SLOW_HOSTS[1], itl_ms=50, bidirectional_kv_xfer=True) as d,
    ):
        yield p, d


def _post(gateway, key: str, body: dict) -> requests.Response:
    return requests.post(
        gateway.url + CHAT,
        json={"model": MODEL, **body},
        timeout=20,
        headers={"Authorization": f"Bearer {key}"},
    )


@pytest.mark.parametrize("worker_class", ["gthread", "gevent"])
def test_a_key_back_after_a_pause_gets_a_place_another_keys_long_turns_hold(
    slow_engines, tmp_path, worker_class
):
    """Both places held by a noisy key's turns of ~2 s, its clients knocking on without pause:
    a quiet key's one turn (the OpenAI SDK, no retries) waits for the next freed place and is
    served. Before, it was refused at once (10 ms of wait), and so were its SDK's retries."""
    p, d = slow_engines
    keys = tmp_path / "keys"
    keys.write_text("noisy\nquiet\n")
    with gateway_process(
        [p.url],
        [d.url],
        api_keys_file=str(keys),
        max_turns=2,
        worker_class=worker_class,
        threads=8,
        release_rate=0,
    ) as gateway:
        long_turn = {"max_tokens": 40, "messages": [{"role": "user", "content": "go on"}]}
        running = d.stats()["requests"]
        done = threading.Event()
        refused = []

        def knock() -> None:
            for _ in range(2000):  # bounded; stops when quiet is served
                if done.is_set():
                    return
                refused.append(_post(gateway, "noisy", long_turn).status_code == 429)

        with ThreadPoolExecutor(4) as pool:
            holders = [pool.submit(knock) for _ in range(3)]
            wait_until(lambda: d.stats()["requests"] - running >= 2, 10, "noisy's turns on D")
            wait_until(lambda: any(refused), 10, "noisy refused beyond its places")
            try:
                reply = _sdk(gateway, "quiet").chat.completions.create(
                    model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
                )
            finally:
                done.set()
            for holder in holders:
                holder.result()
        assert reply.choices[0].message.content


def test_a_turn_p_prefilled_is_charged_whatever_happens_after(slow_engines, tmp_path):
    """`max_completion_tokens: 0` passes the gateway and P (which gets max_tokens 1), and D
    refuses it: P computed the prompt all the same. A key of 3 requests a minute gets 3 such
    turns, not 25: the fourth is refused before any engine is called."""
    p, d = slow_engines
    keys = tmp_path / "keys"
    keys.write_text("greedy rpm=3\n")
    before = p.stats()["requests"]
    with gateway_process([p.url], [d.url], api_keys_file=str(keys), release_rate=0) as gateway:
        body = {
            "messages": [{"role": "user", "content": "a long document " * 50}],
            "max_completion_tokens": 0,
        }
        codes = [_post(gateway, "greedy", body).status_code for _ in range(4)]
        assert codes == [400, 400, 400, 429]
        assert p.stats()["requests"] - before == 3


def test_a_client_that_leaves_while_d_decodes_is_charged(slow_engines, tmp_path):
    """A non-streamed turn whose client leaves once P has prefilled: P's work is done, so the
    request counts (before, it was given back, and a key could make P prefill without end)."""
    p, d = slow_engines
    keys = tmp_path / "keys"
    keys.write_text("leaver rpm=2\n")
    with gateway_process([p.url], [d.url], api_keys_file=str(keys), release_rate=0) as gateway:
        body = json.dumps(
            {
                "model": MODEL,
                "max_tokens": 200,
                "messages": [{"role": "user", "content": "tell me a long story"}],
            }
        ).encode()
        for _ in range(2):
            running = d.stats()["requests"]
            sock = socket.create_connection((gateway.host, gateway.port))
            sock.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer leaver\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (CHAT.encode(), len(body), body)
            )
            # D has the turn (P prefilled it): the client goes.
            wait_until(
                lambda running=running: d.stats()["requests"] > running, 10, "D to get the turn"
            )
            sock.close()
        wait_until(
            lambda: d.stats()["aborted_streams"] + d.stats()["completed"] >= 2,
            20,
            "D to see both turns end",
        )
        reply = _post(
            gateway, "leaver", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert reply.status_code == 429
        assert reply.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_key_whose_requests_are_spent_is_refused_before_its_body_arrives(slow_engines, tmp_path):
    """Once refused in the window, its next request is refused on its headers: a body of
    32 MiB costs no parse (here it never even arrives)."""
    p, d = slow_engines
    keys = tmp_path / "keys"
    keys.write_text("spent rpm=1\n")
    with gateway_process([p.url], [d.url], api_keys_file=str(keys), release_rate=0) as gateway:
        turn = {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        assert [_post(gateway, "spent", turn).status_code for _ in range(2)] == [200, 429]
        sock = socket.create_connection((gateway.host, gateway.port))
        try:
            sock.sendall(
                b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer spent\r\n"
                b"Content-Type: application/json\r\nContent-Length: 33554432\r\n\r\n{"
                % CHAT.encode()
            )
            sock.settimeout(10)
            head = sock.recv(4096)
        finally:
            sock.close()
        assert head.startswith(b"HTTP/1.1 429") and b"x-ratelimit-remaining-requests: 0" in head


def test_each_tenant_probes_a_template_of_its_own(fresh_engines, tmp_path):
    """A template's probe (three /tokenize calls) is each key's: shared, a turn whose template
    another key had probed would skip them, and its time would tell that the other key sent
    the same `tools`."""
    p, d = fresh_engines
    keys = tmp_path / "keys"
    keys.write_text("one\ntwo\n")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "secret_tool",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            },
        }
    ]
    body = {
        "messages": [{"role": "user", "content": "which tool?"}],
        "tools": tools,
        "max_tokens": 2,
    }
    with gateway_process([p.url], [d.url], api_keys_file=str(keys), release_rate=0) as gateway:
        calls = []
        for key in ("one", "one", "two"):
            before = p.stats()["tokenize_requests"]
            assert _post(gateway, key, body).status_code == 200
            calls.append(p.stats()["tokenize_requests"] - before)
        assert calls == [3, 0, 3]


@pytest.mark.parametrize(
    "failure, worked",
    [
        ("ClientGone", True),  # the client left while the engine computed
        ("GatewayTimeout", True),  # it computed past the deadline
        ("BadGateway", True),  # it failed after it got the request
        ("ServiceUnavailable", False),  # no connection: it never got it
        ("UpstreamRejected", False),  # it refused the request (a 4xx)
    ],
)
def test_an_engine_that_got_the_request_worked_for_it(failure, worked):
    """What decides whether a failed turn is charged (gateway.flow.disagg.Work)."""
    from gateway.flow.disagg import Disagg, Work
    from gateway.reuse.store import LocalStore
    from gateway.support import errors

    pool = Pool("prefill", ["http://10.9.0.1:8100"])
    disagg = Disagg(LocalStore(10, 450), None, pool, pool, attempts=1)
    exc = getattr(errors, failure)(
        "failed", **({"status": 400} if failure == "UpstreamRejected" else {})
    )
    work = Work()

    def call(instance, previous):
        raise exc

    with pytest.raises(errors.GatewayError):
        disagg._attempt(pool, "k", None, call, work=work)
    assert work.done is worked
