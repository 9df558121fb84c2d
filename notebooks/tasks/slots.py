"""Build it yourself, notebook 03: where a token lives, through its block table, and back.

Write the three functions below, then grade them:  python -m pagedlib.grade slots
(or, in a notebook: ``from pagedlib.grade import grade; grade("slots")``).

A sequence's block table lists the physical blocks holding its tokens, in order. Token ``p`` lives in
logical block ``p // block_size``, which is physical block ``block_table[p // block_size]``, at offset
``p % block_size`` inside it. A slot id numbers every slot of the pool in one flat range: the slot at
``offset`` of ``block`` is ``block * block_size + offset`` (vLLM's ``slot_mapping`` holds one slot id per
new token; notebook 02, section 6). A table of ``n`` blocks holds positions ``0`` to ``n * block_size - 1``.

Checked against pagedlib's cache (``BlockManager.slots`` and ``PagedKVCache.slot``), with a sequence
holding the generated table, over tables of up to 8 distinct block ids below 64 and block sizes 1 to 16:
random positions; every block boundary (the last slot of a block and the first of the next); ranges of
positions; positions outside the table (negative ones, and ``len(block_table) * block_size`` and past);
slot ids split back into block and offset.
"""


def slot_of(block_table: list[int], block_size: int, position: int) -> int:
    """The slot id of token ``position``. Raises ``IndexError`` unless
    ``0 <= position < len(block_table) * block_size``, as pagedlib's ``PagedKVCache.slot`` does for a
    position the sequence does not hold (a negative position too: a negative list index would quietly
    read the table from its end)."""
    raise NotImplementedError


def slot_mapping(block_table: list[int], block_size: int, start: int, stop: int) -> list[int]:
    """The slot ids of tokens ``start, start + 1, ..., stop - 1`` (``start <= stop``), in that order: ``[]``
    when ``start == stop``. Raises ``IndexError`` if one of those positions is outside the table."""
    raise NotImplementedError


def block_and_offset(slot: int, block_size: int) -> tuple[int, int]:
    """The inverse of a slot id: the tuple ``(block, offset)`` of slot ``slot``."""
    raise NotImplementedError
