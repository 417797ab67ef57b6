"""pd-gateway: a WSGI gateway for vLLM disaggregated prefill/decode with multi-turn KV reuse."""
