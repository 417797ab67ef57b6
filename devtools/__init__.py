"""Development tooling shared by tests, benchmarks, the load test and the demo; never installed."""
