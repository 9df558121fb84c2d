"""The engine's memory: the block manager (``blocks``), the K/V tensors (``kv_pool``), the paged KV cache that
joins them (``cache``), fp8 encoding (``fp8``), prefix caching (``prefix_cache``: chained block keys;
``radix_cache``: SGLang's tree), the request and the step scheduler (paged only: notebook 07's slab policies
and sliding windows are in ``sim``), and the one door to K/V outside the pool, the KV connector contract
(``connector``; its implementations are in ``kv_transfer``). It imports nothing above it: no file store,
no child process, no ``sim``, ``teach`` or ``bench``."""
