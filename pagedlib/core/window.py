"""Sliding-window attention on the paged cache (notebook 07).

With a sliding window of ``w`` positions (Mistral 7B uses w = 4096), the token at position ``i`` attends
to positions ``i - w + 1 .. i`` only. Paging composes with it: once a whole block lies before the window
of a sequence's newest token, no later token can see it either, so the block goes back to the free stack
and the sequence holds at most ``ceil(w / block_size) + 1`` blocks however long it grows.

The cache then holds the sequence's tokens from a block boundary on: its ``seq_lens`` counts the tokens
still held and ``tables`` starts at the first block still held. The caller keeps the position of the
first held token (the number of positions released) where it needs it, e.g. for rotary embeddings.
"""

from __future__ import annotations

from collections.abc import Hashable

from pagedlib.checks import as_int
from pagedlib.core.cache import PagedKVCache

__all__ = ["release_outside_window"]


def release_outside_window(cache: PagedKVCache, seq_id: Hashable, window: int) -> int:
    """Give back the leading blocks of ``seq_id`` that lie wholly before the window of its newest token.

    Returns the number of token positions released (a multiple of ``block_size``; 0 if none)."""
    window = as_int("window", window, minimum=1)
    held = cache.seq_lens[seq_id]             # KeyError for an unknown sequence, before any change
    dead = max(0, held - window) // cache.block_size
    if dead:
        cache.release_leading_blocks(seq_id, dead)
    return dead * cache.block_size

