"""gunicorn config for growth runs: the gateway's own config, plus a store filled at worker
start."""

from gateway.standalone_conf import *  # noqa: F401,F403  (first: it monkey-patches under gevent)

# isort: split

import os  # noqa: E402

from devtools.fill import FILL_ENV, fill  # noqa: E402
from gateway.config import Settings  # noqa: E402


def post_worker_init(worker):
    # Straight into the worker's store: 100k real turns would outlast the whole benchmark.
    count = int(os.environ.get(FILL_ENV, "0"))
    fill(worker.wsgi.extensions["pd_gateway"].gateway.store, count, Settings.from_env().decode[0])
    worker.log.info("bench: filled the store with %d entries", count)
