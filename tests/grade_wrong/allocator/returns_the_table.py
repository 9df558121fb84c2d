"""Catches: append and free_sequence return new lists: changing one changes nothing in the allocator

A sequence's first append makes the list of blocks it returns the table itself, so the caller's list and
the block table are one list: adding to either changes both."""

class BlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables = {}
        self.seq_lens = {}

    @property
    def num_free_blocks(self):
        return len(self.free)

    def add_sequence(self, seq_id):
        self.tables[seq_id] = []
        self.seq_lens[seq_id] = 0

    def append(self, seq_id, num_tokens=1):
        length = self.seq_lens[seq_id] + num_tokens
        needed = -(-length // self.block_size) - len(self.tables[seq_id])
        if needed > len(self.free):
            raise RuntimeError(f"out of blocks: {needed} needed, {len(self.free)} free")
        new = [self.free.pop() for _ in range(needed)]
        if self.tables[seq_id]:
            self.tables[seq_id] += new
        else:
            self.tables[seq_id] = new
        self.seq_lens[seq_id] = length
        return new

    def free_sequence(self, seq_id):
        table = self.tables.pop(seq_id)
        del self.seq_lens[seq_id]
        self.free.extend(table)
        return table
