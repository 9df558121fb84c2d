"""``PagedKVCache``: a pool of fixed-size KV blocks, a free-block stack and one block table per sequence.

The layout is the article's (notebook 02)::

    k, v : [num_blocks, num_layers, block_size, kv_heads, head_dim]

Token position ``p`` of sequence ``s`` lives in physical block ``tables[s][p // block_size]`` at offset
``p % block_size``, for every layer at once. Free blocks sit on a stack (a Python list): ``pop()`` takes the
top (the *last* element), ``append()`` gives a block back. Both are O(1), which is why a stack.

Every mutating call validates everything first and changes nothing when it fails: no block popped, no table
or length touched, no slot of either pool written. The only two methods that move blocks between the free
stack and the sequences are ``_take_blocks`` and ``_release_blocks`` (ownership lives in one place, so that
reference counting for shared blocks can be added there later).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

__all__ = [
    "InvariantError",
    "OutOfBlocksError",
    "PagedKVCache",
    "Slot",
    "UnknownSequenceError",
]


def _index_tensor(values: list[int]) -> torch.Tensor:
    """int64 CPU tensor of a list of ints; via ``array`` it is ~5x cheaper than ``torch.tensor(list)``."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a call needs. Nothing was changed."""

    def __init__(self, needed: int, free: int, what: str = "") -> None:
        self.needed = needed
        self.free = free
        where = f" for {what}" if what else ""
        super().__init__(f"out of KV blocks{where}: {needed} needed, {free} free")


class UnknownSequenceError(KeyError):
    """A sequence id that the cache does not hold (a ``KeyError``)."""

    def __init__(self, seq_id: Hashable, live: Iterable[Hashable] = ()) -> None:
        self.seq_id = seq_id
        live = list(live)
        shown = ", ".join(repr(s) for s in live[:8]) + (", ..." if len(live) > 8 else "")
        self.message = f"unknown sequence id {seq_id!r} (live sequences: [{shown}])"
        super().__init__(seq_id)

    def __str__(self) -> str:  # KeyError would print only repr(seq_id)
        return self.message


class InvariantError(AssertionError):
    """``check_invariants`` found the bookkeeping inconsistent (a bug, never bad user input)."""


class Slot(NamedTuple):
    """Where one token lives: physical ``block`` id and ``offset`` inside it."""

    block: int
    offset: int


