"""``PagedKVCache``: a pool of fixed-size KV blocks, a free-block stack and one block table per sequence.

The layout is the article's (notebook 02)::

    k, v : [num_blocks, num_layers, block_size, kv_heads, head_dim]

Token position ``p`` of sequence ``s`` lives in physical block ``tables[s][p // block_size]`` at offset
``p % block_size``, for every layer at once. Free blocks sit on a stack (a Python list): the top, handed
out next, is the *last* element; taking and giving back are O(1), which is why a stack. Blocks can be
shared (notebook 06): each has a reference count, a sequence that writes into a shared block first copies
it (copy-on-write), and with prefix caching full blocks are found again by content (``prefix_cache.py``):
once the stack is empty, cached blocks nobody holds are evicted, least recently used first.
The file reads as the story: free stack and reference counts -> add / fork / append / free -> slot /
block_table / gather -> checks and display.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

from pagedlib.checks import as_int, ceil_div
from pagedlib.core.prefix_cache import PrefixCache
from pagedlib.teach.sizing import format_bytes

__all__ = ["SUPPORTED_DTYPES", "InvariantError", "OutOfBlocksError", "PagedKVCache", "Slot",
           "UnknownSequenceError"]

#: dtypes a cache can hold: what the attention paths compute in (float64 for reference oracles).
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a call needs. Nothing was changed.

    ``args`` are the constructor's arguments, so the error survives ``pickle`` (a worker process)."""

    def __init__(self, needed: int, free: int, what: str = "") -> None:
        super().__init__(needed, free, what)
        self.needed, self.free, self.what = needed, free, what

    def __str__(self) -> str:
        where = f" for {self.what}" if self.what else ""
        return f"out of KV blocks{where}: {self.needed} needed, {self.free} free"


class UnknownSequenceError(KeyError):
    """A sequence id that the cache does not hold (a ``KeyError``; ``args[0]`` is the id)."""

    def __init__(self, seq_id: Hashable, live: Iterable[Hashable] = ()) -> None:
        live = tuple(live)[:9]  # enough to show 8 and say whether there are more
        super().__init__(seq_id, live)
        self.seq_id, self.live = seq_id, live

    def __str__(self) -> str:  # KeyError would print only repr(args)
        shown = ", ".join(repr(s) for s in self.live[:8]) + (", ..." if len(self.live) > 8 else "")
        return f"unknown sequence id {self.seq_id!r} (live sequences: [{shown}])"


class InvariantError(AssertionError):
    """``check_invariants`` found the bookkeeping inconsistent (a bug, never bad user input)."""


class Slot(NamedTuple):
    """Where one token lives: physical ``block`` id and ``offset`` inside it."""

    block: int
    offset: int


