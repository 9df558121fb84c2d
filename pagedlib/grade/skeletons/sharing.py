"""Build it yourself, notebook 06: blocks shared by reference counts, copy-on-write, and block keys.

Write the class and the function below, then grade them:  python -m pagedlib.grade sharing
(or, in a notebook: ``from pagedlib.grade import grade; grade("sharing")``).

``SharedBlocks`` is the bookkeeping of notebook 06, sections 1 and 2 (no K/V: only block ids and counts).
Its blocks must be the very ones pagedlib's ``BlockManager(num_blocks, block_size)`` hands out, so keep
its four attributes: ``free``, the free stack, whose top is its END (``free.pop()`` takes the next block;
at the start it reads ``[num_blocks - 1, ..., 1, 0]``, so block 0 is taken first); ``ref_counts``, a list
(``ref_counts[b]``: how many tables hold block ``b``, 0 for a free block); ``tables``, a dict from
sequence id to its list of block ids in token order; ``seq_lens``, a dict from sequence id to its number of
tokens. Sequence ids are any hashable values (the grader uses ints).

``block_keys`` is notebook 06, section 5's key: one per FULL block, each made from the key of the block
before it and the block's own token ids, exactly as ``pagedlib.core.prefix_cache.BlockKey.digest``.

Checked, over generated sequences of calls (hypothesis) against pagedlib's ``BlockManager``: every call's
result and the four attributes after it, with pagedlib's invariants (``pagedlib.testing``) after each
call; that a sequence writes only into blocks it holds alone (a shared, partly filled last block is copied
first); that a block returns to ``free`` only when no table holds it; that an append the pool cannot hold
raises ``RuntimeError`` and changes nothing. For the keys: equal to pagedlib's digests; a change in any
token changes the key of its block and of every later block, and no earlier one; no key for a partly filled
last block.
"""

from collections.abc import Hashable


class SharedBlocks:
    """A pool of ``num_blocks`` blocks of ``block_size`` tokens shared by reference counts."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        """An empty pool: every block free (``free == [num_blocks - 1, ..., 1, 0]``), every count 0, no
        sequence (``tables == {}``, ``seq_lens == {}``)."""
        raise NotImplementedError

    def add_sequence(self, seq_id: Hashable) -> None:
        """A new sequence with no tokens and no blocks."""
        raise NotImplementedError

    def append(self, seq_id: Hashable, n: int) -> tuple[int, int] | None:
        """Room for ``n >= 1`` more tokens of ``seq_id``, all or nothing:

        1. copy-on-write: if the sequence's last block is partly filled (``seq_lens[seq_id] % block_size >
           0``) and another table holds it too (count above 1), the sequence takes a new block in its place
           (the last entry of its table) and the old block's count goes down by one;
        2. then it takes as many new blocks as its tokens now need (``ceil(length / block_size)`` in all),
           appended to its table in the order taken.

        A block is taken off the top of ``free`` (``free.pop()``) and starts at a count of 1; the copy's
        block is taken first. If ``free`` holds fewer blocks than the call needs (the copy's included),
        raise ``RuntimeError`` and change nothing. Returns the copy to make, ``(old block, new block)``, or
        ``None`` when nothing is copied."""
        raise NotImplementedError

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence ``child_id`` with a copy of the parent's table (a new list) and its length; each of
        those blocks gains one holder. No block is taken, nothing is copied."""
        raise NotImplementedError

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget ``seq_id``: each block of its table loses one holder. Returns the blocks whose count
        reached 0, in table order, and pushes them onto ``free`` in that order (so the last of them is on
        top: taken next). A block some other table still holds stays where it is."""
        raise NotImplementedError


def block_keys(token_ids: list[int], block_size: int) -> list[str]:
    """The key of each FULL block of ``token_ids`` (``len(token_ids) // block_size`` keys; a partly filled
    last block gets none), as a hex string of 64 characters. Block ``i`` holds the tokens
    ``token_ids[i * block_size:(i + 1) * block_size]``; its key is

        hashlib.sha256(parent + struct.pack(f"<{block_size}q", *tokens)).hexdigest()

    where ``parent`` is the 32 bytes of the previous block's digest (``bytes.fromhex(previous key)``;
    ``b""`` for block 0) and each token id is packed as a little-endian signed 64-bit integer (token ids
    go up to ``2**63 - 1``)."""
    raise NotImplementedError
