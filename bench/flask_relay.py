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

bench.systems starts it so (kind "flask").
"""

from __future__ import annotations

import os

import requests
from flask import Flask, Response, request
from requests.adapters import HTTPAdapter

UPSTREAM_ENV = "FLASK_RELAY_UPSTREAM"
POOL_ENV = "FLASK_RELAY_POOL"  # connections kept per upstream; the worker's connections

if not os.environ.get(UPSTREAM_ENV):
    raise SystemExit(f"bench.flask_relay: set {UPSTREAM_ENV} to the engine's URL")
UPSTREAM = os.environ[UPSTREAM_ENV].rstrip("/")
session = requests.Session()
session.trust_env = False
session.mount(
    "http://", HTTPAdapter(pool_maxsize=int(os.environ.get(POOL_ENV, "2000")), max_retries=0)
)

app = Flask(__name__)


@app.post("/v1/chat/completions")
@app.post("/v1/completions")
def relay() -> Response:
    upstream = session.post(
        UPSTREAM + request.path,
        data=request.get_data(),
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