def _locked(method: Callable) -> Callable:
    """Run ``method`` holding the cache's lock, so no other thread sees the state half-changed."""
    @functools.wraps(method)
    def locked(self: PagedKVCache, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class PagedKVCache:
    """Paged KV cache for ``num_layers`` layers, shared by all sequences.

    Args:
        num_blocks: physical blocks in the pool (ids ``0 .. num_blocks-1``).
        num_layers, block_size, kv_heads, head_dim: the pool geometry; one block holds ``block_size``
            tokens of K and V for every layer.
        dtype, device: of both pools (a dtype of ``SUPPORTED_DTYPES``); K/V arguments must match exactly.
        free_order: the order in which blocks are handed out: ``free_order[0]`` is popped first. Distinct
            valid ids; any block not listed follows in ascending order. Default: ``0, 1, 2, ...``. It is
            how notebook 02 reproduces the article's trace (``free_order=[5, 2, 9]``).
        fill: initial value of every slot. Slots that hold no token may contain anything (NaN included).
        enable_prefix_caching: keep full blocks findable by their token ids (see ``add_sequence``); token
            ids then come with every append.

    State (read freely, change only through the methods):
        k, v: the two pools, ``[num_blocks, num_layers, block_size, kv_heads, head_dim]``.
        free: the free-block stack, a ``list[int]``; its top is ``free[-1]``.
        tables: ``dict[seq_id, list[int]]`` physical block ids of each sequence, in logical order.
        seq_lens: ``dict[seq_id, int]`` tokens stored per sequence.
        ref_counts: ``list[int]``, tables holding each block (0: free). ``cow_copies``: blocks copied so far.
        prefix_cache: the ``PrefixCache`` (or ``None``); ``token_ids[seq_id]`` the tokens of each sequence.

    Contract:
        Atomic: every method checks all its arguments (ids, shapes, dtypes, devices, layouts, free blocks)
        before it changes anything; a call that raises leaves tables, lengths, free stack and both pools
        exactly as they were. The pool size is checked against free memory before it is allocated.
        Threads: every public method holds one lock (``threading.RLock``) while it runs, so calls from
        several threads are serialised and ``check_invariants`` never sees a half-done append. Attributes
        and properties (``cache.tables[s]``, ``num_tokens``) are read without it: from threads, use methods.
        Autograd: writes never record history; K/V that require grad are copied as plain values.
    """

    def __init__(self, num_blocks: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 free_order: Sequence[int] | None = None, fill: float = 0.0,
                 enable_prefix_caching: bool = False) -> None:
        self.num_blocks = as_int("num_blocks", num_blocks, minimum=1, maximum=2**31 - 1)  # int32 tables
        self.num_layers = as_int("num_layers", num_layers, minimum=1)
        self.block_size = as_int("block_size", block_size, minimum=1)
        self.kv_heads = as_int("kv_heads", kv_heads, minimum=1)
        self.head_dim = as_int("head_dim", head_dim, minimum=1)
        _check_dtype_and_fill(dtype, fill)
        self.dtype: torch.dtype = dtype
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        order = [as_int(f"free_order[{i}]", b, minimum=0, maximum=self.num_blocks - 1)
                 for i, b in enumerate([] if free_order is None else free_order)]
        if len(set(order)) != len(order):
            raise ValueError(f"free_order must not repeat a block id, got {order}")
        shape = (self.num_blocks, self.num_layers, self.block_size, self.kv_heads, self.head_dim)
        _check_room(shape, dtype, device)
        # the free stack: its top is its last element, so reverse to pop order[0] first
        self.free = (order + sorted(set(range(self.num_blocks)) - set(order)))[::-1]
        self.k = torch.full(shape, fill, dtype=dtype, device=device)
        self.v = torch.full(shape, fill, dtype=dtype, device=device)
        self.device = self.k.device  # normalised ("cuda" -> "cuda:0")
        self.tables: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}
        self.ref_counts = [0] * self.num_blocks
        self.cow_copies = 0
        self.prefix_cache = PrefixCache(self.block_size) if enable_prefix_caching else None
        self.token_ids: dict[Hashable, list[int]] = {}
        self._layer_rows = torch.arange(self.num_layers, device=self.device)[:, None] * self.block_size
        self._lock = threading.RLock()

    # ---------------------------------------------------------------------------------------------
    # ownership: the only places that change reference counts and move blocks in and out of the free pool

    def _take_blocks(self, n: int, what: str) -> list[int]:
        """Take ``n`` free blocks (all or none), each with a reference count of 1: off the top of the
        stack first, then, when it is empty, the least recently used cached blocks (evicted)."""
        if n > self.num_free_blocks:
            raise OutOfBlocksError(n, self.num_free_blocks, what)
        plain = min(n, len(self.free))
        taken = self.free[len(self.free) - plain:][::-1]
        del self.free[len(self.free) - plain:]
        taken += [self.prefix_cache.evict() for _ in range(n - plain)]  # type: ignore[union-attr]
        for b in taken:
            self.ref_counts[b] = 1
        return taken

    def _share_blocks(self, blocks: Sequence[int]) -> None:
        """One more table holds each of ``blocks`` (a fork, a prefix-cache hit)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                self.prefix_cache.reuse(b)  # type: ignore[union-attr]  # only cached blocks are found free
            self.ref_counts[b] += 1

    def _release_blocks(self, blocks: Sequence[int]) -> list[int]:
        """One table fewer holds each of ``blocks``; those nobody holds any more go back, ``blocks[0]`` last
        (on top of the stack, or most recently used in the cache's queue). Returns them, in order."""
        freed = []
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                freed.append(b)
                if self.prefix_cache is None or not self.prefix_cache.release(b):
                    self.free.append(b)
        return freed[::-1]

    # ---------------------------------------------------------------------------------------------
    # write side

    @_locked
    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int] | None = None) -> int:
        """Register a sequence. ``ValueError`` if ``seq_id`` is live or ``None``.

        Without prefix caching (or without ``prompt_token_ids``) it starts empty and 0 is returned. With
        it, the longest run of full leading blocks of the prompt that the cache holds is attached (shared,
        no K/V computed) and the number of tokens found is returned: a multiple of ``block_size``, at most
        ``len(prompt_token_ids) - 1``. The caller appends K/V for the remaining prompt tokens only.
        """
        self._check_new_id("seq_id", seq_id)
        prompt = [] if prompt_token_ids is None else _token_list("prompt_token_ids", prompt_token_ids)
        found = self.prefix_cache.lookup(prompt) if self.prefix_cache and prompt else []
        self._share_blocks(found)
        self.tables[seq_id] = found
        self.seq_lens[seq_id] = len(found) * self.block_size
        self.token_ids[seq_id] = prompt[:self.seq_lens[seq_id]] if self.prefix_cache else []
        return self.seq_lens[seq_id]

    @_locked
    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """A new sequence ``child_id`` that shares every block of ``parent_id`` (reference counts + 1, no
        K/V copied): parallel sampling and beam search. ``KeyError`` for an unknown parent, ``ValueError``
        for a live (or ``None``) child id. The first write into a shared block copies it (copy-on-write)."""
        self._check_seq(parent_id)
        self._check_new_id("child_id", child_id)
        self._share_blocks(self.tables[parent_id])
        self.tables[child_id] = list(self.tables[parent_id])
        self.seq_lens[child_id] = self.seq_lens[parent_id]
        self.token_ids[child_id] = list(self.token_ids[parent_id])

    @_locked
    def append_tokens(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor,
                      token_ids: Sequence[int] | None = None) -> list[int]:
        """Append ``n`` tokens (a prompt) at once, allocating every block they need up front.

        Args:
            k, v: ``[num_layers, n, kv_heads, head_dim]``.
            token_ids: the ``n`` token ids (required with prefix caching).
        Returns:
            the newly allocated block ids, in logical order (empty if the last block had room); the first
            is a copy of the old last block if that block was shared.
        """
        self._check_seq(seq_id)
        self._check_kv("k", k, (self.num_layers, None, self.kv_heads, self.head_dim))
        self._check_kv("v", v, (self.num_layers, k.shape[1], self.kv_heads, self.head_dim))
        n, ids = k.shape[1], self._check_token_ids("token_ids", token_ids, k.shape[1])
        return self._append([seq_id], [n], k, v, ids, f"{n} tokens of sequence {seq_id!r}")[0]

    @_locked
    def append_token(self, seq_id: Hashable, k_vec: torch.Tensor, v_vec: torch.Tensor,
                     token_id: int | None = None) -> Slot:
        """Append one token's K and V for every layer: ``append_tokens`` of one token.

        Args:
            k_vec, v_vec: ``[num_layers, kv_heads, head_dim]``.
            token_id: its token id (required with prefix caching).
        Returns:
            the ``Slot(block, offset)`` written; a new block was popped iff ``offset == 0``.
        """
        self._check_seq(seq_id)
        shape, dims = (self.num_layers, self.kv_heads, self.head_dim), "[num_layers, kv_heads, head_dim]"
        self._check_kv("k_vec", k_vec, shape, dims)
        self._check_kv("v_vec", v_vec, shape, dims)
        token = None if token_id is None else [as_int("token_id", token_id, minimum=0)]
        ids = self._check_token_ids("token_id", token, 1)
        self._append([seq_id], [1], k_vec[:, None], v_vec[:, None], ids, f"sequence {seq_id!r}")  # [L,1,H,D]
        return Slot(self.tables[seq_id][-1], (self.seq_lens[seq_id] - 1) % self.block_size)

    @_locked
    def append_batch(self, seq_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor,
                     token_ids: Sequence[int] | None = None) -> list[Slot]:
        """One decode step: append one token to each of ``batch`` distinct sequences.

        All needed blocks are taken up front (all or nothing), then K and V of every layer are written
        with one indexed write per pool through flat slot ids ``block * block_size + offset`` (the
        ``slot_mapping`` of vLLM's ``reshape_and_cache``).

        Args:
            seq_ids: ``batch`` distinct live sequence ids, in the order of ``k``'s batch dim.
            k, v: ``[num_layers, batch, kv_heads, head_dim]``.
            token_ids: the ``batch`` new token ids (required with prefix caching).
        Returns:
            the ``Slot(block, offset)`` written for each sequence, in order.
        """
        ids = self._live_ids(seq_ids)
        if len(set(ids)) != len(ids):
            dup = next(s for i, s in enumerate(ids) if s in ids[:i])
            raise ValueError(f"seq_ids must be distinct: {dup!r} appears more than once")
        shape, dims = (self.num_layers, len(ids), self.kv_heads, self.head_dim), "[num_layers, batch, H, D]"
        self._check_kv("k", k, shape, dims)
        self._check_kv("v", v, shape, dims)
        tokens = self._check_token_ids("token_ids", token_ids, len(ids))
        self._append(ids, [1] * len(ids), k, v, tokens, f"a batch of {len(ids)} sequences")
        return [Slot(self.tables[s][-1], (self.seq_lens[s] - 1) % self.block_size) for s in ids]

    def _append(self, seq_ids: list[Hashable], counts: list[int], k: torch.Tensor, v: torch.Tensor,
                token_ids: list[int] | None, what: str) -> list[list[int]]:
        """The one write path, once the arguments are checked: ``counts[i]`` tokens for ``seq_ids[i]``, in
        the order of ``k``, ``v`` (``[num_layers, sum(counts), kv_heads, head_dim]``).

        1. plan: copies of shared last blocks about to be written (``_copy_on_write``), and
           ``ceil((len + n) / block_size) - len(table)`` new blocks per sequence;
        2. take all those blocks at once (all or nothing);
        3. copy the shared blocks, then write K and V through flat slot ids (``_write``);
        4. commit tables, lengths, reference counts and token ids (``_commit``).
        Returns the new blocks of each sequence (a copy first).
        """
        bs, copy = self.block_size, self._copy_on_write(seq_ids, counts)
        grow = [ceil_div(self.seq_lens[s] + n, bs) - len(self.tables[s]) for s, n in zip(seq_ids, counts)]
        taken = self._take_blocks(sum(copy) + sum(grow), what)
        new_blocks, copies, slots, used = [], [], [], 0
        for s, n, c, g in zip(seq_ids, counts, copy, grow):
            new, table, start = taken[used:used + c + g], self.tables[s], self.seq_lens[s]
            used += c + g
            if c:
                copies.append((table[-1], new[0]))
            slots += _slots(table[start // bs:len(table) - c] + new, start, start + n, bs)  # where they land
            new_blocks.append(new)
        self._write(slots, k, v, copies, taken)
        self._commit(seq_ids, counts, new_blocks, copy, token_ids)
        return new_blocks

    def _copy_on_write(self, seq_ids: list[Hashable], counts: list[int]) -> list[bool]:
        """Which sequences are about to write into a partly filled last block that another table holds
        too. Of several sharers appending in one call, the last writes in place: it holds it alone by then."""
        plan, copied = [], Counter()
        for s, n in zip(seq_ids, counts):
            last = self.tables[s][-1] if n and self.seq_lens[s] % self.block_size else None
            plan.append(last is not None and self.ref_counts[last] - copied[last] > 1)
            if plan[-1]:
                copied[last] += 1
        return plan

    def _commit(self, seq_ids: list[Hashable], counts: list[int], new_blocks: list[list[int]],
                copy: list[bool], token_ids: list[int] | None) -> None:
        """Step 4 of ``_append`` (cannot fail): the copied originals lose one holder, tables and lengths
        grow, and with prefix caching every block that just became full is registered by content."""
        bs, tokens = self.block_size, iter(token_ids or [])
        for s, n, new, c in zip(seq_ids, counts, new_blocks, copy):
            if c:
                self._release_blocks([self.tables[s].pop()])  # still held by the others: never freed here
                self.cow_copies += 1
            start, table = self.seq_lens[s], self.tables[s]
            table += new
            self.seq_lens[s] = start + n
            if self.prefix_cache is not None:
                self.token_ids[s] += [next(tokens) for _ in range(n)]
                for i in range(start // bs, (start + n) // bs):  # blocks that are full now
                    self.prefix_cache.register(table[i], table[i - 1] if i else None,
                                               self.token_ids[s][i * bs:(i + 1) * bs])

    def _rows(self, slots: list[int]) -> torch.Tensor:
        """int64 ``[num_layers * n]`` rows (layer-major) of flat slot ids ``slots`` in the pool flattened to
        ``[num_blocks * num_layers * block_size, kv_heads, head_dim]``.

        ``slot = block * block_size + offset`` is vLLM's ``slot_mapping``. vLLM keeps one cache tensor per
        layer, so a slot id is a row there. Here the layer dim sits between block and offset, so the row of
        (layer ``l``, slot) is ``(block * num_layers + l) * block_size + offset``.
        """
        L, bs = self.num_layers, self.block_size
        first = torch.tensor([s // bs * L * bs + s % bs for s in slots], dtype=torch.long, device=self.device)
        return (first + self._layer_rows).view(-1)                   # [L, 1] + [n]: row of layer l = + l * bs

    def _write(self, slots: list[int], k: torch.Tensor, v: torch.Tensor, copies: list[tuple[int, int]],
               taken: list[int]) -> None:
        """Copy block ``src`` to ``dst`` for each pair of ``copies`` (K and V, every layer), then write token
        ``i`` of ``k``, ``v`` (``[num_layers, n, kv_heads, head_dim]``, already checked) into flat slot
        ``slots[i]`` of every layer: one ``index_copy_`` per pool. If torch still fails (out of memory, an
        interrupt), the blocks ``taken`` go back to the free stack: the one rollback (cached blocks evicted
        for them stay evicted)."""
        flat = (-1, self.kv_heads, self.head_dim)
        try:
            if copies:  # copy-on-write: the only K/V the cache ever copies
                src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*copies))
                for pool in (self.k, self.v):
                    pool[dst] = pool[src]                                    # [c, L, block_size, H, D]
            rows = self._rows(slots)
            # detach: a K/V that requires grad must not pull the pools into autograd (nor stay alive)
            self.k.view(flat).index_copy_(0, rows, k.detach().reshape(flat))  # [L, n, H, D] -> [L * n, H, D]
            self.v.view(flat).index_copy_(0, rows, v.detach().reshape(flat))
        except BaseException:
            self._release_blocks(taken)
            raise

    @_locked
    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence: each of its blocks loses a holder. Returns the blocks nobody holds any more,
        now free (all of them unless some were shared), in table order; the first ends on top of the stack."""
        self._check_seq(seq_id)
        del self.seq_lens[seq_id], self.token_ids[seq_id]
        return self._release_blocks(self.tables.pop(seq_id))

    @_locked
    def release_leading_blocks(self, seq_id: Hashable, n: int) -> list[int]:
        """Free the first ``n`` blocks of a sequence, all full, whose tokens it no longer needs (a sliding
        window, ``pagedlib.window``). The sequence then holds ``n * block_size`` tokens fewer and its table
        starts at its former block ``n``; the caller keeps the offset of the first token held. The blocks
        must be its own (a shared block sits at one logical index in all its holders) and prefix caching
        off (a block's key names its parent block, which would be gone). Returns the freed block ids."""
        self._check_seq(seq_id)
        if self.prefix_cache is not None:
            raise ValueError("release_leading_blocks needs a cache without prefix caching "
                             "(enable_prefix_caching=False)")
        if shared := [b for b in self.tables[seq_id] if self.ref_counts[b] > 1]:
            raise ValueError(f"release_leading_blocks needs blocks held by sequence {seq_id!r} alone; "
                             f"blocks {shared} are shared (fork)")
        n = as_int("n", n, minimum=0, maximum=self.seq_lens[seq_id] // self.block_size)
        blocks = self.tables[seq_id][:n]
        del self.tables[seq_id][:n]
        self.seq_lens[seq_id] -= n * self.block_size
        return self._release_blocks(blocks)

    # ---------------------------------------------------------------------------------------------
    # read side

    @_locked
    def slot(self, seq_id: Hashable, pos: int) -> Slot:
        """``Slot(block, offset)`` of token ``pos`` (0-based, ``0 <= pos < seq_len``)."""
        self._check_seq(seq_id)
        pos, n = as_int("pos", pos), self.seq_lens[seq_id]
        if not 0 <= pos < n:
            raise IndexError(f"pos must be in [0, {n}) for sequence {seq_id!r} of length {n}, got {pos}")
        return Slot(self.tables[seq_id][pos // self.block_size], pos % self.block_size)

    @_locked
    def block_table(self, seq_ids: Iterable[Hashable], width: int | None = None) -> torch.Tensor:
        """int32 ``[batch, max_blocks]`` block tables padded with -1, on the cache's device.

        ``width`` fixes ``max_blocks`` (default: the longest table in the batch)."""
        tables = [self.tables[s] for s in self._live_ids(seq_ids)]
        longest = max((len(t) for t in tables), default=0)
        width = longest if width is None else as_int("width", width)
        if width < longest:
            raise ValueError(f"width must be >= {longest} (the longest table), got {width}")
        rows = [t + [-1] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width).to(self.device)

    @_locked
    def seq_lens_tensor(self, seq_ids: Iterable[Hashable]) -> torch.Tensor:
        """int32 ``[batch]`` lengths of ``seq_ids``, on the cache's device."""
        lens = [self.seq_lens[s] for s in self._live_ids(seq_ids)]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    @_locked
    def gather(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of a sequence's K and V: ``[num_layers, seq_len, kv_heads, head_dim]``.

        One ``index_select`` per pool over the flattened rows of its tokens (see ``_rows``)."""
        self._check_seq(seq_id)
        rows = self._rows(_slots(self.tables[seq_id], 0, self.seq_lens[seq_id], self.block_size))
        flat = (-1, self.kv_heads, self.head_dim)
        out = (self.num_layers, self.seq_lens[seq_id], self.kv_heads, self.head_dim)
        k, v = (pool.view(flat).index_select(0, rows).view(out) for pool in (self.k, self.v))
        return k, v

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        """Views ``k[:, l]``, ``v[:, l]``: ``[num_blocks, block_size, kv_heads, head_dim]`` (strided, no
        copy): what attention and kernels take."""
        l = as_int("l", l)  # noqa: E741
        if not -self.num_layers <= l < self.num_layers:
            raise IndexError(f"layer l must be in [-{self.num_layers}, {self.num_layers}), got {l}")
        return self.k[:, l], self.v[:, l]

    @_locked
    def ref_count(self, block_id: int) -> int:
        """How many tables hold block ``block_id`` (0: it is free)."""
        return self.ref_counts[as_int("block_id", block_id, minimum=0, maximum=self.num_blocks - 1)]

    @_locked
    def is_cached(self, block_id: int) -> bool:
        """Block ``block_id`` holds content that prefix caching can find (in use, or free but kept)."""
        block_id = as_int("block_id", block_id, minimum=0, maximum=self.num_blocks - 1)
        return self.prefix_cache is not None and self.prefix_cache.is_cached(block_id)

    @_locked
    def prefix_cache_stats(self) -> dict[str, float]:
        """``PrefixCache.stats()``; all 0 when prefix caching is off."""
        return (self.prefix_cache or PrefixCache(self.block_size)).stats()

    @property
    def num_free_blocks(self) -> int:  # plain free blocks plus cached blocks nobody holds
        return len(self.free) + (len(self.prefix_cache.free_queue) if self.prefix_cache else 0)

    @property
    def num_used_blocks(self) -> int:  # blocks at least one table holds (shared ones count once)
        return self.num_blocks - self.num_free_blocks

    @property
    def num_tokens(self) -> int:  # token slots holding a token, over all sequences
        return sum(self.seq_lens.values())

    @property
    def num_allocated_slots(self) -> int:  # token slots in the sequences' blocks (a shared block per holder)
        return sum(len(t) for t in self.tables.values()) * self.block_size

    @property
    def utilization(self) -> float:
        """Token slots used / allocated (1.0 when nothing is allocated); ``1 - utilization`` is the internal
        fragmentation: the unwritten tails of last blocks."""
        allocated = self.num_allocated_slots
        return self.num_tokens / allocated if allocated else 1.0

    @_locked
    def sequence_utilization(self, seq_id: Hashable) -> float:
        """Utilization of one sequence's blocks (1.0 for an empty sequence)."""
        self._check_seq(seq_id)
        allocated = len(self.tables[seq_id]) * self.block_size
        return self.seq_lens[seq_id] / allocated if allocated else 1.0

    # ---------------------------------------------------------------------------------------------
    # argument checks (metadata only: no device synchronisation)

    def _check_seq(self, seq_id: Hashable) -> None:
        if seq_id not in self.seq_lens:
            raise UnknownSequenceError(seq_id, self.seq_lens)

    def _check_new_id(self, name: str, seq_id: Hashable) -> None:
        if seq_id is None:
            raise ValueError(f"{name} must not be None (block_owners() uses None for a free block)")
        if seq_id in self.seq_lens:  # also the TypeError of an unhashable id, before anything changes
            raise ValueError(f"{name} {seq_id!r} already exists")

    def _check_token_ids(self, name: str, token_ids: Sequence[int] | None, n: int) -> list[int] | None:
        """``n`` token ids as plain ints, or ``None``; required when prefix caching is on."""
        if token_ids is None:
            if self.prefix_cache is not None and n:
                raise ValueError(f"{name} is required when prefix caching is on (blocks are found by them)")
            return None
        ids = _token_list(name, token_ids)
        if len(ids) != n:
            raise ValueError(f"{name} must hold {n} token ids, one per token of K/V, got {len(ids)}")
        return ids

    def _live_ids(self, seq_ids: Iterable[Hashable] | torch.Tensor) -> list[Hashable]:
        """``seq_ids`` as a list (read once: generators work; a 1-d tensor gives its values), all live."""
        if isinstance(seq_ids, (set, frozenset, str, bytes)) or (
                isinstance(seq_ids, torch.Tensor) and seq_ids.dim() != 1):
            raise ValueError(f"seq_ids must be an ordered sequence of ids (list, tuple, 1-d tensor), "
                             f"got {type(seq_ids).__name__}")
        ids = seq_ids.tolist() if isinstance(seq_ids, torch.Tensor) else list(seq_ids)
        for s in ids:
            self._check_seq(s)
        return ids

    def _check_kv(self, name: str, t: object, shape: tuple[int | None, ...],
                  dims: str = "[num_layers, n, kv_heads, head_dim]") -> None:
        """A K/V argument must be a dense tensor of ``shape`` (``None``: any size), of the pools' dtype and
        device, and must not share memory with the pools (it would change while being written)."""
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested:
            got = f"layout {t.layout}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a dense torch.Tensor, got {got}")
        if t.dim() != len(shape) or any(d not in (None, g) for d, g in zip(shape, t.shape)):
            want = ", ".join("n" if d is None else str(d) for d in shape)
            raise ValueError(f"{name} must have shape {dims} = [{want}], got {list(t.shape)}")
        if t.dtype != self.dtype or t.device != self.device:
            raise ValueError(f"{name} must have dtype {self.dtype} on device {self.device}, "
                             f"got {t.dtype} on {t.device}")
        if t.numel() and t.untyped_storage().data_ptr() in (self.k.data_ptr(), self.v.data_ptr()):
            raise ValueError(f"{name} must not be a view of the cache's own pools (pass a .clone())")

    @_locked
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant:

        1. a block's reference count is the number of tables holding it (each table holds it at most
           once): 1 for a block of one sequence, more for a shared one, 0 for a free one;
        2. no held block is free, and every free block is on the stack or in the prefix cache's queue, once;
        3. every table entry (and every free entry) is a valid block id;
        4. a sequence of length ``n`` holds exactly ``ceil(n / block_size)`` blocks;
        5. a shared block is the same logical block, equally filled, in every table holding it;
        6. with prefix caching: a sequence's token ids match its length, each full block's key holds the
           tokens of every sequence holding it, and the queue holds only cached blocks.
        """
        holders = self._holders()
        for b, count in enumerate(self.ref_counts):
            if count != len(holders[b]):
                raise InvariantError(f"1: block {b} has reference count {count} but {len(holders[b])} "
                                     f"tables hold it ({[s for s, _ in holders[b]]})")
        free = self.free + list(self.prefix_cache.free_queue if self.prefix_cache else [])
        for b in free:
            _check_id(b, self.num_blocks, "the free stack")
        if len(set(free)) != len(free):
            raise InvariantError("2: a block appears twice among the free blocks")
        if on_both := [b for b in free if holders[b]]:
            raise InvariantError(f"2: block {on_both[0]} is held by sequence {holders[on_both[0]][0][0]!r} "
                                 f"and also on the free stack")
        if lost := [b for b in range(self.num_blocks) if not holders[b] and b not in set(free)]:
            raise InvariantError(f"2: blocks {lost} are neither free nor held (leaked)")
        for s, n in self.seq_lens.items():
            if len(self.tables[s]) != ceil_div(n, self.block_size):
                raise InvariantError(f"4: sequence {s!r} of length {n} holds {len(self.tables[s])} blocks, "
                                     f"expected ceil({n}/{self.block_size}) = {ceil_div(n, self.block_size)}")
        for b, hs in enumerate(holders):
            if len({(i, self._fill(s, i)) for s, i in hs}) > 1:
                raise InvariantError(f"5: shared block {b} differs between its holders {hs} (index, fill)")
        if self.prefix_cache is not None:
            self._check_prefix_cache()

    def _holders(self) -> list[list[tuple[Hashable, int]]]:
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

    def _fill(self, seq_id: Hashable, i: int) -> int:
        """Tokens that logical block ``i`` of ``seq_id`` holds."""
        return min(self.block_size, self.seq_lens[seq_id] - i * self.block_size)

    def _check_prefix_cache(self) -> None:
        pc, bs = self.prefix_cache, self.block_size
        for s, table in self.tables.items():
            if len(self.token_ids[s]) != self.seq_lens[s]:
                raise InvariantError(f"6: sequence {s!r} has {len(self.token_ids[s])} token ids for "
                                     f"{self.seq_lens[s]} tokens")
            for i, b in enumerate(table[:self.seq_lens[s] // bs]):
                key = pc.keys.get(b)  # type: ignore[union-attr]
                parent = pc.keys.get(table[i - 1]) if i else None  # type: ignore[union-attr]
                tokens = tuple(self.token_ids[s][i * bs:(i + 1) * bs])
                if key is None or key.tokens != tokens or key.parent != parent:
                    raise InvariantError(f"6: full block {b} of sequence {s!r} has key {key}, not its tokens")
        if stale := [b for b in pc.free_queue if not pc.is_cached(b)]:  # type: ignore[union-attr]
            raise InvariantError(f"6: blocks {stale} wait in the prefix cache's queue without cached content")

    # ---------------------------------------------------------------------------------------------
    # display and test helpers

    @_locked
    def block_owners(self) -> list[Hashable | None]:
        """``owners[b]``: the first sequence holding physical block ``b``, or ``None`` if it is free."""
        return [hs[0] if hs else None for hs in self.block_holders()]

    @_locked
    def block_holders(self) -> list[list[Hashable]]:
        """``holders[b]``: every sequence holding block ``b`` (``ref_count(b)`` of them), in table order."""
        return [[s for s, _ in hs] for hs in self._holders()]

    @_locked
    def fill_unused(self, value: float = float("nan")) -> None:
        """Write ``value`` into every slot that holds no token (free blocks, unwritten tails; cached free
        blocks keep their content).

        Attention must ignore those slots; poisoning them with NaN makes a test prove it."""
        used = torch.zeros(self.num_blocks, self.block_size, dtype=torch.bool)  # [num_blocks, bs]
        for s, table in self.tables.items():
            used.view(-1)[_slots(table, 0, self.seq_lens[s], self.block_size)] = True
        used[list(self.prefix_cache.free_queue if self.prefix_cache else [])] = True  # kept for later hits
        unused = (~used).to(self.device)
        for pool in (self.k, self.v):
            pool.transpose(1, 2)[unused] = value  # view [num_blocks, bs, L, H, D]; writes through

    @_locked
    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        top = f"top of stack: {self.free[-1]}" if self.free else "stack empty"
        cached = f", {len(self.prefix_cache.free_queue)} of them cached" if self.prefix_cache else ""
        shared = sum(c > 1 for c in self.ref_counts)
        lines = [f"PagedKVCache(num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
                 f"block_size={self.block_size}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                 f"dtype={dtype}, device={self.device})",
                 f"  blocks: {self.num_used_blocks} used, {self.num_free_blocks} free{cached} ({top})"
                 + (f", {shared} shared, {self.cow_copies} copied" if shared or self.cow_copies else ""),
                 f"  tokens: {self.num_tokens} in {self.num_allocated_slots} allocated slots "
                 f"(utilization {self.utilization:.0%})"]
        lines += [f"  seq {s!r}: len {self.seq_lens[s]}, table {t}" for s, t in list(self.tables.items())[:8]]
        if len(self.tables) > 8:
            lines.append(f"  ... and {len(self.tables) - 8} more sequences")
        return "\n".join(lines)

    @_locked
    def state_diff(self, before: PagedKVCache) -> list[str]:
        """Names of the attributes in which this cache differs from ``before`` (a ``copy.deepcopy`` taken
        earlier), pools compared bit for bit with NaN equal to NaN: ``[]`` means a failed call changed
        nothing, which is how the tests and notebook 02 check atomicity."""
        theirs = before.__getstate__()
        return [name for name, mine in self.__getstate__().items() if not _same(mine, theirs[name])]

    def __getstate__(self) -> dict:  # copy.deepcopy and pickle: everything but the lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()


def _same(a: object, b: object) -> bool:
    """``a == b``; for tensors: same dtype, shape and values, NaN equal to NaN."""
    if not isinstance(a, torch.Tensor):
        return a == b
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


def _check_id(b: object, num_blocks: int, where: str) -> None:
    if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks:
        raise InvariantError(f"3: {where} has invalid block id {b!r}")


def _check_dtype_and_fill(dtype: object, fill: object) -> None:
    """``dtype`` must be supported and ``fill`` a real number it can hold (NaN and inf are fine)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype!r}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise ValueError(f"fill must be a real number, got {fill!r} ({type(fill).__name__})")
    if math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max:
        raise ValueError(f"fill must be representable in {dtype} (|fill| <= {torch.finfo(dtype).max:g}), "
                         f"got {fill!r}")


def _check_room(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
    """Refuse, before allocating, two pools larger than the memory free on ``device`` (CUDA, Linux)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from e
    need, free = 2 * math.prod(shape) * dtype.itemsize, None
    if dev.type == "cuda" and torch.cuda.is_available():
        free = torch.cuda.mem_get_info(dev)[0]
    elif dev.type == "cpu" and os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            found = re.search(r"MemAvailable:\s+(\d+) kB", f.read())
        free = int(found.group(1)) * 1024 if found else None
    if free is not None and need > free:
        raise ValueError(f"num_blocks={shape[0]} asks for {need:,} bytes ({format_bytes(need)}) of K and V "
                         f"pools {list(shape)}, more than the {format_bytes(free)} free on {dev}")


def _slots(blocks: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Flat slot ids ``block * block_size + offset`` of positions ``start .. stop-1`` of a sequence whose
    blocks from the one holding ``start`` on are ``blocks`` (``table[start // block_size:]``)."""
    first = start - start % block_size
    return [blocks[(p - first) // block_size] * block_size + p % block_size for p in range(start, stop)]


def _token_list(name: str, token_ids: Sequence[int]) -> list[int]:
    """Token ids as a list of non-negative Python ints (a list, tuple, range or 1-d tensor; not a str)."""
    if isinstance(token_ids, (str, bytes, set, frozenset)) or not hasattr(token_ids, "__len__"):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(token_ids).__name__}")
    values = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    return [as_int(f"{name}[{i}]", t, minimum=0) for i, t in enumerate(values)]
