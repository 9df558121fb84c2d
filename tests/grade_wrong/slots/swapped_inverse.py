"""Catches: a slot splits back into its block and offset

Returns (offset, block): divmod's two results the wrong way round."""


def slot_of(block_table, block_size, position):
    if not 0 <= position < len(block_table) * block_size:
        raise IndexError(f"position {position} is outside a table of {len(block_table)} blocks")
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table, block_size, start, stop):
    return [slot_of(block_table, block_size, p) for p in range(start, stop)]


def block_and_offset(slot, block_size):
    quotient, remainder = divmod(slot, block_size)
    return remainder, quotient
