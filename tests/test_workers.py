"""The gateway's gunicorn workers (gateway/workers.py): what each does once its app is loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Run in a fresh interpreter: the collector's settings are the process's own.
_LOADED = """
import gc, sys
import gunicorn.workers.base
from gateway import workers

kept = []
def load_wsgi(self):                 # gunicorn's: imports the app (here: makes containers)
    kept.extend([[] for _ in range(5000)])
gunicorn.workers.base.Worker.load_wsgi = load_wsgi
gc.set_threshold(*map(int, sys.argv[2].split(",")))
getattr(workers, sys.argv[1]).load_wsgi(object.__new__(getattr(workers, sys.argv[1])))
walked = {id(o) for o in gc.get_objects()}       # what collections still walk: not the frozen
print(all(gc.is_tracked(o) and id(o) not in walked for o in kept), *gc.get_threshold())
"""


@pytest.mark.processes
@pytest.mark.parametrize("worker", ["GeventWorker", "ThreadWorker"])
@pytest.mark.parametrize(
    "before, after",
    [
        ("700,10,10", "True 10000 10 10"),
        ("50000,5,5", "True 50000 5 5"),
        ("0,10,10", "True 0 10 10"),
    ],
)
def test_a_worker_freezes_what_it_loaded_and_collects_the_young_less_often(worker, before, after):
    """After gunicorn loads the app, the worker's objects are frozen (no collection walks them
    again) and the young generation waits for `GC_YOUNG` new containers, never fewer than the
    interpreter was told; collection turned off (0) stays off."""
    out = subprocess.run(
        [sys.executable, "-c", _LOADED, worker, before],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert out == after


@pytest.mark.parametrize(
    "body, until",
    [
        (b"5\r\nhello\r\n0\r\n\r\n", -1),  # whole
        (b"5\r\nhel", 0),  # a chunk not whole: its size line again
        (b"2\r\n\r\n\r\n", 7),  # data that ends as a body does: not whole
        (b"5\r\nhello\r\n0\r\n", 10),  # the last chunk, its trailers not in
        (b"5\r\nhello\r\n0\r\nX: y\r\n\r\n", -1),  # trailers in
        (b"5;ext=1\r\nhello\r\n0\r\n\r\n", -1),  # a chunk extension
        (b"zz\r\n", -1),
        (b"-5\r\nab", -1),  # not chunked as it says: the parser's
    ],
)
def test_the_gthread_loop_walks_a_chunked_body_chunk_by_chunk(body, until):
    from gateway.workers import _chunks_end

    assert _chunks_end(bytearray(body), 0) == until
