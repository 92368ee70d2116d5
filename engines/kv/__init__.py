"""KV management: the block pool, token ids and block keys, prefix indexes (block hash,
radix, none), the paged / bounded / slab managers and ``protocol.py``, the contract the
scheduler uses. Tensor-free (``eviction.py``, the bounded caches' policy, excepted).
"""
