"""The design's floor: the barest Flask relay of one engine, under gunicorn as the gateway runs.

One view for POST /v1/chat/completions and /v1/completions: the client's body goes as it came to
ONE upstream (the emulated D; `FLASK_RELAY_UPSTREAM`, e.g. http://127.0.0.3:8200) through a
module-level, pooled `requests.Session` with `stream=True`, and D's reply comes back as it
arrives: `iter_content(None)` as a streamed Flask response (urllib3 hands over each HTTP chunk of
D's chunked reply as it comes; a reply that is not a stream is relayed whole). No P call, no
conversation, no parsing, no metrics: what Flask + gunicorn (gevent) + requests cost for one
relayed turn, the floor pd-gateway's own CPU per turn is read against (bench.turn_budget).

The session is set up as any careful relay's would be, so the floor is not padded with costs
that are one line to avoid: a pool as large as the worker's connections (requests' default of
10 would open a new connection for every stream beyond ten), and no proxy or .netrc lookup per
call (`trust_env = False`).

    FLASK_RELAY_UPSTREAM=http://127.0.0.3:8200 .venv/bin/python -m gunicorn \\
        --worker-class gevent --workers 1 --worker-connections 2000 bench.flask_relay:app

With `FLASK_RELAY_PREFILL` set (an engine's URL), it is the barest P/D relay instead: the
client's JSON parsed, sent to that P with `max_tokens` 1, not streamed and vLLM's first-turn
`kv_transfer_params` stub (what the seed proxy sends every P; docs: ../shared/reference/
vllm-pd-protocol.md), P's reply parsed, and the client's body with P's `kv_transfer_params` sent
to D and relayed as above. One P call and one D stream a turn, nothing kept: what any P/D proxy
on Flask + gunicorn + requests must do for a turn, a second floor for pd-gateway (which does the
same calls, plus its conversation, its checks and its metrics).

bench.systems starts it so (kind "flask"; option "prefill" for the P/D relay).
"""

from __future__ import annotations

import json
import os

import requests
from flask import Flask, Response, request
from requests.adapters import HTTPAdapter

UPSTREAM_ENV = "FLASK_RELAY_UPSTREAM"
PREFILL_ENV = "FLASK_RELAY_PREFILL"
POOL_ENV = "FLASK_RELAY_POOL"  # connections kept per upstream; the worker's connections

if not os.environ.get(UPSTREAM_ENV):
    raise SystemExit(f"bench.flask_relay: set {UPSTREAM_ENV} to the engine's URL")
UPSTREAM = os.environ[UPSTREAM_ENV].rstrip("/")
PREFILL = os.environ.get(PREFILL_ENV, "").rstrip("/")
# vLLM's P/D stub for a prefill (NixlConnector), written out rather than imported from the
# gateway (gateway.reuse.kv_params.MISS_PARAMS): a floor shares no code with what it measures.
FIRST_TURN = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
session = requests.Session()
session.trust_env = False
session.mount(
    "http://", HTTPAdapter(pool_maxsize=int(os.environ.get(POOL_ENV, "2000")), max_retries=0)
)

app = Flask(__name__)


@app.post("/v1/chat/completions")
@app.post("/v1/completions")
def relay() -> Response:
    data = request.get_data()
    if PREFILL:
        body = json.loads(data)
        prefill = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": FIRST_TURN}
        for field in ("stream_options", "max_completion_tokens", "min_tokens"):
            prefill.pop(field, None)  # as the seed proxy: one token from P, whatever was asked
        answer = session.post(PREFILL + request.path, json=prefill, timeout=(5, 600))
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, content_type="application/json")
        body["kv_transfer_params"] = answer.json().get("kv_transfer_params")
        data = json.dumps(body).encode()
    upstream = session.post(
        UPSTREAM + request.path,
        data=data,
        headers={"Content-Type": "application/json"},
        stream=True,
        timeout=(5, 600),
    )
    kind = upstream.headers.get("Content-Type", "application/json")
    if not kind.startswith("text/event-stream"):
        return Response(upstream.content, upstream.status_code, content_type=kind)

    def chunks():
        try:
            yield from upstream.iter_content(None)
        finally:
            upstream.close()

    return Response(chunks(), upstream.status_code, content_type=kind)


@app.get("/health")
def health() -> str:
    return "ok"
