"""pagedlib's answer to task ``allocator``: notebook 02's ``PagedKVCache`` behind the task's class, with one
number per slot (the task keeps no K/V: only the cache's bookkeeping is read)."""

import torch

from pagedlib.core.cache import PagedKVCache


class BlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.cache = PagedKVCache(num_blocks, num_layers=1, block_size=block_size, kv_heads=1, head_dim=1)
        self.free, self.tables, self.seq_lens = self.cache.free, self.cache.tables, self.cache.seq_lens

    @property
    def num_free_blocks(self):
        return self.cache.num_free_blocks

    def add_sequence(self, seq_id):
        self.cache.add_sequence(seq_id)

    def append(self, seq_id, num_tokens=1):
        kv = torch.zeros(1, num_tokens, 1, 1)           # [num_layers, num_tokens, kv_heads, head_dim]
        return self.cache.append_tokens(seq_id, kv, kv)

    def free_sequence(self, seq_id):
        return self.cache.free_sequence(seq_id)
