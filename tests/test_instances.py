"""Pools whose instance set changes at run time, an instance's state (its breaker, down until a
probe answers, requests in flight), admin changes shared through their file, and what a request
whose D has gone does (pinned at the wire with `responses`)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import pytest
import requests
import responses
from responses import matchers

from gateway.config import Settings
from gateway.engines.discovery import resolvable, with_address
from gateway.engines.instances import Policy, Pool
from gateway.engines.membership import ChangeLog, Membership
from tests.helpers.payloads import D_URL, MISS, P_URL, chat_events, d_params, p_params, p_reply
from tests.helpers.servers import QuietHandler
from tests.helpers.transport import ResponsesTransport

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
TURN2 = [
    *MESSAGES,
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "more"},
]
D2_URL = "http://10.9.0.4:8200"


def test_names_stay_with_their_instances_and_removed_ones_are_never_chosen():
    pool = Pool("decode", ["http://a:1", "http://b:2"])
    a, b = pool.instances
    c, new = pool.add("http://c:3", origin="admin")
    assert new and c.name == "decode[2]" and pool.add("http://c:3") == (c, False)
    assert pool.remove("http://a:1") is a and pool.remove("http://a:1") is None
    d, _ = pool.add("http://a:1")  # back again: a new instance, a new name
    assert [i.name for i in pool.instances] == ["decode[1]", "decode[2]", "decode[3]"]
    assert d is not a and pool.get("http://a:1") is d
    assert all(pool.choose(str(k), prefer=None) is not a for k in range(200))
    assert {pool.choose(str(k)) for k in range(200)} == {b, c, d}


def test_a_removed_instance_keeps_its_requests_and_its_preferred_entries_move():
    pool = Pool("decode", ["http://a:1", "http://b:2"])
    a, b = pool.instances
    pool.acquire(a)  # a stream on it
    pool.remove(a.url)
    assert pool.choose("k", prefer=a.url) is b  # its entries' D is gone: choose another
    assert pool.readiness(a.url) == (None, "gone")
    pool.release(a)  # the stream ends on the object it holds
    assert a.inflight == 0 and b.inflight == 0


def test_round_robin_goes_on_over_the_new_set():
    pool = Pool(
        "prefill", ["http://a:1", "http://b:2", "http://c:3"], Policy(routing="round_robin")
    )
    a, b, c = pool.instances
    assert [pool.choose("k") for _ in range(4)] == [a, b, c, a]
    pool.remove(c.url)
    d, _ = pool.add("http://d:4")
    assert [pool.choose("k") for _ in range(6)] == [b, d, a, b, d, a]


def test_sync_replaces_only_its_origin_and_an_empty_pool_refuses_clearly():
    pool = Pool("decode", [])
    pool.add("http://10.0.0.9:1", origin="admin")
    added, removed = pool.sync("dns:x", ["http://10.0.0.1:1", "http://10.0.0.2:1"])
    assert [i.url for i in added] == ["http://10.0.0.1:1", "http://10.0.0.2:1"] and not removed
    added, removed = pool.sync("dns:x", ["http://10.0.0.2:1", "http://10.0.0.9:1"])
    assert not added and [i.url for i in removed] == ["http://10.0.0.1:1"]
    assert pool.get("http://10.0.0.9:1").origin == "admin"  # not taken over by the name
    empty = Pool("prefill", [])
    with pytest.raises(Exception) as caught:
        empty.choose("k")
    assert getattr(caught.value, "status", None) == 503


def test_pool_changes_under_concurrent_choice_never_break_a_choice():
    pool = Pool("decode", [f"http://10.0.0.{i}:1" for i in range(4)])
    stop = threading.Event()
    errors = []

    def churn():
        for n in range(2000):
            url = f"http://10.0.1.{n % 7}:1"
            pool.add(url)
            pool.remove(url)
        stop.set()

    def choose():
        while not stop.is_set():
            try:
                instance = pool.choose("k")
                pool.acquire(instance)
                pool.release(instance)
            except Exception as exc:  # recorded; asserted empty
                errors.append(exc)
                return

    threads = [threading.Thread(target=churn), *(threading.Thread(target=choose) for _ in range(3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and len(pool.instances) == 4


def test_which_urls_are_resolved():
    assert resolvable("http://decode.ns.svc.cluster.local:8200")
    assert not resolvable("http://127.0.0.1:8200") and not resolvable("http://[::1]:8200")
    assert not resolvable("http://localhost:8200")
    assert not resolvable("https://decode.example:8200")  # the certificate names the host
    assert with_address("http://d.svc:8200", "10.1.2.3") == "http://10.1.2.3:8200"
    assert with_address("http://d.svc:8200/x", "fd00::5") == "http://[fd00::5]:8200/x"


def test_a_settings_name_that_cannot_be_resolved_is_kept_as_given():
    from devtools.dns import LoopbackDNS

    url = "http://decode.test:8200"
    with LoopbackDNS() as dns:  # knows no name: NXDOMAIN
        settings = Settings(
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL],
            decode=[url],
            resolve_interval=30,
            resolve_nameserver=dns.nameserver,
        )
        pools = {"prefill": Pool("prefill", []), "decode": Pool("decode", [])}
        membership = Membership(settings, {"": pools}, environ={})
        try:
            # The URL stays as it was, for connections to resolve, until the name has addresses.
            assert [i.url for i in pools["decode"].instances] == [url]
            assert pools["decode"].instances[0].origin == f"dns:{url}"
            assert [i.url for i in pools["prefill"].instances] == [P_URL]  # an IP: as given
            dns.set("decode.test", ["10.9.0.7", "10.9.0.6"])
            membership.discovery.refresh()
            assert [(i.url, i.host, i.name) for i in pools["decode"].instances] == [
                ("http://10.9.0.6:8200", "10.9.0.6", "decode[1]"),
                ("http://10.9.0.7:8200", "10.9.0.7", "decode[2]"),
            ]
            dns.failing = True  # a failed lookup keeps the last set
            membership.discovery.refresh()
            dns.failing = False
            dns.set("decode.test", [])  # so does an empty answer
            membership.discovery.refresh()
            assert len(pools["decode"].instances) == 2
            dns.set("decode.test", ["10.9.0.7"])
            membership.discovery.refresh()
            assert [i.name for i in pools["decode"].instances] == ["decode[2]"]
        finally:
            membership.stop()


def test_admin_changes_reach_every_member_of_the_file_in_order(tmp_path):
    path = tmp_path / "changes.jsonl"
    path.touch()
    settings = Settings(
        engine_metrics_interval=0,
        probe_interval=0,
        prefill=[P_URL],
        decode=[D_URL],
        admin_instance_hosts=["10.9.0.0/24"],
    )

    def worker():
        pools = {"prefill": Pool("prefill", []), "decode": Pool("decode", [])}
        return Membership(settings, {"": pools}, environ={"PD_GATEWAY_CHANGES": str(path)}), pools

    (one, _), (two, two_pools) = worker(), worker()
    try:
        report, new = one.add("decode", "10.9.0.4:8200")  # host:port is enough
        assert new and report["url"] == D2_URL and report["name"] == "decode[1]"
        removed = one.remove("decode", D_URL)
        assert removed["name"] == "decode[0]"
        two.apply_pending()  # what its loop does every TICK
        assert [i.url for i in two_pools["decode"].instances] == [D2_URL]
        assert two_pools["decode"].instances[0].name == "decode[1]"
        # A worker that starts now replays the file: the same set as its siblings.
        three, three_pools = worker()
        assert [(i.url, i.origin) for i in three_pools["decode"].instances] == [(D2_URL, "admin")]
        three.stop()
        with pytest.raises(Exception, match="last decode instance"):
            one.remove("decode", D2_URL)
        with pytest.raises(Exception, match="no decode instance"):
            one.remove("decode", D_URL)
        with pytest.raises(Exception, match="role must be"):
            one.add("router", D_URL)
        with pytest.raises(Exception, match="url"):
            one.add("decode", "ftp://x")
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert lines == [
            {"op": "add", "role": "decode", "url": D2_URL},
            {"op": "remove", "role": "decode", "url": D_URL},
        ]
    finally:
        one.stop()
        two.stop()


def test_a_change_log_of_its_own_outside_gunicorn():
    log = ChangeLog(None)
    log.append({"op": "add"})
    assert log.unread() == [{"op": "add"}] and log.unread() == [] and not log.shared
    log.close()


# --- an instance's state: its breaker, down until a probe answers, requests in flight -----------


def test_breaker_opens_after_consecutive_failures_then_half_opens(clock):
    from gateway.engines.instances import Policy, Pool

    pool = Pool(
        "decode",
        ["http://a:1", "http://b:2"],
        Policy(breaker_failures=3, breaker_cooldown=10),
        clock=clock,
    )
    a, b = pool.instances
    for _ in range(2):
        pool.failed(a, unreachable=False)
    assert a.state(clock()) == "up" and pool.choose("k", prefer=a.url) is a
    pool.failed(a, unreachable=False)
    assert a.state(clock()) == "open"
    assert all(pool.choose(str(k), prefer=a.url) is b for k in range(20))
    clock.advance(10)
    assert a.state(clock()) == "half-open"  # tried again after the cool-down
    assert pool.choose("k", prefer=a.url) is a
    pool.failed(a, unreachable=False)  # one more failure re-opens it at once
    assert a.state(clock()) == "open"
    clock.advance(10)
    pool.succeeded(a)
    assert a.state(clock()) == "up" and a.failures == 0


def test_unreachable_marks_down_until_success(clock):
    from gateway.engines.instances import Pool

    pool = Pool("prefill", ["http://a:1", "http://b:2"], clock=clock)
    a, b = pool.instances
    woken = []
    pool.on_down = lambda: woken.append(True)
    pool.failed(a, unreachable=True)
    assert a.state(clock()) == "down" and woken == [True]
    clock.advance(3600)
    assert all(pool.choose(str(k)) is b for k in range(20))
    pool.succeeded(a)  # what a successful /health probe does
    assert a.state(clock()) == "up"


def test_closing_a_gateway_stops_its_prober():
    from gateway.config import Settings
    from gateway.service import Gateway

    gateway = Gateway(
        Settings(
            engine_metrics_interval=0,
            prefill=["http://127.0.0.1:9"],
            decode=["http://127.0.0.1:9"],
            probe_interval=0.05,
        )
    )
    gateway.prefill.failed(gateway.prefill.instances[0], unreachable=True)  # wakes the prober
    thread = gateway.prober._thread
    assert thread is not None and thread.is_alive()
    gateway.close()
    assert not thread.is_alive()


def test_an_unexpected_exception_never_leaks_an_in_flight_count():
    from gateway.engines.instances import Pool
    from gateway.flow.disagg import Disagg
    from gateway.reuse.store import LocalStore

    pool = Pool("prefill", ["http://10.9.0.1:8100"])
    disagg = Disagg(LocalStore(10, 450), None, pool, pool)

    def bug(instance, failure):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        disagg._attempt(pool, "k", None, bug)
    assert pool.instances[0].inflight == 0


# --- at the wire ----------------------------------------------------------------------------


@pytest.fixture
def two_d_client(store):
    from gateway.app import create_app

    app = create_app(
        Settings(
            release_rate=0,
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL],
            decode=[D_URL, D2_URL],
            worker_class="gthread",
            verify_reuse="off",
            fast_path_tokens=64,
            admin_token="t",
            admin_instance_hosts=["10.9.0.0/24"],
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    yield app.test_client(), app.extensions["pd_gateway"].gateway
    app.extensions["pd_gateway"].close()


ADMIN = {"Authorization": "Bearer t"}


@responses.activate
def test_an_entry_whose_d_was_removed_misses_cleanly(two_d_client):
    client, gateway = two_d_client
    responses.post(P_URL + CHAT, json=p_reply(p_params(1)))
    for url in (D_URL, D2_URL):
        responses.post(
            url + CHAT,
            body=chat_events(["hello", " world"], d_params(1)),
            content_type="text/event-stream",
        )
    first = client.post(
        CHAT, json={"model": "m", "messages": MESSAGES, "stream": True, "conversation_id": "c1"}
    )
    assert first.status_code == 200 and b"[DONE]" in first.data
    holder = next(
        c.request.url
        for c in responses.calls
        if c.request.url.endswith(CHAT) and not c.request.url.startswith(P_URL)
    ).removesuffix(CHAT)
    reply = client.delete("/admin/instances", json={"role": "decode", "url": holder}, headers=ADMIN)
    assert reply.status_code == 200, reply.data
    assert reply.get_json()["workers_pending"] == []
    other = D2_URL if holder == D_URL else D_URL
    responses.calls.reset()
    # The miss stub goes to P: never the gone D's params, even on the fast path.
    responses.replace(
        responses.POST,
        P_URL + CHAT,
        json=p_reply(p_params(2)),
        match=[
            matchers.json_params_matcher(
                {
                    "model": "m",
                    "messages": TURN2,
                    "stream": False,
                    "max_tokens": 1,
                    "kv_transfer_params": MISS,
                }
            )
        ],
    )
    reply = client.post(
        CHAT, json={"model": "m", "messages": TURN2, "stream": True, "conversation_id": "c1"}
    )
    assert reply.status_code == 200 and b"[DONE]" in reply.data
    assert reply.headers["X-Gateway-Path"] == "two-stage; reason=decode_gone"
    assert reply.headers["X-Gateway-Cache"] == "miss"
    assert [c.request.url for c in responses.calls] == [P_URL + CHAT, other + CHAT]


def test_the_admin_endpoint_follows_the_admin_rule(two_d_client, app):
    client, _ = two_d_client
    assert client.get("/admin/instances").status_code == 401
    assert client.get("/admin/instances", headers={"Authorization": "Bearer x"}).status_code == 401
    listed = client.get("/admin/instances", headers=ADMIN).get_json()
    assert [i["url"] for i in listed["decode"]] == [D_URL, D2_URL]
    added = client.post(
        "/admin/instances", json={"role": "prefill", "url": "http://10.9.0.5:1"}, headers=ADMIN
    )
    assert added.status_code == 201 and added.get_json()["name"] == "prefill[1]"
    again = client.post("/admin/instances?role=prefill&url=http://10.9.0.5:1", headers=ADMIN)
    assert again.status_code == 200
    bad = client.post("/admin/instances", json={"role": "prefill"}, headers=ADMIN)
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "url"
    status = client.get("/admin/status", headers=ADMIN).get_json()
    assert [i["origin"] for i in status["prefill"]] == ["settings", "admin"]
    # Without a token the admin routes do not exist.
    plain = app.test_client()
    assert plain.post("/admin/instances", json={"role": "decode", "url": D_URL}).status_code == 404


@pytest.mark.parametrize(
    "allowed, url, status",
    [
        ([], "http://10.9.0.1:8101", 201),  # a host the settings name, another port
        ([], "http://10.9.0.5:8100", 403),
        ([], "http://169.254.169.254:80", 403),  # a cloud's metadata service
        (["10.9.0.0/24"], "http://10.9.0.5:8100", 201),
        (["10.9.0.0/24"], "http://10.9.1.5:8100", 403),
        (["*.internal", "vllm.example"], "http://p3.pods.internal:8100", 201),
        (["*.internal", "vllm.example"], "http://vllm.example:8100", 201),
        (["*.internal", "vllm.example"], "http://internal.evil:8100", 403),
        (
            ["*.internal", "vllm.example"],
            "http://10.9.0.1:8100",
            403,
        ),  # names, not what they resolve to
        # One parse, the connection's: what one parser reads as a host the next must not read as
        # another (urlsplit took the host after the last @, past the backslash).
        ([], "http://169.254.169.254:80\\@10.9.0.1:8100", 400),
        ([], "http://user:pw@10.9.0.1:8100", 400),  # no user:password in an added URL
        ([], "http://10.9.0.1:8100/admin", 400),  # no path,
        ([], "http://10.9.0.1:8100?next=http://evil", 400),  # query
        ([], "http://10.9.0.1:8100#frag", 400),  # or fragment
        (["10.9.0.0/24:8100"], "http://10.9.0.5:8100", 201),  # a port in the allowlist
        (["10.9.0.0/24:8100"], "http://10.9.0.5:22", 403),
        (["*.internal:8100"], "http://p3.pods.internal:9000", 403),
        (["[fd00::/8]:8100"], "http://[fd00::5]:8100", 201),
    ],
)
def test_admin_added_engines_are_on_hosts_the_settings_allow(allowed, url, status):
    """With the admin token, /admin/instances could point the gateway at any address it reaches
    and read answers back through /v1/models; it takes only hosts the settings allow."""
    from gateway.app import create_app

    app = create_app(
        Settings(
            release_rate=0,
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL],
            decode=[D_URL],
            admin_token="t",
            admin_instance_hosts=allowed,
        ),
        transport=ResponsesTransport(),
    )
    try:
        reply = app.test_client().post(
            "/admin/instances", json={"role": "decode", "url": url}, headers=ADMIN
        )
        assert reply.status_code == status, reply.get_json()
        if status in (400, 403):
            assert reply.get_json()["error"]["param"] == "url"
    finally:
        app.extensions["pd_gateway"].close()


def test_engine_credentials_never_reach_reports_or_logs(caplog):
    """user:password in an engine URL is sent to the engine (Basic auth), and shown nowhere."""
    from gateway.engines.instances import Pool

    pool = Pool("decode", ["http://bob:s3cret@10.9.0.3:8200"])
    instance = pool.instances[0]
    assert instance.credentials == ("bob", "s3cret")
    with caplog.at_level("INFO"):
        pool.failed(instance, unreachable=True)
        pool.add("http://eve:hunter2@10.9.0.4:8200", origin="dns:http://eve:hunter2@d.test:8200")
    assert [i["url"] for i in pool.report()] == ["http://10.9.0.3:8200", "http://10.9.0.4:8200"]
    assert "s3cret" not in caplog.text and "hunter2" not in caplog.text
    assert "10.9.0.3:8200" in caplog.text


# --- on real sockets: added URLs parsed once, and no redirect followed ------------------------


class _Engine(QuietHandler):
    """An engine that answers /health and sends everything else elsewhere (a 302)."""

    elsewhere = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self.answer(200)
        else:
            self.answer(302, headers={"Location": self.elsewhere + self.path})


class _Trap(QuietHandler):
    """Where a redirect would lead: it counts who comes."""

    visits: list = []

    def do_GET(self):  # noqa: N802
        type(self).visits.append(self.path)
        self.answer(
            200,
            json.dumps({"object": "list", "data": [{"id": "secret-model"}]}).encode(),
            {"Content-Type": "application/json"},
        )


@pytest.mark.processes
def test_an_added_engine_url_is_parsed_once_and_no_redirect_is_followed():
    from emulator.process import EmulatorProcess, free_port
    from tests.helpers.servers import gateway_process

    with contextlib.ExitStack() as stack:
        servers = []
        for host, handler in (("127.0.0.191", _Trap), ("127.0.0.192", _Engine)):
            server = http.server.ThreadingHTTPServer((host, free_port(host)), handler)
            stack.callback(server.server_close)
            stack.callback(server.shutdown)
            threading.Thread(target=server.serve_forever, daemon=True).start()
            servers.append(server)
        trap, engine = (f"http://{s.server_address[0]}:{s.server_address[1]}" for s in servers)
        _Engine.elsewhere = trap
        p = stack.enter_context(
            EmulatorProcess("prefill", host="127.0.0.193", bidirectional_kv_xfer=True)
        )
        gateway = stack.enter_context(gateway_process([p.url], [engine], admin_token="t"))
        # The gateway's /v1/models asks its D, which redirects: not followed.
        assert requests.get(gateway.url + "/v1/models", timeout=10).status_code == 502
        assert _Trap.visits == []
        # The allowlist is the settings' hosts (127.0.0.192, 127.0.0.193): a URL urlsplit
        # reads as one of them and urllib3 as another is refused, not added.
        bypass = f"http://127.0.0.191:{servers[0].server_address[1]}\\\\@127.0.0.192:1"
        reply = requests.post(
            gateway.url + "/admin/instances",
            headers=ADMIN,
            timeout=10,
            json={"role": "decode", "url": bypass},
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "url"
        listed = requests.get(gateway.url + "/admin/instances", headers=ADMIN, timeout=10)
        assert [i["url"] for i in listed.json()["decode"]] == [engine]
        assert _Trap.visits == []
