"""The engine's memory: the block manager (``blocks``), the K/V tensors (``kv_pool``), the paged KV cache that
joins them (``cache``), prefix caching, sliding windows and the step scheduler. It imports nothing from
``sim``, ``teach`` or ``bench``."""
