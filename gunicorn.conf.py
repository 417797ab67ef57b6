# gunicorn configuration for pd-gateway (`gunicorn -c gunicorn.conf.py`).
# The settings live in the package so the installed `pd-gateway` command uses the same file;
# every value comes from the GATEWAY_* environment (see README "Settings").
from gateway.standalone_conf import *  # noqa: F401,F403
