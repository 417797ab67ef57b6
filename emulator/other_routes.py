"""vLLM's routes besides completions, in their minimal shapes: /detokenize, /ping, the pooling
routes (embeddings, pooling, score, rerank) and the audio ones (transcriptions, translations).

What a gateway passes through to an engine as it is; the values are deterministic fakes (an
embedding is a digest of its text), the shapes are vLLM 0.33.0's, each cited where it is made.
A real engine serves the pooling routes only for a pooling model and the audio ones only for a
speech model (vllm/entrypoints/launchers/api_server/routers.py L73-85); the emulator serves
them all, for any model.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from operator import itemgetter

from flask import Flask, Response, request

from .engine import Engine
from .errors import BadRequest, InternalError, Unavailable
from .protocol import DONE, ValidationError, check_model, dumps
from .protocol import json_body as parse_json
from .tokens import VOCAB, token_id

EMBEDDING_SIZE = 16  # the emulated model's hidden size: what `dimensions` may shorten
SSE = "text/event-stream; charset=utf-8"
_BY_ID = {token_id(word): word for word in VOCAB}  # /detokenize's vocabulary


def _json(payload: object, status: int = 200) -> Response:
    return Response(dumps(payload), status=status, content_type="application/json")


def _usage(prompt_tokens: int) -> dict:
    """vLLM's UsageInfo for a pooling request (vllm/entrypoints/serve/engine/protocol.py
    L135-140; pooling/utils.py get_pooling_usage: no completion)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _items(value: object, name: str) -> list[object]:
    """One input or a batch of them: a string, a list of strings, token ids or lists of ids
    (vllm/entrypoints/pooling/base/protocol.py L212-214)."""
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(i, int) for i in value)
    ):
        return [value]
    if isinstance(value, list) and value and all(isinstance(i, (str, list)) for i in value):
        return list(value)
    raise ValidationError(name, "must be a string, a list of strings or of token ids")


def _tokens(item: object) -> int:
    """The prompt tokens of one input: its words (the emulator's tokenizer), or its ids."""
    return len(item) if isinstance(item, list) else len(str(item).split())


def vector(item: object, size: int = EMBEDDING_SIZE) -> list[float]:
    """A deterministic unit vector for one input (a pooling model normalizes its embeddings)."""
    digest = hashlib.blake2b(dumps(item), digest_size=size).digest()
    raw = [byte - 127.5 for byte in digest]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def _similarity(first: object, second: object) -> float:
    """A score in (0, 1): the two inputs' cosine, moved there."""
    return round(
        (1 + sum(a * b for a, b in zip(vector(first), vector(second), strict=True))) / 2, 6
    )


