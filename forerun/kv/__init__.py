"""KV caches: the contiguous per-row cache (cache.py), the paged pool (paged.py, kv/blocks.py), and the protocol both keep (protocol.py)."""
