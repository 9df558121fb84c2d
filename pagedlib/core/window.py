"""Sliding windows (notebook 07): with a window of ``w`` positions (Mistral 7B: 4096) a block wholly before
the window of a sequence's newest token is never seen again, so it goes back to the free stack."""

from __future__ import annotations

from collections.abc import Hashable

from pagedlib.core.cache import PagedKVCache
from pagedlib.util import as_int


def release_outside_window(cache: PagedKVCache, seq_id: Hashable, window: int) -> int:
    """Give back the leading blocks of ``seq_id`` wholly before the window of its newest token. Returns the
    number of positions released (a multiple of ``block_size``)."""
    window = as_int("window", window, minimum=1)
    dead = max(0, cache.seq_lens[seq_id] - window) // cache.block_size  # KeyError for an unknown sequence
    return len(cache.release_leading_blocks(seq_id, dead)) * cache.block_size if dead else 0