def add_routes(app: Flask, engine: Engine) -> None:
    """Register the routes on the engine's app."""
    cfg, stats = engine.config, engine.stats

    def begin() -> None:
        """Count the request and suffer the engine's fault, as a completion does (down and
        error500 fail it, slow delays it)."""
        stats.other_requests += 1
        fault = engine.faults.take()
        if fault.mode in ("down", "error500"):
            stats.fault_responses += 1
            raise (Unavailable if fault.mode == "down" else InternalError)(
                f"emulated fault: {fault.mode}"
            )
        if fault.mode == "slow":
            engine.sleep(fault.delay_s)

    def json_body() -> dict:
        body = parse_json(request.get_data())
        check_model(body, cfg.model)
        return body

    @app.route("/ping", methods=["GET", "POST"])
    def ping() -> Response:
        """SageMaker's health check: vLLM's /health under another name
        (vllm/entrypoints/serve/sagemaker/api_router.py L91-96)."""
        return Response(b"", status=503 if engine.faults.down else 200)

    @app.post("/detokenize")
    def detokenize() -> Response:
        """vllm/entrypoints/serve/tokenize/protocol.py L189-205: {"tokens": [...]} to
        {"prompt": "..."}; an id outside the vocabulary is a 400 (renderers/base.py ~L456)."""
        begin()
        tokens = json_body().get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValidationError("tokens", "must be a list of token ids")
        unknown = [t for t in tokens if t not in _BY_ID]
        if unknown:
            raise BadRequest(f"Token id {unknown[0]} is out of vocabulary", "tokens")
        return _json({"prompt": " ".join(_BY_ID[t] for t in tokens)})

    @app.post("/v1/embeddings")
    def embeddings() -> Response:
        """vllm/entrypoints/pooling/embed/protocol.py L174-186 (EmbeddingResponse), each
        embedding floats or, with encoding_format base64 (the OpenAI SDK's default), float32
        bytes in base64 (pooling/utils.py L86-92; embed_dtype float32, native endianness)."""
        begin()
        body = json_body()
        items = _items(body.get("input"), "input")
        size = body.get("dimensions") or EMBEDDING_SIZE
        if not isinstance(size, int) or not 0 < size <= EMBEDDING_SIZE:
            raise BadRequest(f"dimensions must be 1..{EMBEDDING_SIZE} for this model", "dimensions")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ValidationError(
                "encoding_format", "must be float or base64 (bytes are not emulated)"
            )
        data = []
        for index, item in enumerate(items):
            values = vector(item)[:size]
            embedding: object = (
                values
                if encoding == "float"
                else base64.b64encode(struct.pack(f"={len(values)}f", *values)).decode()
            )
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        return _json(
            {
                "id": f"embd-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": cfg.model,
                "data": data,
                "usage": _usage(sum(map(_tokens, items))),
            }
        )

    @app.post("/pooling")
    def pooling() -> Response:
        """vllm/entrypoints/pooling/pooling/protocol.py L102-114 (PoolingResponse)."""
        begin()
        items = _items(json_body().get("input"), "input")
        return _json(
            {
                "id": f"pool-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": cfg.model,
                "data": [
                    {"index": i, "object": "pooling", "data": vector(item)}
                    for i, item in enumerate(items)
                ],
                "usage": _usage(sum(map(_tokens, items))),
            }
        )

    def score() -> Response:
        """vllm/entrypoints/pooling/scoring/protocol.py L84-135 (queries/documents, or
        data_1/data_2, text_1/text_2, queries/items), L172-184 (ScoreResponse): one score a
        pair, a single first input against each of the second."""
        begin()
        body = json_body()
        for first_name, second_name in (
            ("queries", "documents"),
            ("queries", "items"),
            ("data_1", "data_2"),
            ("text_1", "text_2"),
        ):
            if first_name in body and second_name in body:
                break
        else:
            raise ValidationError("queries", "Field required (with documents)")
        firsts = _items(body[first_name], first_name)
        seconds = _items(body[second_name], second_name)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise BadRequest("the two inputs must pair one to one, or the first be one input")
        return _json(
            {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "created": int(time.time()),
                "model": cfg.model,
                "data": [
                    {"index": i, "object": "score", "score": _similarity(a, b)}
                    for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
                ],
                "usage": _usage(sum(map(_tokens, firsts + seconds))),
            }
        )

    def rerank() -> Response:
        """vllm/entrypoints/pooling/scoring/protocol.py L138-169 (RerankRequest, RerankResponse);
        serving.py L141-189: by relevance, highest first, the first top_n if set."""
        begin()
        body = json_body()
        query = body.get("query")
        documents = _items(body.get("documents"), "documents")
        if not isinstance(query, str):
            raise ValidationError("query", "must be a string")
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or top_n < 0:
            raise ValidationError("top_n", "must be an integer >= 0")
        results = sorted(
            (
                {
                    "index": i,
                    "document": {"text": d, "multi_modal": None},
                    "relevance_score": _similarity(query, d),
                }
                for i, d in enumerate(documents)
            ),
            key=itemgetter("relevance_score"),
            reverse=True,
        )
        tokens = _tokens(query) * len(documents) + sum(map(_tokens, documents))
        return _json(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": cfg.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "results": results[: top_n or len(results)],
            }
        )

    # vllm/entrypoints/pooling/scoring/api_router.py L37-115.
    for path in ("/score", "/v1/score"):
        app.add_url_rule(path, f"score {path}", score, methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_url_rule(path, f"rerank {path}", rerank, methods=["POST"])

    def audio(kind: str) -> Response:
        """vllm/entrypoints/speech_to_text/{transcription,translation}/api_router.py L31-64: a
        multipart form (file, model, stream, ...); the text as {"text", "usage"}
        (transcription/protocol.py L326-334), or streamed as `<kind>.chunk` events and [DONE]
        (base/serving.py L715-846)."""
        begin()
        if "file" not in request.files:
            raise ValidationError("file", "Field required")
        check_model({"model": request.form.get("model")}, cfg.model)
        audio_bytes = len(request.files["file"].read())
        words = [
            VOCAB[b % len(VOCAB)]
            for b in hashlib.blake2b(str(audio_bytes).encode(), digest_size=6).digest()
        ]
        seconds = max(1, audio_bytes // 32000)  # 16 kHz, 16-bit mono
        if request.form.get("stream", "false").lower() != "true":
            text = " ".join(words)
            return _json(
                {"text": text}
                if kind == "translation"
                else {"text": text, "usage": {"type": "duration", "seconds": seconds}}
            )
        head = {
            "id": f"{kind[:4]}-{uuid.uuid4().hex}",
            "object": f"{kind}.chunk",
            "created": int(time.time()),
            "model": cfg.model,
        }
        itl = cfg.itl_ms / 1000.0
        return Response(_audio_stream(head, words, lambda: engine.sleep(itl)), content_type=SSE)

    @app.post("/v1/audio/transcriptions")
    def transcriptions() -> Response:
        return audio("transcription")

    @app.post("/v1/audio/translations")
    def translations() -> Response:
        return audio("translation")


def _audio_stream(head: dict, words: list[str], wait: Callable[[], None]) -> Iterator[bytes]:
    for i, word in enumerate(words):
        if i:
            wait()
        last = i == len(words) - 1
        choice = {
            "delta": {"content": word if i == 0 else " " + word},
            **({"finish_reason": "stop", "stop_reason": None} if last else {}),
        }
        yield b"data: " + dumps({**head, "choices": [choice]}) + b"\n\n"
    yield DONE
