"""The block manager (nano-vllm's ``BlockManager``, vLLM's ``BlockPool``) in pure Python: free stack,
reference counts, block tables, copy-on-write and the prefix-cache hooks. It trusts its arguments
(``PagedKVCache`` checks them); ``reserve`` undoes itself whatever stops it, ``KeyboardInterrupt`` included.
One thread at a time, like nano-vllm and vLLM: a caller sharing it between threads serialises the calls."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from pagedlib import testing
from pagedlib.core._checks import OutOfBlocksError, what_for  # OutOfBlocksError: re-exported
from pagedlib.core.prefix_cache import PrefixCache
from pagedlib.core.radix_cache import RadixCache
from pagedlib.testing import InvariantError  # noqa: F401 (re-exported: callers import it from here)
from pagedlib.util import ceil_div


@dataclass
class Undo:
    """What one ``reserve`` changed so far, so that it can put everything back."""

    cow_copies: int                                          # the counter before the call
    taken: list[int] = field(default_factory=list)           # blocks allocated, each held once
    # each sequence changed, in order: (seq_id, start, table[start:], length) before the call, start
    # its last block's index: a reserve changes a table only from its last block on (copy-on-write, new
    # blocks, a swapped duplicate), so no copy of the whole table is needed
    sequences: list[tuple[Hashable, int, list[int], int]] = field(default_factory=list)
    # shared blocks copied away: count before
    copied: dict[int, int] = field(default_factory=dict)
    # (duplicate, tree block) in a table
    swapped: list[tuple[int, int]] = field(default_factory=list)


class BlockManager:
    """Free stack, reference counts and block tables of ``num_blocks`` blocks of ``block_size`` tokens;
    ``free_order`` lists the blocks handed out first, in order (the others follow in ascending order)."""

    def __init__(self, num_blocks: int, block_size: int, free_order: Sequence[int] = (),
                 enable_prefix_caching: bool = False, prefix_cache: str = "hash") -> None:
        listed = set(free_order)
        unlisted = [block for block in reversed(range(num_blocks)) if block not in listed]
        # the top of the stack is the end of the list
        self.free = unlisted + list(reversed(free_order))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}
        self.token_ids: dict[Hashable, list[int]] = {}  # filled only with prefix caching
        self.prefix_cache: PrefixCache | RadixCache | None = None
        if enable_prefix_caching and prefix_cache == "radix":
            self.prefix_cache = RadixCache(block_size)  # SGLang's tree
        elif enable_prefix_caching:
            self.prefix_cache = PrefixCache(block_size)  # vLLM's chained block hashes
        self.cow_copies = 0

    @property
    def num_free_blocks(self) -> int:
        """Plain free blocks plus cached blocks nobody holds (evicted when needed)."""
        if self.prefix_cache is None:
            return len(self.free)
        return len(self.free) + len(self.prefix_cache.free_queue)

    def allocate(self, n: int, what: str = "", taken: list[int] | None = None) -> list[int]:
        """Take ``n`` blocks, each then held once: off the top of the free stack first, then the least
        recently used cached blocks (evicted). Each block joins ``taken`` as it is taken, so a caller
        interrupted halfway knows what to give back."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, what)
        if taken is None:
            taken = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            else:
                block = self.prefix_cache.evict()  # type: ignore[union-attr]
            self.ref_counts[block] = 1
            taken.append(block)
        return taken

    def share(self, blocks: Sequence[int]) -> None:
        """One more table holds each of ``blocks`` (a fork, a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0:  # a cached block found while free leaves the queue
                self.prefix_cache.free_queue.pop(block, None)  # type: ignore[union-attr]
            self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> list[int]:
        """One table fewer holds each of ``blocks``. Returns those nobody holds any more, now free: a cached
        one at the back of the prefix cache's queue (the last of ``blocks`` first: a sequence's tail is
        evicted before its head), the others on the stack (the last of ``blocks`` on top: reused first), the
        order vLLM 0.32.0's ``BlockPool.free_blocks`` gives its free queue."""
        freed = []
        plain = []
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                continue
            freed.append(block)
            if self.prefix_cache is None or not self.prefix_cache.release(block):
                plain.append(block)
        self.free.extend(reversed(plain))
        return freed[::-1]

    def copy_on_write(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> list[bool]:
        """Which sequences must copy their last block before appending: it is partly filled and another table
        holds it. Of several sharers appending at once, the last one writes in place."""
        plan = []
        copied: Counter[int] = Counter()  # block -> sharers that copy it away in this call
        for seq_id, count in zip(seq_ids, counts):
            must_copy = False
            # it writes into a partly filled last block
            if count > 0 and self.seq_lens[seq_id] % self.block_size > 0:
                last = self.tables[seq_id][-1]
                must_copy = self.ref_counts[last] - copied[last] > 1
                if must_copy:
                    copied[last] += 1
            plan.append(must_copy)
        return plan

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        """A new sequence, holding the cached full leading blocks of ``prompt`` (prefix caching). Returns the
        tokens found: a multiple of ``block_size``, at most ``len(prompt) - 1``."""
        found = []
        if self.prefix_cache is not None and prompt:
            found = self.prefix_cache.lookup(prompt)
        self.share(found)
        length = len(found) * self.block_size
        self.tables[seq_id] = found
        self.seq_lens[seq_id] = length
        self.token_ids[seq_id] = list(prompt[:length])  # empty without prefix caching
        return length

    def share_partial_block(self, seq_id: Hashable, prompt: Sequence[int],
                            copy: Callable[[list], None] | None = None) -> int:
        """After ``add_sequence``, with the radix cache: also hold a copy of the cached block that continues
        the blocks found furthest (``copy([(source, copy_block)])`` copies its K/V; no copy if no block is
        free), and start inside it. Returns the tokens found, now any number up to ``len(prompt) - 1``.
        If the copy raises, the sequence is as ``add_sequence`` left it."""
        length = self.seq_lens[seq_id]
        if not isinstance(self.prefix_cache, RadixCache):
            return length
        source, extra = self.prefix_cache.partial_match(prompt, self.tables[seq_id])
        if extra == 0:
            return length
        self.share([source])  # held, so not evicted to make room for its own copy
        taken: list[int] = []
        try:
            if self.num_free_blocks == 0:
                return length
            self.allocate(1, taken=taken)
            if copy is not None:
                copy([(source, taken[0])])
        except BaseException:
            self.release(taken)
            raise
        finally:
            self.release([source])
        self.tables[seq_id] += taken
        self.seq_lens[seq_id] += extra
        self.token_ids[seq_id] += prompt[length:length + extra]
        self.prefix_cache.hit_tokens += extra
        return length + extra

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence sharing every block of ``parent_id``: nothing is copied until one of them writes."""
        self.share(self.tables[parent_id])
        self.tables[child_id] = list(self.tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]
        self.token_ids[child_id] = list(self.token_ids[parent_id])

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence. Returns the blocks nobody holds any more, in table order."""
        del self.seq_lens[seq_id]
        del self.token_ids[seq_id]
        return self.release(self.tables.pop(seq_id))

    def reserve(self, seq_ids: Sequence[Hashable], counts: Sequence[int],
                token_ids: Sequence[int] | None = None,
                write: Callable[[list, list], None] | None = None) -> tuple[list[list[int]], list]:
        """Append ``counts[i]`` tokens to each ``seq_ids[i]``, all or nothing. A sequence's table then reads

            | held (full blocks) | last (copied if shared) | new blocks |

        and token ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``. Returns each
        sequence's new slots and the ``(source, copy)`` block copies to make before writing. ``write(slots,
        copies)`` makes them and writes the K/V; then, with prefix caching, the blocks just filled become
        findable by their ``token_ids`` (a block the radix tree already holds replaces its duplicate). If
        anything raises, ``KeyboardInterrupt`` included, every change is undone."""
        copy = self.copy_on_write(seq_ids, counts)
        needed = sum(copy)
        for seq_id, count in zip(seq_ids, counts):
            blocks_after = ceil_div(self.seq_lens[seq_id] + count, self.block_size)
            needed += blocks_after - len(self.tables[seq_id])
        undo = Undo(cow_copies=self.cow_copies)
        try:
            # OutOfBlocksError before anything is taken
            self.allocate(needed, what_for(seq_ids, counts), undo.taken)
            slots, copies = self._commit(seq_ids, counts, copy, token_ids, undo)
            if write is not None:
                write(slots, copies)
            if self.prefix_cache is not None:
                self._register(undo)
        except BaseException:
            self._undo(undo)
            raise
        return slots, copies

    def _commit(self, seq_ids: Sequence[Hashable], counts: Sequence[int], copy: list[bool],
                token_ids: Sequence[int] | None, undo: Undo) -> tuple[list, list]:
        """Grow the tables with ``undo.taken`` and advance the lengths, noting each change in ``undo``."""
        block_size = self.block_size
        new_blocks = iter(undo.taken)
        slots = []
        copies = []
        first_token = 0  # where this sequence's token ids start in ``token_ids``
        for seq_id, count, copy_last in zip(seq_ids, counts, copy):
            table = self.tables[seq_id]
            length = self.seq_lens[seq_id]
            start = max(len(table) - 1, 0)
            undo.sequences.append((seq_id, start, table[start:], length))
            # the other holders keep the shared last block; this sequence writes a copy
            if copy_last:
                shared = table[-1]
                undo.copied.setdefault(shared, self.ref_counts[shared])
                table[-1] = next(new_blocks)
                copies.append((shared, table[-1]))
                self.release([shared])
                self.cow_copies += 1
            while len(table) < ceil_div(length + count, block_size):
                table.append(next(new_blocks))
            slots.append([table[p // block_size] * block_size + p % block_size
                          for p in range(length, length + count)])
            self.seq_lens[seq_id] = length + count
            if self.prefix_cache is not None:  # then token_ids come with every append
                self.token_ids[seq_id] += token_ids[first_token:first_token + count]  # type: ignore
                first_token += count
        return slots, copies

    def _register(self, undo: Undo) -> None:
        """Make the blocks that ``undo``'s sequences just filled findable by their token ids."""
        block_size = self.block_size
        for seq_id, _, _, length in undo.sequences:
            table = self.tables[seq_id]
            tokens = self.token_ids[seq_id]
            for index in range(length // block_size, self.seq_lens[seq_id] // block_size):
                parent = None
                if index > 0:
                    parent = table[index - 1]
                page = tokens[index * block_size:(index + 1) * block_size]
                found = self.prefix_cache.register(table[index], parent, page)  # type: ignore
                # the tree holds this content already: hold its block instead
                if found != table[index]:
                    self.share([found])
                    undo.swapped.append((table[index], found))
                    self.release([table[index]])
                    table[index] = found

    def _undo(self, undo: Undo) -> None:
        """Put back everything ``undo`` noted; cached blocks evicted on the way come back as plain free."""
        for duplicate, found in reversed(undo.swapped):
            self.free.remove(duplicate)
            self.ref_counts[duplicate] = 1
            self.ref_counts[found] -= 1
            # it was a free cached block: back in the queue, not "used now"
            if self.ref_counts[found] == 0:
                self.prefix_cache.free_queue[found] = None  # type: ignore[union-attr]
        for seq_id, start, tail, length in undo.sequences:
            self.tables[seq_id][start:] = tail
            self.seq_lens[seq_id] = length
            del self.token_ids[seq_id][length:]
            if self.prefix_cache is not None and length % self.block_size:
                self.prefix_cache.forget(tail[0])  # its last block: partly filled again
        if self.prefix_cache is not None:
            for block in undo.taken:  # registered just now, or evicted (gone already)
                self.prefix_cache.forget(block)
        for block in undo.taken:  # each held once, by this call
            self.ref_counts[block] = 0
        self.free.extend(reversed(undo.taken))  # as they were: taken[0] on top
        for block, count in undo.copied.items():  # the copied blocks get their holders back
            self.share([block] * (count - self.ref_counts[block]))
        self.cow_copies = undo.cow_copies

    def slots(self, seq_id: Hashable) -> list[int]:
        """Flat slot ids of every token of ``seq_id``, in order."""
        block_size = self.block_size
        every = [block * block_size + offset
                 for block in self.tables[seq_id]
                 for offset in range(block_size)]
        return every[:self.seq_lens[seq_id]]

    # looks inside, for tests and widgets: functions of ``pagedlib.testing`` as methods
    holders = testing.holders  # (sequence, logical index) of every table entry naming each block
    check_invariants = testing.check_invariants  # InvariantError naming the first broken invariant


