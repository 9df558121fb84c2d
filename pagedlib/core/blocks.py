"""The block manager (nano-vllm's ``BlockManager``, vLLM's ``BlockPool``) in pure Python: free stack,
reference counts, block tables, copy-on-write and the prefix-cache hooks. It trusts its arguments
(``PagedKVCache`` checks them); ``reserve`` undoes itself whatever stops it, ``KeyboardInterrupt`` included.
One thread at a time, like nano-vllm and vLLM: a caller sharing it between threads serialises the calls."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from pagedlib.core.prefix_cache import PrefixCache
from pagedlib.core.radix_cache import RadixCache
from pagedlib.util import ceil_div


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a call needs. Nothing was changed (``args`` survive pickle)."""

    def __init__(self, needed: int, free: int, what: str = "") -> None:
        super().__init__(needed, free, what)
        self.needed, self.free, self.what = needed, free, what

    def __str__(self) -> str:
        where = f" for {self.what}" if self.what else ""
        return f"out of KV blocks{where}: {self.needed} needed, {self.free} free"


class InvariantError(AssertionError):
    """``check_invariants`` found the bookkeeping inconsistent (a bug, never bad user input)."""


class BlockManager:
    """Free stack, reference counts and block tables of ``num_blocks`` blocks of ``block_size`` tokens;
    ``free_order`` lists the blocks handed out first, in order (the others follow in ascending order)."""

    def __init__(self, num_blocks: int, block_size: int, free_order: Sequence[int] = (),
                 enable_prefix_caching: bool = False, prefix_cache: str = "hash") -> None:
        listed, stack = set(free_order), range(num_blocks - 1, -1, -1)
        self.free = [b for b in stack if b not in listed] + list(free_order)[::-1] if listed else list(stack)
        self.num_blocks, self.block_size, self.ref_counts = num_blocks, block_size, [0] * num_blocks
        self.tables: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}
        self.token_ids: dict[Hashable, list[int]] = {}  # filled only with prefix caching
        design = RadixCache if prefix_cache == "radix" else PrefixCache  # a tree, or chained block hashes
        self.prefix_cache = design(block_size) if enable_prefix_caching else None
        self.cow_copies = 0

    @property
    def num_free_blocks(self) -> int:  # plain free blocks plus cached blocks nobody holds
        return len(self.free) + (len(self.prefix_cache.free_queue) if self.prefix_cache else 0)

    def allocate(self, n: int, what: str = "") -> list[int]:
        """Take ``n`` blocks, all or none, each then held once: off the top of the free stack first, then the
        least recently used cached blocks (evicted)."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, what)
        rest = len(self.free) - min(n, len(self.free))
        taken = self.free[rest:][::-1]
        del self.free[rest:]
        taken += [self.prefix_cache.evict() for _ in range(n - len(taken))]  # type: ignore[union-attr]
        for b in taken:
            self.ref_counts[b] = 1
        return taken

    def share(self, blocks: Sequence[int]) -> None:
        """One more table holds each of ``blocks`` (a fork, a prefix-cache hit)."""
        for b in blocks:
            if self.ref_counts[b] == 0:  # a cached block found while free leaves the queue
                self.prefix_cache.free_queue.pop(b, None)  # type: ignore[union-attr]
            self.ref_counts[b] += 1

    def release(self, blocks: Sequence[int]) -> list[int]:
        """One table fewer holds each of ``blocks``. Returns those nobody holds any more, now free: on the
        stack (``blocks[0]`` on top) or, if cached, at the back of the prefix cache's queue."""
        freed = []
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                freed.append(b)
                if self.prefix_cache is None or not self.prefix_cache.release(b):
                    self.free.append(b)
        return freed[::-1]

    def copy_on_write(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> list[bool]:
        """Which sequences must copy their last block before appending: it is partly filled and another table
        holds it. Of several sharers appending at once, the last one writes in place."""
        plan, copied = [], {}
        for s, n in zip(seq_ids, counts):
            last = self.tables[s][-1] if n and self.seq_lens[s] % self.block_size else -1
            plan.append(last >= 0 and self.ref_counts[last] - copied.get(last, 0) > 1)
            if plan[-1]:
                copied[last] = copied.get(last, 0) + 1
        return plan

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        """A new sequence, holding the cached full leading blocks of ``prompt`` (prefix caching). Returns the
        tokens found: a multiple of ``block_size``, at most ``len(prompt) - 1``."""
        found = self.prefix_cache.lookup(prompt) if self.prefix_cache and prompt else []
        self.share(found)
        self.tables[seq_id], self.seq_lens[seq_id] = found, len(found) * self.block_size
        self.token_ids[seq_id] = list(prompt[:self.seq_lens[seq_id]]) if self.prefix_cache else []
        return self.seq_lens[seq_id]

    def share_partial_block(self, seq_id: Hashable, prompt: Sequence[int],
                            copy: Callable[[list], None] | None = None) -> int:
        """After ``add_sequence``, with the radix cache: also hold a copy of the cached block that continues
        the blocks found furthest (``copy([(src, dst)])`` copies its K/V; no copy if no block is free), and
        start inside it. Returns the tokens found, now any number up to ``len(prompt) - 1``."""
        pc, n = self.prefix_cache, self.seq_lens[seq_id]
        src, extra = pc.partial_match(prompt, self.tables[seq_id]) if isinstance(pc, RadixCache) else (-1, 0)
        if extra == 0:
            return n
        self.share([src])  # not evicted for its own copy
        dst = self.allocate(1) if self.num_free_blocks else []
        if dst and copy is not None:
            copy([(src, dst[0])])
        self.release([src])
        if dst:
            self.tables[seq_id] += dst
            self.seq_lens[seq_id] += extra
            self.token_ids[seq_id] += prompt[n:n + extra]
            pc.hit_tokens += extra
        return self.seq_lens[seq_id]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence sharing every block of ``parent_id``: nothing is copied until one of them writes."""
        self.share(self.tables[parent_id])
        self.tables[child_id] = list(self.tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]
        self.token_ids[child_id] = list(self.token_ids[parent_id])

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence. Returns the blocks nobody holds any more, in table order."""
        del self.seq_lens[seq_id], self.token_ids[seq_id]
        return self.release(self.tables.pop(seq_id))

    def release_leading_blocks(self, seq_id: Hashable, n: int) -> list[int]:
        """Give back and return the first ``n`` blocks (full, unshared): ``n * block_size`` tokens less."""
        blocks = self.tables[seq_id][:n]
        del self.tables[seq_id][:n]
        self.seq_lens[seq_id] -= n * self.block_size
        return self.release(blocks)

    def reserve(self, seq_ids: Sequence[Hashable], counts: Sequence[int], token_ids: Sequence | None = None,
                write: Callable[[list, list], None] | None = None) -> tuple[list[list[int]], list]:
        """One all-or-nothing append of ``counts[i]`` tokens to ``seq_ids[i]``: take the blocks, advance the
        lengths, register full blocks by their ``token_ids`` (prefix caching), run ``write(slots, copies)``
        (the K/V part); if anything raises, everything is undone. Returns each sequence's flat slot ids
        ``block * block_size + offset`` and the ``(src, dst)`` copy-on-write block copies to make first."""
        bs, copy = self.block_size, self.copy_on_write(seq_ids, counts)
        need = sum(copy) + sum([ceil_div(self.seq_lens[s] + n, bs) - len(self.tables[s])
                                for s, n in zip(seq_ids, counts)])
        taken = self.allocate(need, _what(seq_ids, counts) if need > self.num_free_blocks else "")
        saved: list[tuple[int, int, int]] = []  # per sequence: blocks held, length, last block
        refs, cow = {}, self.cow_copies  # reference counts of the blocks copied
        try:
            slots, copies = self._commit(seq_ids, counts, copy, taken, token_ids, saved, refs)
            if write is not None:
                write(slots, copies)
        except BaseException:
            self._rollback(seq_ids, saved, refs, taken)
            self.cow_copies = cow
            raise
        return slots, copies

    def _commit(self, seq_ids: Sequence[Hashable], counts: Sequence[int], copy: list[bool], taken: list[int],
                token_ids: Sequence[int] | None, saved: list, refs: dict[int, int]) -> tuple[list, list]:
        bs, pc, slots, copies, used, t = self.block_size, self.prefix_cache, [], [], 0, 0
        for s, n, c in zip(seq_ids, counts, copy):
            table, start = self.tables[s], self.seq_lens[s]
            saved.append((len(table), start, table[-1] if table else -1))
            new = taken[used:used + ceil_div(start + n, bs) - len(table) + c]
            used += len(new)
            if c:  # the shared last block: the other holders keep the original
                refs.setdefault(table[-1], self.ref_counts[table[-1]])
                copies.append((table[-1], new[0]))
                self.release([table.pop()])
                self.cow_copies += 1
            table += new
            slots.append([table[p // bs] * bs + p % bs for p in range(start, start + n)])
            self.seq_lens[s] = start + n
            if pc is not None:
                self.token_ids[s] += token_ids[t:t + n]  # type: ignore[index]
                t += n
                for i in range(start // bs, (start + n) // bs):  # the blocks that are full now
                    pc.register(table[i], table[i - 1] if i else None, self.token_ids[s][i * bs:(i + 1) * bs])
        return slots, copies

    def _rollback(self, seq_ids: Sequence[Hashable], saved: list[tuple[int, int, int]], refs: dict[int, int],
                  taken: list[int]) -> None:
        """Undo ``_commit`` however far it got; cached blocks evicted for it become plain free blocks."""
        pc = self.prefix_cache
        for s, (held, length, last) in zip(seq_ids, saved):
            del self.tables[s][max(held - 1, 0):], self.token_ids[s][length:]
            self.tables[s] += [last] if held else []
            self.seq_lens[s] = length
            if pc is not None and length % self.block_size:
                pc.forget(last)  # partly filled again
        for b in taken if pc is not None else ():
            pc.forget(b)  # type: ignore[union-attr]  # registered just now, or evicted (gone already)
        self.release(taken)  # back on the stack, taken[0] on top
        for b, count in refs.items():  # the copied blocks get their holders back
            self.share([b] * (count - self.ref_counts[b]))

    def slots(self, seq_id: Hashable) -> list[int]:
        """Flat slot ids of every token of ``seq_id``, in order."""
        bs = self.block_size
        return [b * bs + o for b in self.tables[seq_id] for o in range(bs)][:self.seq_lens[seq_id]]

    def holders(self) -> list[list[tuple[Hashable, int]]]:
        """``holders[b]``: (sequence, logical index) of every table entry naming block ``b``."""
        if self.tables.keys() != self.seq_lens.keys() or self.tables.keys() != self.token_ids.keys():
            raise InvariantError("tables, seq_lens and token_ids hold different sequence ids")
        holders: list[list[tuple[Hashable, int]]] = [[] for _ in range(self.num_blocks)]
        for s, table in self.tables.items():
            for i, b in enumerate(table):
                _check_id(b, self.num_blocks, f"sequence {s!r}")
                if holders[b] and holders[b][-1][0] == s:
                    raise InvariantError(f"1: block {b} appears twice in the table of sequence {s!r}")
                holders[b].append((s, i))
        return holders

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant: 1 reference counts, 2 free blocks,
        3 block ids, 4 table lengths (notebook 02), 5 shared blocks, 6 prefix caching (notebook 06)."""
        holders, bs = self.holders(), self.block_size
        for b, count in enumerate(self.ref_counts):
            if count != len(holders[b]):
                raise InvariantError(f"1: block {b} has reference count {count} but {len(holders[b])} "
                                     f"tables hold it ({[s for s, _ in holders[b]]})")
        free = self.free + list(self.prefix_cache.free_queue if self.prefix_cache else [])
        for b in free:
            _check_id(b, self.num_blocks, "the free stack")
        if len(free_set := set(free)) != len(free):
            raise InvariantError("2: a block appears twice among the free blocks")
        if on_both := [b for b in free if holders[b]]:
            raise InvariantError(f"2: block {on_both[0]} is held by sequence {holders[on_both[0]][0][0]!r} "
                                 f"and also on the free stack")
        if lost := [b for b in range(self.num_blocks) if not holders[b] and b not in free_set]:
            raise InvariantError(f"2: blocks {lost} are neither free nor held (leaked)")
        for s, n in self.seq_lens.items():
            if len(self.tables[s]) != ceil_div(n, bs):
                raise InvariantError(f"4: sequence {s!r} of length {n} holds {len(self.tables[s])} blocks, "
                                     f"expected ceil({n}/{bs}) = {ceil_div(n, bs)}")
        for b, hs in enumerate(holders):
            if len({(i, min(bs, self.seq_lens[s] - i * bs)) for s, i in hs}) > 1:
                raise InvariantError(f"5: shared block {b} differs between its holders {hs} (index, fill)")
        if self.prefix_cache is not None:
            self._check_prefix_cache()

    def _check_prefix_cache(self) -> None:
        pc, bs = self.prefix_cache, self.block_size
        for s in self.tables:
            if len(self.token_ids[s]) != self.seq_lens[s]:
                raise InvariantError(f"6: sequence {s!r} has {len(self.token_ids[s])} token ids for "
                                     f"{self.seq_lens[s]} tokens")
        if isinstance(pc, RadixCache):
            if problem := pc.check(self.tables, self.token_ids):
                raise InvariantError(f"6: {problem}")
            return
        for s, table in self.tables.items():
            for i, b in enumerate(table[:self.seq_lens[s] // bs]):
                key, tokens = pc.keys.get(b), tuple(self.token_ids[s][i * bs:(i + 1) * bs])  # type: ignore
                parent = pc.keys.get(table[i - 1]) if i else None  # type: ignore[union-attr]
                if key is None or key.tokens != tokens or key.parent != parent:
                    raise InvariantError(f"6: full block {b} of sequence {s!r} has key {key}, not its tokens")
        if stale := [b for b in pc.free_queue if not pc.is_cached(b)]:  # type: ignore[union-attr]
            raise InvariantError(f"6: blocks {stale} wait in the prefix cache's queue without cached content")


def _what(seq_ids: Sequence[Hashable], counts: Sequence[int]) -> str:
    if len(seq_ids) != 1:
        return f"a batch of {len(seq_ids)} sequences"
    return f"sequence {seq_ids[0]!r}" if counts[0] == 1 else f"{counts[0]} tokens of sequence {seq_ids[0]!r}"


def _check_id(b: object, num_blocks: int, where: str) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks:
        raise InvariantError(f"3: {where} has invalid block id {b!r}")
