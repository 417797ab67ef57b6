"""Benchmark harness: pd-gateway beside the seed proxy over shared emulated engines."""
