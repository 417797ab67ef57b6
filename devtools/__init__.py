"""Development tooling shared by tests, benchmarks, the load test and the demo; never installed."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
