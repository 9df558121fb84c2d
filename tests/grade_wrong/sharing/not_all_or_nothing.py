"""Catches: an append the pool cannot hold raises RuntimeError and changes nothing (the copy's block counts)

Takes blocks one at a time and raises RuntimeError when the stack runs out, keeping those it took."""

import hashlib
import struct


class SharedBlocks:
    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.ref_counts = [0] * num_blocks
        self.tables, self.seq_lens = {}, {}

    def add_sequence(self, seq_id):
        self.tables[seq_id], self.seq_lens[seq_id] = [], 0

    def append(self, seq_id, n):
        table, length = self.tables[seq_id], self.seq_lens[seq_id]
        copy = length % self.block_size > 0 and self.ref_counts[table[-1]] > 1
        new = -(-(length + n) // self.block_size) - len(table)
        pair = None
        if copy:
            pair = (table[-1], self.take())
            self.ref_counts[table[-1]] -= 1
            table[-1] = pair[1]
        table += [self.take() for _ in range(new)]
        self.seq_lens[seq_id] = length + n
        return pair

    def take(self):
        if not self.free:
            raise RuntimeError("out of blocks")
        block = self.free.pop()
        self.ref_counts[block] = 1
        return block

    def fork(self, parent_id, child_id):
        self.tables[child_id] = list(self.tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]
        for block in self.tables[child_id]:
            self.ref_counts[block] += 1

    def free_sequence(self, seq_id):
        del self.seq_lens[seq_id]
        for block in self.tables[seq_id]:
            self.ref_counts[block] -= 1
        freed = [block for block in self.tables.pop(seq_id) if self.ref_counts[block] == 0]
        self.free += freed
        return freed


def block_keys(token_ids, block_size):
    keys, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block)).digest()
        keys.append(parent.hex())
    return keys
