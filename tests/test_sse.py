"""The relay of D's events (gateway.flow.sse): however D's bytes are split into reads, the client
gets the same bytes, params and unasked ids taken out, every other event byte for byte; the turn
learns the same reply. The fast path (LF events, `bytes.find`) is checked against the general
one (a regex over every SSE line ending)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.flow.decoded import Decoded
from gateway.flow.sse import EventFilter
from gateway.support.errors import ClientGone

content = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
chunks = st.one_of(
    st.builds(
        lambda text, finish: {
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]
        },
        content,
        st.sampled_from([None, "stop", "length"]),
    ),
    st.just({"choices": [], "kv_transfer_params": {"remote_block_ids": [[1, 2]]}}),
    st.builds(
        lambda text: {
            "choices": [{"index": 0, "delta": {"content": text}}],
            "kv_transfer_params": {"remote_engine_id": "e"},
        },
        content,
    ),
    st.builds(
        lambda ids: {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": ids}]},
        st.lists(st.integers(0, 9), min_size=1, max_size=3),
    ),
)


def event(kind, chunk) -> bytes:
    text = json.dumps(chunk, separators=(",", ":"))
    return {
        "data": b"data: " + text.encode() + b"\n\n",
        "spaced": b"data:  " + text.encode() + b"\n\n",
        "comment": b": keep-alive\n\n",
        "blank": b"\n",
        "done": b"data: [DONE]\n\n",
    }[kind]


events = st.lists(
    st.tuples(
        st.sampled_from(["data", "data", "data", "spaced", "comment", "blank", "done"]), chunks
    ),
    max_size=10,
)


def relay(wire: bytes, cuts: list[int], general: bool, strip: bool) -> tuple[bytes, Decoded]:
    decoded = Decoded(strip_ids=strip)
    relayed = EventFilter(decoded)
    if general:
        relayed.feed = lambda data, r=relayed: r._feed_general(
            r._pending + data,  # noqa: E731
            max(0, len(r._pending) - 3),
        )
    out, start = b"", 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(wire))) + [len(wire)]:
        out += relayed.feed(wire[start:cut])
        start = cut
    return out, decoded


@given(events=events, cuts=st.lists(st.integers(0, 2000), max_size=8), strip=st.booleans())
def test_any_split_of_d_bytes_relays_as_the_general_path_does(events, cuts, strip):
    wire = b"".join(event(kind, chunk) for kind, chunk in events)
    fast, fast_turn = relay(wire, cuts, general=False, strip=strip)
    slow, slow_turn = relay(wire, [], general=True, strip=strip)
    assert fast == slow
    assert (fast_turn.text, fast_turn.params, fast_turn.done, fast_turn.finish_reasons) == (
        slow_turn.text,
        slow_turn.params,
        slow_turn.done,
        slow_turn.finish_reasons,
    )
    assert b"kv_transfer_params" not in fast
    if strip:
        assert b'"token_ids":[' not in fast


@given(events=events)
def test_events_that_change_nothing_pass_byte_for_byte(events):
    plain = [
        (kind, chunk)
        for kind, chunk in events
        if kind in ("data", "comment") and "kv_transfer_params" not in chunk
    ]
    wire = b"".join(event(kind, chunk) for kind, chunk in plain)
    assert relay(wire, [], general=False, strip=False)[0] == wire


def test_blank_lines_beyond_an_event_are_kept_for_the_next_read():
    out, _ = relay(b'data: {"a":1}\n\n\n', [], general=False, strip=False)
    assert out == b'data: {"a":1}\n\n'


def test_an_event_python_json_reads_and_orjson_does_not_is_still_cleaned():
    wire = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"},"logprobs":NaN}],'
        b'"kv_transfer_params":{"x":1}}\n\n'
    )
    out, decoded = relay(wire, [], general=False, strip=False)
    assert b"kv_transfer_params" not in out and b"NaN" in out and decoded.params == {"x": 1}


@pytest.mark.parametrize(
    "number",
    [
        b"123456789012345678901234567890",
        b"-9223372036854775809",  # below -2**63, in 19 digits
        b"-18446744073709551617",
    ],
)
def test_an_integer_beyond_64_bits_stays_exact_in_an_event_that_is_rewritten(number):
    wire = (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],'
        b'"seed_used":' + number + b',"kv_transfer_params":{"x":1}}\n\n'
    )
    out, decoded = relay(wire, [], general=False, strip=False)
    assert b'"seed_used":' + number + b"}" in out
    assert b"kv_transfer_params" not in out and decoded.params == {"x": 1}


class _CutAfter:
    """D's stream as the relay reads it: these chunks, then the watch's cut (the client went)."""

    instance = None

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks
        self.closed = False

    def chunks(self):
        yield from self._chunks
        raise ClientGone("the client left")

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    "last, outcome",
    [(b"data: [DONE]\n\n", "completed"), (b'data: {"choices":[]}\n\n', "client_gone")],
)
def test_a_client_that_leaves_after_done_had_a_completed_turn(last, outcome):
    """The OpenAI SDK closes its response at [DONE]; the watch then cuts D's stream before its
    last bytes. The turn completed (logged so, no disconnect counted); before [DONE], it did not."""
    from prometheus_client import REGISTRY

    from gateway.engines.instances import Pool
    from gateway.flow.reply import StreamRelay

    def disconnects() -> float:
        return REGISTRY.get_sample_value("pd_gateway_client_disconnects_total") or 0.0

    def ends() -> float:  # the turns the e2e histogram timed
        return (
            REGISTRY.get_sample_value(
                "pd_gateway_e2e_request_latency_seconds_count", {"model": "unknown"}
            )
            or 0.0
        )

    pool = Pool("decode", ["http://127.0.0.3:8200"])
    decode = pool.instances[0]
    pool.acquire(decode)
    logged = []
    stream = _CutAfter([b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', last])
    relay = StreamRelay(
        stream,
        Decoded(),
        decode,
        pool,
        0.0,
        "unknown",
        lambda: None,
        lambda ttft, outcome: logged.append(outcome),
    )
    before, timed = disconnects(), ends()
    sent = b"".join(relay.chunks())
    assert sent.endswith(last) and stream.closed and decode.inflight == 0
    assert logged == [outcome]
    assert disconnects() - before == (outcome == "client_gone")
    assert ends() - timed == (outcome == "completed")  # timed to its [DONE]
