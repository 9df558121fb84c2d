"""The engine's memory: the paged KV cache, prefix caching, sliding windows and the step scheduler.

Nothing here imports ``sim``, ``teach`` or ``bench``."""
