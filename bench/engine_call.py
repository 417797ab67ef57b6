"""What one engine call costs the gateway's process: client CPU per P call (a non-streamed chat
completion to an emulated P), several at once in one gevent process, three ways, alternating:

- `gateway`: `Upstream.post_json`, as a turn's P call (the gateway's own http.client pool,
  gateway/engines/transport.py);
- `urllib3`: the same body through a plain urllib3 pool's `urlopen` (what the adapter used to run);
- `http.client`: one kept-alive http.client connection per greenlet, nothing around it.

    .venv/bin/python -m bench.engine_call [--calls 1600] [--concurrency 8] [--repeats 5]

Prints the median and every repeat, µs of CPU (user + system, this process) per call.
"""

from __future__ import annotations

from gevent import monkey

monkey.patch_all()

import argparse  # noqa: E402
import http.client  # noqa: E402
import resource  # noqa: E402

import gevent  # noqa: E402
import urllib3  # noqa: E402

from bench.systems import Engines  # noqa: E402
from gateway.engines.instances import Instance  # noqa: E402
from gateway.engines.upstream import Upstream  # noqa: E402
from gateway.support import jsonio  # noqa: E402

PATH = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 1, "stream": False}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ways(url: str) -> dict:
    upstream = Upstream(5, 30, pool_size=64)
    instance = Instance(url, "prefill", 0)
    headers = upstream.headers("bench", None)
    host, port = url.split("//")[1].split(":")
    pool = urllib3.HTTPConnectionPool(host, int(port), maxsize=64)
    connections: dict = {}

    def gateway() -> None:
        upstream.post_json(instance, PATH, BODY, headers)

    def plain_urllib3() -> None:
        reply = pool.urlopen(
            "POST",
            PATH,
            body=jsonio.dumps(BODY),
            headers={**headers, "Content-Type": "application/json"},
            retries=False,
            timeout=urllib3.Timeout(connect=5, read=30),
        )
        jsonio.loads_engine(reply.data)

    def plain_http_client() -> None:
        connection = connections.get(gevent.getcurrent())
        if connection is None:
            connection = connections[gevent.getcurrent()] = http.client.HTTPConnection(
                host, int(port), timeout=30
            )
        body = jsonio.dumps(BODY)
        connection.request(
            "POST",
            PATH,
            body=body,
            headers={
                **headers,
                "Content-Type": "application/json",
                "Content-Length": str(len(body)),
            },
        )
        jsonio.loads_engine(connection.getresponse().read())

    return {"gateway": gateway, "urllib3": plain_urllib3, "http.client": plain_http_client}


def cpu_per_call(call, calls: int, concurrency: int) -> float:
    def worker() -> None:
        for _ in range(calls // concurrency):
            call()

    started = _cpu()
    gevent.joinall([gevent.spawn(worker) for _ in range(concurrency)], raise_error=True)
    return (_cpu() - started) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    engines = Engines.start(itl_ms=1, prefill_ms_per_token=0.0)
    try:
        calls = ways(engines.prefill.url)
        for call in calls.values():  # connections made, code warm
            cpu_per_call(call, 200, args.concurrency)
        figures: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                figures[name].append(cpu_per_call(call, args.calls, args.concurrency))
        for name, values in figures.items():
            values.sort()
            print(
                f"{name:12s} {values[len(values) // 2]:6.1f} us of CPU a call (median; "
                f"{', '.join(f'{v:.0f}' for v in values)})"
            )
    finally:
        engines.stop()


if __name__ == "__main__":
    main()
