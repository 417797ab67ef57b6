"""gunicorn config for `bench.profile --calls`: the gateway's own config, plus cProfile in the
worker from its start to its exit (the stats file: $BENCH_CPROFILE). Function call counts per
turn are exact; cProfile's times are not (greenlet switches and its own overhead)."""

from gateway.standalone_conf import *  # noqa: F401,F403  (first: it monkey-patches under gevent)

# isort: split

import cProfile  # noqa: E402
import os  # noqa: E402

from gateway.gunicorn_conf import HOOKS, install  # noqa: E402

CPROFILE_ENV = "BENCH_CPROFILE"  # as bench.profile sets it

# The gateway's hooks as its config installed them, taken out, to be installed again (below)
# with this file's own chained after them: a hook set after install() would replace the
# gateway's, which the gateway refuses to start with.
for _name in HOOKS:
    globals().pop(_name, None)


def post_worker_init(worker):
    worker.bench_profile = cProfile.Profile()
    worker.bench_profile.enable()


def worker_exit(server, worker):
    worker.bench_profile.disable()
    worker.bench_profile.dump_stats(os.environ[CPROFILE_ENV])


install(globals())
