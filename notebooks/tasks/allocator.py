"""Build it yourself, notebook 02: the block allocator's bookkeeping.

Write the class below, then grade it:  python -m pagedlib.grade allocator
(or, in a notebook: ``from pagedlib.grade import grade; grade("allocator")``).

A pool of ``num_blocks`` blocks of ``block_size`` token slots each, shared by every sequence. Only the
bookkeeping, no K/V tensors: which blocks each sequence holds, in order (its block table), how many tokens
it holds, and which blocks are free. Token ``p`` of a sequence lives in its logical block
``p // block_size``, so a sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks, and it takes a
new block exactly when a token's position ``p`` has ``p % block_size == 0``.

The free blocks are a stack: a Python list whose top is its LAST element. ``free.pop()`` takes the block
on top, ``free.append(b)`` puts ``b`` on top. A fresh pool's stack is ``[num_blocks - 1, ..., 1, 0]``,
so appends take blocks 0, 1, 2, ... in that order. Freeing a sequence pushes its blocks back in table
order, so that its LAST block ends on top (``free[-1]``, with the one before it under it, and so on): the
next append takes that block first, as pagedlib's ``BlockManager.release`` does.

Checked, over generated programs of ``add_sequence`` / ``append`` / ``free_sequence`` calls replayed on
your class and on pagedlib's own cache (a failure shows the shortest program that fails, its last call
the failing one):
- a fresh pool's stack, and then the same block ids, free stack, tables and lengths as pagedlib after
  every call, and the same return values;
- notebook 02's four invariants after every call: one owner, free means free, valid ids, right size;
- freeing returns every block, and after freeing every sequence every block is free;
- the lists ``append`` and ``free_sequence`` return are the caller's: adding to one changes nothing in the
  allocator;
- an append that does not fit raises ``RuntimeError`` (pagedlib raises its ``OutOfBlocksError``, a
  ``RuntimeError``) and changes nothing: not the stack's order, not a table, not a length. Count the
  blocks needed first, then take them;
- an append or a free of a sequence that is not live (never added, or freed) raises ``KeyError`` (pagedlib
  raises its ``UnknownSequenceError``, a ``KeyError``) and changes nothing.
"""

from collections.abc import Hashable


class BlockAllocator:
    """The pool's bookkeeping. The grader reads three attributes, which every call keeps up to date:

    - ``free``: list[int], the free stack, its top the last element;
    - ``tables``: dict, each live sequence's id -> its block table, a list[int] (logical block ``i`` is
      physical block ``tables[seq_id][i]``);
    - ``seq_lens``: dict, each live sequence's id -> the number of tokens it holds.

    A freed sequence leaves both dicts. Sequence ids are hashable (the checks use small ints)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """An empty pool: every block free, ``free == [num_blocks - 1, ..., 1, 0]``, no sequence."""
        raise NotImplementedError

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are free."""
        raise NotImplementedError

    def add_sequence(self, seq_id: Hashable) -> None:
        """A new live sequence with no token and no block. The checks never add an id that is live (pagedlib
        refuses it with a ``ValueError``); an id freed earlier may be added again."""
        raise NotImplementedError

    def append(self, seq_id: Hashable, num_tokens: int = 1) -> list[int]:
        """``num_tokens`` (at least 1) more tokens for sequence ``seq_id``. Take the blocks its new length
        needs, one ``pop()`` each, adding each to the end of its table in the order taken, and return them
        in a new list, not one the allocator keeps (an empty list when its last block has room). All or
        nothing: raise ``KeyError`` if ``seq_id`` is not live, ``RuntimeError`` if fewer blocks are free than
        it needs, before changing anything."""
        raise NotImplementedError

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget sequence ``seq_id``: its blocks go back on the stack, its last block on top. Returns the
        blocks it held, in table order (a list the allocator no longer keeps). Raises ``KeyError`` if
        ``seq_id`` is not live, changing nothing."""
        raise NotImplementedError
