"""Catches: the last token of a block and the first of the next land in their own blocks (no off-by-one)

Takes the logical block as ceil(p / block_size) - 1, the last block of a sequence of p tokens (not p + 1):
one block early at every boundary."""


def slot_of(block_table, block_size, position):
    if not 0 <= position < len(block_table) * block_size:
        raise IndexError(f"position {position} is outside a table of {len(block_table)} blocks")
    return block_table[-(-position // block_size) - 1] * block_size + position % block_size


def slot_mapping(block_table, block_size, start, stop):
    return [slot_of(block_table, block_size, p) for p in range(start, stop)]


def block_and_offset(slot, block_size):
    return divmod(slot, block_size)
