"""vLLM's other routes on the emulator, in vLLM 0.33.0's shapes (emulator/other_routes.py cites
each): deterministic values, the model checked, faults suffered as a completion suffers them."""

from __future__ import annotations

import base64
import io
import struct

import pytest

from emulator.other_routes import EMBEDDING_SIZE, vector
from emulator.tokens import VOCAB, token_id


def test_embeddings_are_deterministic_unit_vectors_in_floats_or_base64(make_api):
    api = make_api(model="m")
    floats = api.post("/v1/embeddings", {"model": "m", "input": ["alpha bravo", "charlie"]}).json
    assert floats["object"] == "list" and floats["model"] == "m"
    assert [d["index"] for d in floats["data"]] == [0, 1]
    first = floats["data"][0]["embedding"]
    assert len(first) == EMBEDDING_SIZE and abs(sum(x * x for x in first) - 1) < 1e-4
    assert first == vector("alpha bravo")
    assert floats["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 3,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    packed = api.post(
        "/v1/embeddings", {"input": "alpha bravo", "encoding_format": "base64", "dimensions": 4}
    ).json["data"][0]["embedding"]
    assert list(struct.unpack("=4f", base64.b64decode(packed))) == pytest.approx(first[:4])
    assert api.engine.stats.other_requests == 2


def test_pooling_score_and_rerank(make_api):
    api = make_api()
    pooled = api.post("/pooling", {"input": "alpha"}).json
    assert pooled["data"] == [{"index": 0, "object": "pooling", "data": vector("alpha")}]
    scores = api.post("/score", {"queries": "alpha", "documents": ["alpha", "zulu"]}).json
    assert [d["object"] for d in scores["data"]] == ["score", "score"]
    assert scores["data"][0]["score"] == 1.0  # an input against itself
    again = api.post("/v1/score", {"text_1": "alpha", "text_2": ["alpha", "zulu"]}).json
    assert [d["score"] for d in again["data"]] == [d["score"] for d in scores["data"]]
    ranked = api.post(
        "/v2/rerank", {"query": "alpha", "documents": ["zulu", "alpha"], "top_n": 1}
    ).json
    assert ranked["results"] == [
        {"index": 1, "document": {"text": "alpha", "multi_modal": None}, "relevance_score": 1.0}
    ]
    assert ranked["usage"] == {"prompt_tokens": 4, "total_tokens": 4}


def test_detokenize_and_ping(make_api):
    api = make_api()
    ids = [token_id(VOCAB[0]), token_id(VOCAB[1])]
    assert api.post("/detokenize", {"tokens": ids}).json == {"prompt": f"{VOCAB[0]} {VOCAB[1]}"}
    unknown = api.post("/detokenize", {"tokens": [7]})
    assert unknown.status_code == 400 and unknown.json["error"]["param"] == "tokens"
    assert api.client.get("/ping").status_code == 200
    api.engine.faults.set(api.engine.faults.current.__class__(mode="down"))
    assert api.client.post("/ping").status_code == 503


def test_transcription_as_json_and_as_a_stream(make_api, sse):
    api = make_api(model="whisper")
    form = {"model": "whisper", "file": (io.BytesIO(b"\0" * 64000), "a.wav")}
    reply = api.client.post("/v1/audio/transcriptions", data=form)
    assert reply.status_code == 200, reply.json
    assert len(reply.json["text"].split()) == 6
    assert reply.json["usage"] == {"type": "duration", "seconds": 2}
    form = {"model": "whisper", "stream": "true", "file": (io.BytesIO(b"\0" * 64000), "a.wav")}
    streamed = api.client.post("/v1/audio/translations", data=form)
    assert streamed.content_type.startswith("text/event-stream")
    events = sse(streamed.get_data())
    assert events[-1] == "[DONE]" and {e["object"] for e in events[:-1]} == {"translation.chunk"}
    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == reply.json["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    wrong = api.client.post(
        "/v1/audio/transcriptions", data={"model": "x", "file": (io.BytesIO(b"1"), "a.wav")}
    )
    assert wrong.status_code == 404


@pytest.mark.parametrize("mode,status", [("down", 503), ("error500", 500)])
def test_the_other_routes_suffer_the_engines_faults(make_api, mode, status):
    api = make_api()
    api.client.post("/faults", json={"mode": mode, "count": 1})
    assert api.post("/v1/embeddings", {"input": "x"}).status_code == status
    assert api.post("/v1/embeddings", {"input": "x"}).status_code == 200
