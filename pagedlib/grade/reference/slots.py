"""pagedlib's answer to task ``slots``: a ``PagedKVCache`` whose sequence 0 holds the block table (its free
stack arranged with ``free_order``, notebook 02 section 3), read through ``BlockManager.slots`` and
``PagedKVCache.slot``, behind the task's signatures."""

from functools import lru_cache

import torch

from pagedlib.core.cache import PagedKVCache, Slot


@lru_cache(maxsize=64)
def holding(block_table, block_size):
    """A cache whose sequence 0 holds ``block_table`` (a tuple), every slot written."""
    cache = PagedKVCache(max(block_table, default=0) + 1, 1, block_size, 1, 1, free_order=block_table)
    cache.add_sequence(0)
    kv = torch.zeros(1, len(block_table) * block_size, 1, 1)
    cache.append_tokens(0, kv, kv)
    return cache


def slot_of(block_table, block_size, position):
    cache = holding(tuple(block_table), block_size)
    cache.slot(0, position)                   # pagedlib's IndexError for a position the table does not hold
    return cache.manager.slots(0)[position]


def slot_mapping(block_table, block_size, start, stop):
    return [slot_of(block_table, block_size, position) for position in range(start, stop)]


def block_and_offset(slot, block_size):
    return tuple(Slot(*divmod(slot, block_size)))     # as PagedKVCache.append_token splits a slot id
