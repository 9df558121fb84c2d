"""Catches: slot_mapping lists the slots of positions start to stop - 1, in order

Includes stop itself: one slot too many (or an IndexError at the end of the table)."""


def slot_of(block_table, block_size, position):
    if not 0 <= position < len(block_table) * block_size:
        raise IndexError(f"position {position} is outside a table of {len(block_table)} blocks")
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table, block_size, start, stop):
    return [slot_of(block_table, block_size, p) for p in range(start, stop + 1)]


def block_and_offset(slot, block_size):
    return divmod(slot, block_size)
