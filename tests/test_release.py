"""Which entries a turn drops unread, and so asks a P to release (pinned at the wire with
`responses`; the release request itself: tests/test_fast_path.py; end to end on the emulator's
vLLM rules: tests/test_d_memory.py)."""

from __future__ import annotations

import json

import pytest
import responses

from gateway.reuse.conversation import identify
from gateway.reuse.store import Entry
from tests.helpers.payloads import (
    CHAT,
    D_URL,
    MESSAGES,
    MISS,
    P_URL,
    REFUSED,
    chat_events,
    d_params,
    p_params,
    p_reply,
)
from tests.helpers.transport import ResponsesTransport

P2_URL = "http://10.9.0.3:8100"


class Recorder:
    """Stands in for the gateway's Releaser: what was dropped, and why."""

    def __init__(self) -> None:
        self.dropped: list[tuple[str, str]] = []

    def drop(self, entry: Entry, reason: str) -> None:
        self.dropped.append((entry.params["remote_request_id"], reason))


@pytest.fixture
def gateway(store):
    """(client, the recorder, the store) of an app with two Ps and one D."""
    from gateway.app import create_app
    from gateway.config import Settings

    app = create_app(
        Settings(
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL, P2_URL],
            decode=[D_URL],
            worker_class="gthread",
            verify_reuse="off",
            release_rate=0,
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    recorder = Recorder()
    app.extensions["pd_gateway"].gateway.disagg.releaser = recorder
    yield app.test_client(), recorder, store
    app.extensions["pd_gateway"].close()


def stored_entry(store, n: int = 1, **fields) -> None:
    """An entry for MESSAGES' first message, as the previous turn's D left it."""
    identity = identify({"messages": MESSAGES}, {}, "conv")
    store.put(
        identity.root,
        Entry(
            **{
                "params": {**d_params(n), "remote_host": "10.9.0.2"},
                "decode_url": D_URL,
                "history_digest": identity.messages[0].hex(),
                "history_len": 1,
                "plain": True,
                **fields,
            }
        ),
    )


def turn(client, **body):
    return client.post(
        CHAT, json={"messages": MESSAGES, "conversation_id": "conv", "stream": True, **body}
    )


@responses.activate
def test_an_entry_the_proof_refuses_is_released(gateway):
    client, recorder, store = gateway
    stored_entry(store, plain=False)  # reasoning or tool calls: verify_reuse off refuses
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(P2_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events([" a"], d_params(2)), content_type="text/event-stream"
    )
    reply = turn(client)
    assert reply.headers["X-Gateway-Cache"] == "miss"
    assert recorder.dropped == [("d-req-1", "unproven")]


@pytest.mark.parametrize("failure, released", [("refused", True), ("error500", False)])
@responses.activate
def test_params_a_p_never_read_are_released_and_those_it_may_have_read_are_not(
    gateway, failure, released
):
    client, recorder, store = gateway
    stored_entry(store)
    sent = []

    def prefill(request):
        sent.append(json.loads(request.body)["kv_transfer_params"])
        if len(sent) == 1:
            return (
                REFUSED
                if failure == "refused"
                else (500, {}, json.dumps({"error": {"message": "boom"}}))
            )
        return 200, {}, json.dumps(p_reply(p_params()))

    responses.add_callback(responses.POST, P_URL + CHAT, callback=prefill)
    responses.add_callback(responses.POST, P2_URL + CHAT, callback=prefill)
    responses.post(
        D_URL + CHAT, body=chat_events([" a"], d_params(2)), content_type="text/event-stream"
    )
    assert turn(client).status_code == 200
    assert sent[0]["remote_request_id"] == "d-req-1" and sent[1] == MISS
    # A refused connection never reached P; a 500 came from a P that may have read the blocks
    # (and then notified D itself: a second notification would be D's error log).
    assert recorder.dropped == ([("d-req-1", "prefill_failed")] if released else [])


@responses.activate
def test_when_every_p_refuses_the_entry_is_released_and_the_client_gets_an_error(gateway):
    client, recorder, store = gateway
    stored_entry(store)
    responses.post(P_URL + CHAT, body=REFUSED)
    responses.post(P2_URL + CHAT, body=REFUSED)
    assert turn(client).status_code == 503
    assert recorder.dropped == [("d-req-1", "prefill_failed")]


@responses.activate
def test_an_entry_whose_d_left_the_pool_is_released(store):
    from gateway.app import create_app
    from gateway.config import Settings

    app = create_app(
        Settings(
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=[P_URL],
            decode=["http://10.9.0.9:8200"],
            worker_class="gthread",
            verify_reuse="off",
            release_rate=0,
        ),
        store=store,
        transport=ResponsesTransport(),
    )
    recorder = Recorder()
    app.extensions["pd_gateway"].gateway.disagg.releaser = recorder
    try:
        stored_entry(store)  # its D (D_URL) is not in this pool
        responses.post(P_URL + CHAT, json=p_reply(p_params()))
        responses.post(
            "http://10.9.0.9:8200" + CHAT,
            body=chat_events([" a"], d_params(2)),
            content_type="text/event-stream",
        )
        reply = turn(app.test_client())
        assert reply.headers["X-Gateway-Path"] == "two-stage; reason=decode_gone"
        assert recorder.dropped == [("d-req-1", "decode_gone")]
    finally:
        app.extensions["pd_gateway"].close()


@responses.activate
def test_blocks_d_kept_for_a_turn_that_left_no_entry_are_released(gateway):
    """D sent its params, but the stream ended before [DONE]: no entry for the next turn, and
    nothing else would ever free those blocks before D's TTL."""
    client, recorder, _ = gateway
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(P2_URL + CHAT, json=p_reply(p_params()))
    cut = chat_events([" a"], d_params(3)).replace(b"data: [DONE]\n\n", b"")
    responses.post(D_URL + CHAT, body=cut, content_type="text/event-stream")
    reply = turn(client)
    assert b'"error"' in reply.data
    reply.close()
    assert recorder.dropped == [("d-req-3", "unstored")]


@responses.activate
def test_a_complete_turn_keeps_its_blocks_for_the_next(gateway):
    client, recorder, store = gateway
    responses.post(P_URL + CHAT, json=p_reply(p_params()))
    responses.post(P2_URL + CHAT, json=p_reply(p_params()))
    responses.post(
        D_URL + CHAT, body=chat_events([" a"], d_params(4)), content_type="text/event-stream"
    )
    reply = turn(client)
    reply.close()
    assert recorder.dropped == [] and len(store) == 1
