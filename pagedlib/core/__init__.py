"""The engine's memory: the block manager (``blocks``), the K/V tensors (``kv_pool``), the paged KV cache that
joins them (``cache``), prefix caching, the request and the step scheduler (paged only: notebook 07's slab
policies and sliding windows are in ``sim``). It imports nothing from
``sim``, ``teach`` or ``bench``."""
