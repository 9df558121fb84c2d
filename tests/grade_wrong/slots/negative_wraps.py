"""Catches: a position outside the table (negative, or len(table) * block_size and past) raises IndexError

Checks no bound: a negative position reads the table from its end instead of raising IndexError."""


def slot_of(block_table, block_size, position):
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table, block_size, start, stop):
    return [slot_of(block_table, block_size, p) for p in range(start, stop)]


def block_and_offset(slot, block_size):
    return divmod(slot, block_size)
