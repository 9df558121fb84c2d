"""Catches: an append that does not fit raises RuntimeError and changes nothing

Takes blocks one by one and raises only when the stack runs dry: the blocks it took stay in the table."""


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
        table = self.tables[seq_id]
        length = self.seq_lens[seq_id] + num_tokens
        new = []
        while len(table) * self.block_size < length:
            if not self.free:
                raise RuntimeError("out of blocks")
            new.append(self.free.pop())
            table.append(new[-1])
        self.seq_lens[seq_id] = length
        return new

    def free_sequence(self, seq_id):
        table = self.tables.pop(seq_id)
        del self.seq_lens[seq_id]
        self.free.extend(table)
        return table
