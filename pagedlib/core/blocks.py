"""The block manager (nano-vllm's ``BlockManager``, vLLM's ``BlockPool``) in pure Python: free stack,
reference counts, block tables, copy-on-write and the prefix-cache hooks. It trusts its arguments
(``PagedKVCache`` and the ``Scheduler`` check them). One thread at a time, like nano-vllm and vLLM.

Its plain path is three calls: ``allocate`` blocks off the free stack, ``reserve`` slots for new tokens
(growing the tables), ``free_sequence``. A reservation is a record that can be undone (``undo``) until the
K/V it reserved for are written (``commit``): the engine undoes a step whose forward pass raised.

A hybrid model's layers form several KV-cache groups (``core/groups.py``, notebook 15): one free stack and one
reference count per block serve them all (a block belongs to one group at a time), and each group keeps a
table per sequence, ``group_tables[g][seq_id]``. A sliding-window group's reservation first gives back the
blocks wholly before the window (their entries become ``NULL_BLOCK``), as vLLM 0.32.0's ``allocate_slots``
calls ``remove_skipped_blocks`` before it allocates. With prefix caching each group registers its blocks
under the chained keys of the sequence's tokens (``PrefixCache.add``), and a new sequence attaches the
longest prefix every group can serve (``PrefixCache.peek_groups``): vLLM's dense retention, every full
block of every group kept findable (its ``prefix_cache_retention_interval=None``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from pagedlib.core._checks import InvariantError, OutOfBlocksError, what_for  # noqa: F401 (re-exported)
from pagedlib.core.groups import NULL_BLOCK, KVGroup
from pagedlib.core.prefix_cache import BlockKey, PrefixCache, chained_keys
from pagedlib.core.radix_cache import RadixCache
from pagedlib.util import ceil_div


@dataclass
class Reservation:
    """What one ``reserve`` did: the new slots and the block copies they need, and how to undo it."""

    slots: list[list[int]] = field(default_factory=list)       # each sequence's new slots, token by token
    # per group g, each sequence's new slots (entry 0 is ``slots``)
    group_slots: list[list[list[int]]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy) blocks: copy-on-write
    registered: list[int] = field(default_factory=list)        # blocks made findable, K/V not yet written
    # to undo it
    taken: list[int] = field(default_factory=list)             # blocks allocated, each held once
    # each table changed: (group, seq_id, start, table[start:], length) before the call; a reserve grows a
    # table from its last block on only (start: that block's index), so no copy of the whole table is kept
    sequences: list[tuple[int, Hashable, int, list[int], int]] = field(default_factory=list)
    # (group, seq_id, index, block): a window group's entries given back (now NULL_BLOCK), one hold each
    skipped: list[tuple[int, Hashable, int, int]] = field(default_factory=list)
    computed: list[tuple[Hashable, int]] = field(default_factory=list)  # (seq_id, its ``computed`` before)
    released: list[int] = field(default_factory=list)          # shared blocks copied away: one hold each
    # (seq_id, index, duplicate, tree block): the radix tree holds this content already; its block, held
    # from now on, replaces the duplicate once the duplicate's K/V are written (commit)
    swaps: list[tuple[Hashable, int, int, int]] = field(default_factory=list)


class BlockManager:
    """Free stack, reference counts and block tables of ``num_blocks`` blocks of ``block_size`` tokens;
    ``free_order`` lists the blocks handed out first, in order (the others follow in ascending order).
    ``groups``: the KV-cache groups, each with a table per sequence (``None``: one full-attention group);
    ``tables`` is group 0's."""

    def __init__(self, num_blocks: int, block_size: int, free_order: Sequence[int] = (),
                 enable_prefix_caching: bool = False, prefix_cache: str = "hash",
                 groups: Sequence[KVGroup] | None = None) -> None:
        # the window each group sees, in tokens (None: full attention)
        self.windows: tuple[int | None, ...] = (None,)
        if groups is not None:
            self.windows = tuple(group.window for group in groups)
        self.has_window = any(window is not None for window in self.windows)  # some group gives blocks back
        # a prefix cache's lookups and registrations go group by group (notebook 15)
        self.by_group = len(self.windows) > 1 or self.has_window
        if enable_prefix_caching and prefix_cache == "radix" and self.by_group:
            raise ValueError(f"prefix_cache='radix' with KV-cache groups {self.windows} (windows): the radix "
                             f"tree serves one full-attention group only; use prefix_cache='hash'")
        listed = set(free_order)
        unlisted = [block for block in reversed(range(num_blocks)) if block not in listed]
        # the top of the stack is the end of the list
        self.free = unlisted + list(reversed(free_order))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks  # holders across every group's tables
        self.group_tables: list[dict[Hashable, list[int]]] = [{} for _ in self.windows]
        self.tables = self.group_tables[0]
        self.seq_lens: dict[Hashable, int] = {}
        # tokens each sequence held when its last reservation began (vLLM's num_computed_tokens at
        # allocate_slots; kept with a window group only): a window group holds no block wholly before the
        # window of that position
        self.computed: dict[Hashable, int] = {}
        self.token_ids: dict[Hashable, list[int]] = {}  # filled only with prefix caching
        # with groups and prefix caching: the chained keys of each sequence's full blocks (vLLM's
        # ``Request.block_hashes``), made once each
        self.block_keys: dict[Hashable, list[BlockKey]] = {}
        self.prefix_cache: PrefixCache | RadixCache | None = None
        if enable_prefix_caching and prefix_cache == "radix":
            self.prefix_cache = RadixCache(block_size)  # SGLang's tree
        elif enable_prefix_caching:
            self.prefix_cache = PrefixCache(block_size, num_groups=len(self.windows))  # vLLM's block hashes
        self.cow_copies = 0
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Plain free blocks plus cached blocks nobody holds (evicted when needed)."""
        return len(self.free) + self.num_cached_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks whose K/V a prefix-cache lookup can still find."""
        if self.prefix_cache is None:
            return 0
        return len(self.prefix_cache.free_queue)

    def allocate(self, n: int, what: str = "", taken: list[int] | None = None) -> list[int]:
        """Take ``n`` blocks, each then held once: off the top of the free stack first, then the least
        recently used cached blocks (evicted). Each block joins ``taken`` as it is taken, so a caller
        interrupted halfway knows what to give back."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, what)
        if taken is None:
            taken = []
        plain = len(self.free)  # blocks past these come from the prefix cache (evicted)
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            else:
                block = self.prefix_cache.evict()  # type: ignore[union-attr]
            self.ref_counts[block] = 1
            taken.append(block)
        if self.on_evict is not None:  # a victim tier (notebook 13) saves their K/V before they are reused
            self.save_evicted(taken, n, max(0, n - plain))
        return taken

    def save_evicted(self, taken: list[int], n: int, evicted: int) -> None:
        """``on_evict`` for the last ``evicted`` of the ``n`` blocks just appended to ``taken``. If it raises,
        the ``n`` blocks leave ``taken`` and are free again (plain: an evicted block's key is gone), so a
        caller that kept no list loses nothing."""
        mine = taken[len(taken) - n:]
        try:
            for block in mine[n - evicted:]:
                self.on_evict(block)  # type: ignore[misc]
        except BaseException:
            del taken[len(taken) - n:]
            for block in mine:
                self.ref_counts[block] = 0
            self.free.extend(reversed(mine))
            raise

    def share(self, blocks: Sequence[int]) -> None:
        """One more table holds each of ``blocks`` (a fork, a prefix-cache hit)."""
        for block in blocks:
            if self.ref_counts[block] == 0 and self.prefix_cache is not None:  # a cached block found
                self.prefix_cache.free_queue.pop(block, None)  # while free leaves the queue
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

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = (),
                     keys: Sequence[BlockKey] | None = None) -> int:
        """A new sequence, holding the cached full leading blocks of ``prompt`` (prefix caching; ``keys``:
        their block keys, if the caller keeps them). Returns the tokens found: a multiple of
        ``block_size``, at most ``len(prompt) - 1``."""
        if self.by_group:
            return self.add_sequence_groups(seq_id, prompt, keys)
        found = []
        if self.prefix_cache is not None and prompt:
            found = self.prefix_cache.lookup(prompt, keys)
        self.share(found)
        length = len(found) * self.block_size
        self.tables[seq_id] = found
        self.seq_lens[seq_id] = length
        self.computed[seq_id] = length
        self.token_ids[seq_id] = list(prompt[:length])  # empty without prefix caching
        return length

    def add_sequence_groups(self, seq_id: Hashable, prompt: Sequence[int] = (),
                            keys: Sequence[BlockKey] | None = None) -> int:
        """``add_sequence`` over KV-cache groups: each group's table starts with its blocks of the longest
        prefix every group serves (``find_cached``; a window group's ``NULL_BLOCK`` before its window)."""
        found = self.find_cached(prompt, keys)
        for tables, blocks in zip(self.group_tables, found):
            self.share(held(blocks))  # group by group, as vLLM touches them
            tables[seq_id] = blocks
        length = len(found[0]) * self.block_size
        if self.prefix_cache is not None and prompt:
            self.prefix_cache.queried_tokens += len(prompt)
            self.prefix_cache.hit_tokens += length
        self.seq_lens[seq_id] = length
        self.computed[seq_id] = length
        self.token_ids[seq_id] = list(prompt[:length])
        if self.prefix_cache is not None:
            found_keys = keys if keys is not None else chained_keys(prompt, self.block_size, len(found[0]))
            self.block_keys[seq_id] = list(found_keys)[:len(found[0])]
        return length

    def find_cached(self, prompt: Sequence[int], keys: Sequence[BlockKey] | None = None) -> list[list[int]]:
        """Each group's cached blocks for the longest prefix of ``prompt`` every group serves (all empty
        without prefix caching): ``PrefixCache.peek_groups``, or the one group's ``peek``. Counts nothing."""
        if self.prefix_cache is None or not prompt:
            return [[] for _ in self.windows]
        if not self.by_group:
            return [self.prefix_cache.peek(prompt, keys)]
        return self.prefix_cache.peek_groups(prompt, keys, self.windows)  # type: ignore[union-attr]

    def share_partial_block(self, seq_id: Hashable, prompt: Sequence[int],
                            unwritten: Sequence[int] = ()) -> list[tuple[int, int]]:
        """After ``add_sequence``, with the radix cache: also take a block for a copy of the cached block
        that continues the blocks found furthest, and start inside it (any number of tokens found, up to
        ``len(prompt) - 1``). Returns the ``(source, copy)`` pair to copy before the copy is read (none if
        no block is free). A block in ``unwritten`` (registered, its K/V not yet written) is no source."""
        length = self.seq_lens[seq_id]
        if not isinstance(self.prefix_cache, RadixCache):
            return []
        source, extra = self.prefix_cache.partial_match(prompt, self.tables[seq_id], unwritten)
        if extra == 0:
            return []
        self.share([source])  # held, so not evicted to make room for its own copy
        try:
            if self.num_free_blocks == 0:
                return []
            copy = self.allocate(1)[0]
        finally:
            self.release([source])
        self.tables[seq_id].append(copy)
        self.seq_lens[seq_id] += extra
        self.token_ids[seq_id] += prompt[length:length + extra]
        self.prefix_cache.hit_tokens += extra
        return [(source, copy)]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence sharing every block of ``parent_id`` in every group (given-back entries stay
        ``NULL_BLOCK``): nothing is copied until one of them writes."""
        for tables in self.group_tables:
            self.share(held(tables[parent_id]))
            tables[child_id] = list(tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]
        self.computed[child_id] = self.computed[parent_id]
        self.token_ids[child_id] = list(self.token_ids[parent_id])
        if parent_id in self.block_keys:
            self.block_keys[child_id] = list(self.block_keys[parent_id])

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence. Returns the blocks nobody holds any more, in table order, group after group."""
        del self.seq_lens[seq_id]
        del self.token_ids[seq_id]
        del self.computed[seq_id]
        self.block_keys.pop(seq_id, None)
        freed = []
        for tables in self.group_tables:
            freed += self.release(held(tables.pop(seq_id)))
        return freed

    def reserve(self, seq_ids: Sequence[Hashable], counts: Sequence[int],
                token_ids: Sequence[int] | None = None) -> Reservation:
        """Take slots for ``counts[i]`` more tokens of each ``seq_ids[i]``, all or nothing (if anything
        raises, ``KeyboardInterrupt`` included, nothing changed). A sequence's table then reads, in each
        group,

            | given back (window groups: NULL_BLOCK) | held (full blocks) | last (copied if shared) | new |

        and token ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``. First each
        window group of a sequence that grows gives back its blocks wholly before the window of the next
        token (``give_back``), so those count as free. With prefix caching the blocks the new tokens fill
        become findable at once by their ``token_ids``, as vLLM 0.32.0 registers a block when it schedules it:
        the caller writes their K/V (after making the ``copies``) before anything reads them, then
        ``commit``s, or ``undo``es the reservation."""
        record = Reservation()
        try:
            for seq_id, count in zip(seq_ids, counts):
                if count > 0 and self.has_window:  # vLLM gives back only for a request it schedules
                    self.give_back(seq_id, record)
            plans = [self.copy_on_write(seq_ids, counts, group) for group in range(len(self.windows))]
            # OutOfBlocksError before anything is taken
            self.allocate(self.blocks_needed(seq_ids, counts, plans), what_for(seq_ids, counts), record.taken)
            new_blocks = iter(record.taken)
            for group, copy in enumerate(plans):
                record.group_slots.append([self._grow(group, seq_id, count, copy_last, new_blocks, record)
                                           for seq_id, count, copy_last in zip(seq_ids, counts, copy)])
            record.slots = record.group_slots[0]
            first = 0  # where this sequence's token ids start in ``token_ids``
            for seq_id, count in zip(seq_ids, counts):
                length = self.seq_lens[seq_id]
                self.seq_lens[seq_id] = length + count
                if self.prefix_cache is not None:  # then token ids come with every append
                    self.token_ids[seq_id] += token_ids[first:first + count]  # type: ignore[index]
                    first += count
                    self._register(seq_id, length, record)
        except BaseException:
            self.undo(record)
            raise
        return record

    def blocks_needed(self, seq_ids: Sequence[Hashable], counts: Sequence[int],
                      plans: Sequence[Sequence[bool]]) -> int:
        """Blocks ``reserve`` takes: every group's new table entries, and a copy of each shared last block its
        copy-on-write ``plans`` (one per group) name."""
        needed = 0
        for tables, copy in zip(self.group_tables, plans):
            needed += sum(copy)
            for seq_id, count in zip(seq_ids, counts):
                needed += ceil_div(self.seq_lens[seq_id] + count, self.block_size) - len(tables[seq_id])
        return needed

    def give_back(self, seq_id: Hashable, record: Reservation) -> None:
        """Each window group of ``seq_id`` gives back the blocks wholly before the window of its next token
        (position ``seq_lens[seq_id]``): their entries become ``NULL_BLOCK``, noted in ``record``. vLLM
        0.32.0's ``SlidingWindowManager.get_num_skipped_tokens`` (``max(0, computed - window + 1)`` tokens
        skipped) and ``remove_skipped_blocks`` (``skipped // block_size`` leading blocks, walked from the
        last one back to the first entry already null, freed in that order)."""
        computed = self.seq_lens[seq_id]
        record.computed.append((seq_id, self.computed[seq_id]))
        self.computed[seq_id] = computed
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            table = self.group_tables[group][seq_id]
            skipped = max(0, computed - window + 1)  # tokens the next token's window no longer sees
            freed = []
            for index in range(min(skipped // self.block_size, len(table)) - 1, -1, -1):
                if table[index] == NULL_BLOCK:
                    break
                freed.append(table[index])
                record.skipped.append((group, seq_id, index, table[index]))
                table[index] = NULL_BLOCK
            # vLLM frees them in that order, the first freed reused first (its free queue's front), so the
            # free stack gets them the other way round: the block nearest the window on top
            self.release(freed[::-1])

    def num_new_blocks(self, seq_id: Hashable, count: int) -> int:
        """Blocks ``count`` more tokens of ``seq_id`` take, every group together (no copy-on-write counted:
        the scheduler never forks)."""
        blocks = ceil_div(self.seq_lens[seq_id] + count, self.block_size)
        return sum(blocks - len(tables[seq_id]) for tables in self.group_tables)

    def num_given_back(self, seq_id: Hashable) -> int:
        """Blocks that ``give_back`` would free now for ``seq_id`` (held by it alone): they count as free
        for its next reservation, as vLLM frees them before it counts the blocks it needs."""
        computed = self.seq_lens[seq_id]
        freed = 0
        for group, window in enumerate(self.windows):
            if window is None:
                continue
            table = self.group_tables[group][seq_id]
            for index in range(min(max(0, computed - window + 1) // self.block_size, len(table))):
                block = table[index]
                freed += block != NULL_BLOCK and self.ref_counts[block] == 1
        return freed

    def _grow(self, group: int, seq_id: Hashable, count: int, copy_last: bool, new_blocks: Iterator[int],
              record: Reservation) -> list[int]:
        """Grow the table of ``seq_id`` in ``group`` for ``count`` more tokens (blocks from ``new_blocks``),
        noting each change in ``record``. Returns the new tokens' slots in that group."""
        block_size = self.block_size
        table = self.group_tables[group][seq_id]
        length = self.seq_lens[seq_id]
        start = max(len(table) - 1, 0)
        record.sequences.append((group, seq_id, start, table[start:], length))
        if copy_last:  # the other holders keep the shared last block; this sequence writes a copy
            shared = table[-1]
            table[-1] = next(new_blocks)
            record.copies.append((shared, table[-1]))
            record.released.append(shared)
            self.release([shared])
            self.cow_copies += 1
        while len(table) < ceil_div(length + count, block_size):
            table.append(next(new_blocks))
        return [table[p // block_size] * block_size + p % block_size for p in range(length, length + count)]

    def _register(self, seq_id: Hashable, length: int, record: Reservation) -> None:
        """Make the blocks of ``seq_id`` filled past ``length`` findable by their token ids. A block whose
        content the radix tree holds already is a duplicate: the tree's block replaces it at ``commit``."""
        if self.by_group:
            self._register_groups(seq_id, length, record)
            return
        block_size = self.block_size
        table = self.tables[seq_id]
        tokens = self.token_ids[seq_id]
        first = length // block_size
        parent = None  # the block the cache knows for the previous index
        if first > 0:
            parent = table[first - 1]
        for index in range(first, self.seq_lens[seq_id] // block_size):
            page = tokens[index * block_size:(index + 1) * block_size]
            found = self.prefix_cache.register(table[index], parent, page)  # type: ignore[union-attr]
            if found == table[index]:
                record.registered.append(found)
            else:
                self.share([found])  # held: not evicted before commit puts it in the table
                record.swaps.append((seq_id, index, table[index], found))
            parent = found

    def _register_groups(self, seq_id: Hashable, length: int, record: Reservation) -> None:
        """``_register`` over KV-cache groups: each group's blocks filled past ``length`` under the chained
        keys of the sequence's tokens (a window group's block given back is not registered again; vLLM's
        ``cache_full_blocks`` skips its null blocks). A window of 1 token needs no block before a hit, and
        vLLM 0.32.0 keeps none of its group (``SlidingWindowManager.reachable_block_mask``: no block
        reachable), so that group registers nothing and never serves a hit."""
        keys = self.block_keys[seq_id]
        full = self.seq_lens[seq_id] // self.block_size
        parent = keys[-1] if keys else None
        keys += chained_keys(self.token_ids[seq_id], self.block_size, full, len(keys), parent)
        for group, tables in enumerate(self.group_tables):
            if self.windows[group] == 1:
                continue
            table = tables[seq_id]
            for index in range(length // self.block_size, full):
                if table[index] != NULL_BLOCK:
                    record.registered.append(self.prefix_cache.add(table[index], keys[index], group))  # type: ignore[union-attr]

    def commit(self, record: Reservation) -> None:
        """The K/V of ``record``'s slots are written: each duplicate the radix tree found gives way to the
        tree's block (SGLang frees a duplicate after its forward pass too). ``record`` is done with."""
        for seq_id, index, duplicate, found in record.swaps:
            self.tables[seq_id][index] = found  # held since reserve
            self.release([duplicate])
        record.swaps.clear()

    def undo(self, record: Reservation) -> None:
        """Put back everything ``record`` did (the last reservation not yet committed); cached blocks
        evicted to make room come back as plain free blocks, and a window group's block given back and
        evicted since comes back to its table without its key (its K/V may be overwritten: the window never
        reads it again, and the next reservation gives it back)."""
        self.release([found for _, _, _, found in record.swaps])
        record.swaps.clear()
        for group, seq_id, start, tail, length in reversed(record.sequences):
            self.group_tables[group][seq_id][start:] = tail
            self.seq_lens[seq_id] = length
            del self.token_ids[seq_id][length:]
            if seq_id in self.block_keys:
                del self.block_keys[seq_id][length // self.block_size:]
            if self.prefix_cache is not None and length % self.block_size:
                self.prefix_cache.forget(tail[0])  # its last block: partly filled again
        if self.prefix_cache is not None:
            for block in record.taken:  # registered just now, or evicted (gone already)
                self.prefix_cache.forget(block)
        for block in record.taken:  # each held once, by this call
            self.ref_counts[block] = 0
        self.free.extend(reversed(record.taken))  # as they were: taken[0] on top
        self.hold_again(record.released)
        self.cow_copies -= len(record.released)
        for group, seq_id, index, block in reversed(record.skipped):  # after the tails: they may hold NULL
            self.group_tables[group][seq_id][index] = block
            self.hold_again([block])
        for seq_id, computed in reversed(record.computed):
            self.computed[seq_id] = computed
        record.sequences.clear()
        record.taken.clear()
        record.released.clear()
        record.skipped.clear()
        record.computed.clear()

    def hold_again(self, blocks: Sequence[int]) -> None:
        """One hold more on each of ``blocks``, wherever it went since it was released (still held, on the
        free stack, or waiting in the prefix cache's queue)."""
        for block in blocks:
            if self.ref_counts[block] == 0 and block in self.free:
                self.free.remove(block)
            self.share([block])

    def copy_on_write(self, seq_ids: Sequence[Hashable], counts: Sequence[int], group: int = 0) -> list[bool]:
        """Which sequences must copy their last block in ``group`` before appending: it is partly filled and
        another table holds it. Of several sharers appending at once, the last one writes in place."""
        tables = self.group_tables[group]
        plan = []
        copied: Counter[int] = Counter()  # block -> sharers that copy it away in this call
        for seq_id, count in zip(seq_ids, counts):
            must_copy = False
            # it writes into a partly filled last block
            if count > 0 and self.seq_lens[seq_id] % self.block_size > 0:
                last = tables[seq_id][-1]
                must_copy = self.ref_counts[last] - copied[last] > 1
                if must_copy:
                    copied[last] += 1
            plan.append(must_copy)
        return plan

    def slots(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """Flat slot ids of every token of ``seq_id`` in ``group``, in order (``NULL_BLOCK`` for a token
        whose block the group gave back)."""
        block_size = self.block_size
        every = [NULL_BLOCK if block == NULL_BLOCK else block * block_size + offset
                 for block in self.group_tables[group][seq_id]
                 for offset in range(block_size)]
        return every[:self.seq_lens[seq_id]]


def held(table: Sequence[int]) -> list[int]:
    """The blocks a table holds: its entries but the given-back ones (``NULL_BLOCK``)."""
    return [block for block in table if block != NULL_BLOCK]
