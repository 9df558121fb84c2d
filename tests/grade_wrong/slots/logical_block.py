"""Catches: token p lives in slot table[p // block_size] * block_size + p % block_size

Uses the logical block p // block_size as if it were the physical one: the block table is never read."""


def slot_of(block_table, block_size, position):
    if not 0 <= position < len(block_table) * block_size:
        raise IndexError(f"position {position} is outside a table of {len(block_table)} blocks")
    return (position // block_size) * block_size + position % block_size


def slot_mapping(block_table, block_size, start, stop):
    return [slot_of(block_table, block_size, p) for p in range(start, stop)]


def block_and_offset(slot, block_size):
    return divmod(slot, block_size)
