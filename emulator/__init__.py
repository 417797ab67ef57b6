"""Emulated vLLM prefill/decode engines for the demo, the tests and the benchmarks."""