class PagedKVCache:
    """Paged KV cache for ``num_layers`` layers, shared by all sequences.

    Args:
        num_blocks: physical blocks in the pool (ids ``0 .. num_blocks-1``).
        num_layers, block_size, kv_heads, head_dim: the pool geometry; one block holds ``block_size``
            tokens of K and V for every layer.
        dtype, device: of both pools; every K/V argument must match them exactly.
        free_order: the order in which blocks are handed out: ``free_order[0]`` is popped first. Distinct
            valid ids; any block not listed follows in ascending order. Default: ``0, 1, 2, ...``. It is
            how notebook 02 reproduces the article's trace (``free_order=[5, 2, 9]``).
        fill: initial value of every slot. Slots that hold no token may contain anything (NaN included).

    State (read freely, change only through the methods):
        k, v: ``[num_blocks, num_layers, block_size, kv_heads, head_dim]`` pools.
        free: the free-block stack, a ``list[int]``; the top (next block handed out) is ``free[-1]``.
        tables: ``dict[seq_id, list[int]]`` physical block ids of each sequence, in logical order.
        seq_lens: ``dict[seq_id, int]`` tokens stored per sequence.
    """

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        free_order: Sequence[int] | None = None,
        fill: float = 0.0,
    ) -> None:
        for name, value in [("num_blocks", num_blocks), ("num_layers", num_layers),
                            ("block_size", block_size), ("kv_heads", kv_heads), ("head_dim", head_dim)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_blocks, num_layers, block_size, kv_heads, head_dim)
        self.k = torch.full(shape, fill, dtype=dtype, device=device)
        self.v = torch.full(shape, fill, dtype=dtype, device=device)
        self.device = self.k.device  # normalised ("cuda" -> "cuda:0")
        # [L, 1]: row offset of layer l inside a block, in the flattened pool (see _write)
        self._layer_rows = (torch.arange(num_layers) * block_size)[:, None].to(self.device)
        self.free: list[int] = self._initial_free_stack(free_order)
        self.tables: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}

    def _initial_free_stack(self, free_order: Sequence[int] | None) -> list[int]:
        order = [] if free_order is None else list(free_order)
        for b in order:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.num_blocks:
                raise ValueError(f"free_order must hold block ids in [0, {self.num_blocks}), got {b!r}")
        if len(set(order)) != len(order):
            raise ValueError(f"free_order must not repeat a block id, got {order}")
        listed = set(order)
        order += [b for b in range(self.num_blocks) if b not in listed]
        return order[::-1]  # the stack's top is its last element: reverse so order[0] is popped first

    # ---------------------------------------------------------------------------------------------
    # ownership: the only two places that move blocks between the free stack and the sequences

    def _take_blocks(self, n: int, what: str) -> list[int]:
        """Pop ``n`` blocks off the free stack (all or none), in the order they come off."""
        if n > len(self.free):
            raise OutOfBlocksError(n, len(self.free), what)
        if n == 0:
            return []
        taken = self.free[-n:][::-1]
        del self.free[-n:]
        return taken

    def _release_blocks(self, blocks: Sequence[int]) -> None:
        """Push ``blocks`` back so that ``blocks[0]`` ends on top (undoes ``_take_blocks`` exactly)."""
        self.free.extend(reversed(blocks))

    # ---------------------------------------------------------------------------------------------
    # validation helpers (metadata only: no device synchronisation)

    def _check_seq(self, seq_id: Hashable) -> None:
        if seq_id not in self.seq_lens:
            raise UnknownSequenceError(seq_id, self.seq_lens)

    def _live_ids(self, seq_ids: Iterable[Hashable] | torch.Tensor) -> list[Hashable]:
        """``seq_ids`` as a list (read once: generators work; a tensor gives its values), all live."""
        ids = seq_ids.tolist() if isinstance(seq_ids, torch.Tensor) else list(seq_ids)
        for s in ids:
            self._check_seq(s)
        return ids

    def _check_kv(self, name: str, t: object, shape: tuple[int | None, ...], dims: str) -> None:
        """``shape`` entries that are ``None`` (a prompt's ``n``) match any size."""
        want = "[" + ", ".join("n" if d is None else str(d) for d in shape) + "]"
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape {dims} = {want}, "
                             f"got {type(t).__name__}")
        if t.dim() != len(shape) or any(d not in (None, g) for d, g in zip(shape, t.shape, strict=True)):
            raise ValueError(f"{name} must have shape {dims} = {want}, got {list(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{name} must have dtype {self.dtype}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} must be on device {self.device}, got {t.device}")

    # ---------------------------------------------------------------------------------------------
    # write side

    def add_sequence(self, seq_id: Hashable) -> None:
        """Register an empty sequence (no blocks yet). ``ValueError`` if ``seq_id`` is already live."""
        hash(seq_id)  # TypeError for an unhashable id, before anything changes
        if seq_id in self.seq_lens:
            raise ValueError(f"sequence id {seq_id!r} already exists")
        self.tables[seq_id] = []
        self.seq_lens[seq_id] = 0

    def append_token(self, seq_id: Hashable, k_vec: torch.Tensor, v_vec: torch.Tensor) -> Slot:
        """Append one token's K and V for every layer.

        Args:
            k_vec, v_vec: ``[num_layers, kv_heads, head_dim]``.
        Returns:
            the ``Slot(block, offset)`` written; a new block was popped iff ``offset == 0``.
        """
        self._check_seq(seq_id)
        shape = (self.num_layers, self.kv_heads, self.head_dim)
        self._check_kv("k_vec", k_vec, shape, "[num_layers, kv_heads, head_dim]")
        self._check_kv("v_vec", v_vec, shape, "[num_layers, kv_heads, head_dim]")
        pos = self.seq_lens[seq_id]
        table = self.tables[seq_id]
        offset = pos % self.block_size
        new = self._take_blocks(1, f"sequence {seq_id!r}") if offset == 0 else []
        block = new[0] if new else table[-1]
        try:
            self.k[block, :, offset] = k_vec  # [num_layers, kv_heads, head_dim]
            self.v[block, :, offset] = v_vec
        except BaseException:
            self._release_blocks(new)
            raise
        table.extend(new)
        self.seq_lens[seq_id] = pos + 1
        return Slot(block, offset)

    def append_tokens(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """Append ``n`` tokens (a prompt) at once, allocating every block they need up front.

        Args:
            k, v: ``[num_layers, n, kv_heads, head_dim]``.
        Returns:
            the newly allocated block ids, in logical order (empty if the last block had room).
        """
        self._check_seq(seq_id)
        dims = "[num_layers, n, kv_heads, head_dim]"
        self._check_kv("k", k, (self.num_layers, None, self.kv_heads, self.head_dim), dims)
        n = k.shape[1]
        self._check_kv("v", v, (self.num_layers, n, self.kv_heads, self.head_dim), dims + f" with n={n}")
        if n == 0:
            return []
        start = self.seq_lens[seq_id]
        table = self.tables[seq_id]
        needed = -(-(start + n) // self.block_size) - len(table)
        new = self._take_blocks(needed, f"{n} tokens of sequence {seq_id!r}")
        try:
            bs = self.block_size
            pos = torch.arange(start, start + n)                                   # [n] positions
            touched = _index_tensor(table[start // bs:] + new)                     # blocks written
            phys = touched[pos // bs - start // bs]                                # [n] block per token
            self._write(phys * bs + pos % bs, k, v)                                # [n] flat slot ids
        except BaseException:
            self._release_blocks(new)
            raise
        table.extend(new)
        self.seq_lens[seq_id] = start + n
        return new

    def append_batch(self, seq_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor) -> list[Slot]:
        """One decode step: append one token to each of ``batch`` distinct sequences.

        All needed blocks are popped up front (all or nothing), then K and V of every layer are written
        with one indexed write per pool through flat slot ids ``block * block_size + offset`` (the
        ``slot_mapping`` of vLLM's ``reshape_and_cache``).

        Args:
            seq_ids: ``batch`` distinct live sequence ids.
            k, v: ``[num_layers, batch, kv_heads, head_dim]``.
        Returns:
            the ``Slot(block, offset)`` written for each sequence, in order.
        """
        seq_ids = self._live_ids(seq_ids)
        lens = self.seq_lens
        if len(set(seq_ids)) != len(seq_ids):
            dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise ValueError(f"seq_ids must be distinct: {dup!r} appears more than once")
        shape = (self.num_layers, len(seq_ids), self.kv_heads, self.head_dim)
        self._check_kv("k", k, shape, "[num_layers, batch, kv_heads, head_dim]")
        self._check_kv("v", v, shape, "[num_layers, batch, kv_heads, head_dim]")
        if not seq_ids:
            return []
        bs = self.block_size
        offsets = [lens[s] % bs for s in seq_ids]
        needed = offsets.count(0)
        new = self._take_blocks(needed, f"a batch of {len(seq_ids)} sequences")
        fresh = iter(new)
        tables = self.tables
        blocks = [next(fresh) if off == 0 else tables[s][-1] for s, off in zip(seq_ids, offsets, strict=True)]
        try:
            slots = [b * bs + off for b, off in zip(blocks, offsets, strict=True)]  # vLLM's slot_mapping
            self._write(_index_tensor(slots), k, v)
        except BaseException:
            self._release_blocks(new)
            raise
        for s, b, off in zip(seq_ids, blocks, offsets, strict=True):
            if off == 0:
                self.tables[s].append(b)
            lens[s] += 1
        return [Slot(b, off) for b, off in zip(blocks, offsets, strict=True)]

    def _write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write token ``i`` of ``k``, ``v`` (``[num_layers, n, kv_heads, head_dim]``) into flat slot
        ``slots[i]`` (int64 ``[n]`` on the CPU) of every layer: one ``index_copy_`` per pool.

        ``slot = block * block_size + offset`` is vLLM's ``slot_mapping``. vLLM keeps one cache tensor per
        layer, ``[num_blocks * block_size, ...]`` once flattened, so a slot id is a row index there. Here the
        layer dim sits between block and offset, so in the pool flattened to
        ``[num_blocks * num_layers * block_size, kv_heads, head_dim]`` the row of (layer ``l``, slot) is
        ``(block * num_layers + l) * block_size + offset``.
        """
        L, bs = self.num_layers, self.block_size
        blocks, offsets = slots // bs, slots % bs
        rows = (blocks * (L * bs) + offsets).to(self.device, non_blocking=True)  # [n] rows of layer 0
        rows = (rows[None, :] + self._layer_rows).reshape(-1)                      # [L * n], layer-major
        flat = (-1, self.kv_heads, self.head_dim)
        self.k.view(flat).index_copy_(0, rows, k.reshape(flat))  # k: [L, n, H, D] -> [L * n, H, D]
        self.v.view(flat).index_copy_(0, rows, v.reshape(flat))

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Forget a sequence and push all its blocks back on the free stack (its first block ends on
        top). Returns the freed block ids."""
        self._check_seq(seq_id)
        blocks = self.tables.pop(seq_id)
        del self.seq_lens[seq_id]
        self._release_blocks(blocks)
        return blocks

    # ---------------------------------------------------------------------------------------------
    # read side

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        """Views ``k[:, l]``, ``v[:, l]``: ``[num_blocks, block_size, kv_heads, head_dim]`` (strided, no
        copy): what attention and kernels take."""
        if not -self.num_layers <= l < self.num_layers:
            raise IndexError(f"layer {l} out of range for {self.num_layers} layers")
        return self.k[:, l], self.v[:, l]

    def block_table(self, seq_ids: Iterable[Hashable], width: int | None = None) -> torch.Tensor:
        """int32 ``[batch, max_blocks]`` block tables padded with -1, on the cache's device.

        ``width`` fixes ``max_blocks`` (default: the longest table in the batch)."""
        tables = [self.tables[s] for s in self._live_ids(seq_ids)]
        longest = max((len(t) for t in tables), default=0)
        width = longest if width is None else width
        if width < longest:
            raise ValueError(f"width must be at least {longest} (the longest table), got {width}")
        rows = [t + [-1] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width).to(self.device)

    def seq_lens_tensor(self, seq_ids: Iterable[Hashable]) -> torch.Tensor:
        """int32 ``[batch]`` lengths of ``seq_ids``, on the cache's device."""
        lens = [self.seq_lens[s] for s in self._live_ids(seq_ids)]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    def gather(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of a sequence's K and V: ``[num_layers, seq_len, kv_heads, head_dim]``.

        One block-granular index per pool: ``k[table]`` is ``[n_blocks, L, block_size, H, D]``; moving
        the layer dim first and merging (block, offset) puts the tokens in order; the tail is cut off.
        """
        self._check_seq(seq_id)
        n = self.seq_lens[seq_id]
        idx = torch.tensor(self.tables[seq_id], dtype=torch.long, device=self.device)
        out = []
        for pool in (self.k, self.v):
            blocks = pool[idx]                                       # [n_blocks, L, bs, H, D]
            seq = blocks.transpose(0, 1).reshape(self.num_layers, -1, self.kv_heads, self.head_dim)
            out.append(seq[:, :n].contiguous())                      # [L, n, H, D]
        return out[0], out[1]

    def slot(self, seq_id: Hashable, pos: int) -> Slot:
        """``Slot(block, offset)`` of token ``pos`` (0-based, ``0 <= pos < seq_len``)."""
        self._check_seq(seq_id)
        n = self.seq_lens[seq_id]
        if not 0 <= pos < n:
            raise IndexError(f"position {pos} out of range for sequence {seq_id!r} of length {n}")
        return Slot(self.tables[seq_id][pos // self.block_size], pos % self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_tokens(self) -> int:
        """Token slots holding a token, over all sequences."""
        return sum(self.seq_lens.values())

    @property
    def num_allocated_slots(self) -> int:
        """Token slots in allocated blocks (``used blocks * block_size``)."""
        return sum(len(t) for t in self.tables.values()) * self.block_size

    @property
    def utilization(self) -> float:
        """Token slots used / token slots allocated (1.0 when nothing is allocated: nothing is wasted).

        ``1 - utilization`` is the internal fragmentation: the unwritten tails of last blocks."""
        allocated = self.num_allocated_slots
        return self.num_tokens / allocated if allocated else 1.0

    def sequence_utilization(self, seq_id: Hashable) -> float:
        """Utilization of one sequence's blocks (1.0 for an empty sequence)."""
        self._check_seq(seq_id)
        allocated = len(self.tables[seq_id]) * self.block_size
        return self.seq_lens[seq_id] / allocated if allocated else 1.0

    def block_owners(self) -> list[Hashable | None]:
        """``owners[b]``: the sequence holding physical block ``b``, or ``None`` if it is free."""
        owners: list[Hashable | None] = [None] * self.num_blocks
        for s, table in self.tables.items():
            for b in table:
                owners[b] = s
        return owners

    def fill_unused(self, value: float = float("nan")) -> None:
        """Write ``value`` into every slot that holds no token (free blocks, unwritten tails).

        Attention must ignore those slots; poisoning them with NaN makes a test prove it."""
        used = torch.zeros(self.num_blocks, self.block_size, dtype=torch.bool)      # [num_blocks, bs]
        for s, table in self.tables.items():
            n = self.seq_lens[s]
            for i, b in enumerate(table):
                used[b, : min(self.block_size, n - i * self.block_size)] = True
        unused = (~used).to(self.device)
        for pool in (self.k, self.v):
            pool.transpose(1, 2)[unused] = value  # view [num_blocks, bs, L, H, D]; writes through

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant:

        1. every block is free or held by exactly one sequence (once);
        2. no allocated block is on the free stack;
        3. every table entry (and every free-stack entry) is a valid block id;
        4. a sequence of length ``n`` holds exactly ``ceil(n / block_size)`` blocks.
        """
        nb = self.num_blocks
        if set(self.tables) != set(self.seq_lens):
            raise InvariantError("tables and seq_lens hold different sequence ids")
        held: dict[int, Hashable] = {}
        for s, table in self.tables.items():
            for b in table:
                if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < nb:
                    raise InvariantError(f"3: sequence {s!r} has invalid block id {b!r}")
                if b in held:
                    raise InvariantError(f"1: block {b} is held by {held[b]!r} and {s!r}")
                held[b] = s
        for b in self.free:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < nb:
                raise InvariantError(f"3: free stack has invalid block id {b!r}")
        if len(set(self.free)) != len(self.free):
            raise InvariantError("1: a block appears twice on the free stack")
        on_both = held.keys() & set(self.free)
        if on_both:
            b = min(on_both)
            raise InvariantError(f"2: block {b} is held by {held[b]!r} and also on the free stack")
        if len(held) + len(self.free) != nb:
            lost = sorted(set(range(nb)) - held.keys() - set(self.free))
            raise InvariantError(f"1: blocks {lost} are neither free nor held (leaked)")
        for s, n in self.seq_lens.items():
            want = math.ceil(n / self.block_size)
            if len(self.tables[s]) != want:
                raise InvariantError(f"4: sequence {s!r} of length {n} holds {len(self.tables[s])} "
                                     f"blocks, expected ceil({n}/{self.block_size}) = {want}")

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        head = (f"PagedKVCache(num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
                f"block_size={self.block_size}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={dtype}, device={self.device})")
        top = f"top of stack: {self.free[-1]}" if self.free else "stack empty"
        lines = [head,
                 f"  blocks: {self.num_used_blocks} used, {self.num_free_blocks} free ({top})",
                 f"  tokens: {self.num_tokens} in {self.num_allocated_slots} allocated slots "
                 f"(utilization {self.utilization:.0%})"]
        items = list(self.tables.items())
        for s, table in items[:8]:
            lines.append(f"  seq {s!r}: len {self.seq_lens[s]}, table {table}")
        if len(items) > 8:
            lines.append(f"  ... and {len(items) - 8} more sequences")
        return "\n".join(lines)

    def release_leading_blocks(self, seq_id: Hashable, n: int) -> list[int]:
        """Give back the first ``n`` blocks of a sequence, all full, whose tokens it no longer needs (a
        sliding window, ``pagedlib.window``). The sequence then holds ``n * block_size`` tokens fewer and
        its table starts at its former block ``n``; the caller keeps the offset of the first token held.
        The four invariants hold as before. Returns the freed block ids (the first one ends on top)."""
        self._check_seq(seq_id)
        full = self.seq_lens[seq_id] // self.block_size
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= full:
            raise ValueError(f"n must be an int in [0, {full}] (the full blocks of sequence {seq_id!r}), "
                             f"got {n!r}")
        table = self.tables[seq_id]
        blocks = table[:n]
        del table[:n]
        self.seq_lens[seq_id] -= n * self.block_size
        self._release_blocks(blocks)
        return blocks
