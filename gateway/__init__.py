"""pd-gateway: a WSGI gateway for vLLM disaggregated prefill/decode with multi-turn KV reuse."""

from importlib.metadata import PackageNotFoundError, version

try:
    # The installed package's metadata, which setup.cfg's `version` writes: one place to bump.
    __version__ = version("pd-gateway")
except PackageNotFoundError:  # a checkout used without installing it
    __version__ = "0+unknown"
