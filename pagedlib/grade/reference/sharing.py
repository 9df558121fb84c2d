"""pagedlib's answer to task ``sharing``: ``core.blocks.BlockManager`` (share, fork, copy_on_write,
release) and ``core.prefix_cache.chained_keys`` behind the task's signatures."""

from pagedlib.core.blocks import BlockManager
from pagedlib.core.prefix_cache import chained_keys


class SharedBlocks:
    def __init__(self, num_blocks, block_size):
        self.manager = BlockManager(num_blocks, block_size)

    free = property(lambda self: self.manager.free)
    ref_counts = property(lambda self: self.manager.ref_counts)
    tables = property(lambda self: self.manager.tables)
    seq_lens = property(lambda self: self.manager.seq_lens)

    def add_sequence(self, seq_id):
        self.manager.add_sequence(seq_id)

    def append(self, seq_id, n):
        record = self.manager.reserve([seq_id], [n])      # out of blocks: OutOfBlocksError, a RuntimeError
        return record.copies[0] if record.copies else None

    def fork(self, parent_id, child_id):
        self.manager.fork(parent_id, child_id)

    def free_sequence(self, seq_id):
        return self.manager.free_sequence(seq_id)


def block_keys(token_ids, block_size):
    return [key.digest for key in chained_keys(token_ids, block_size)]
