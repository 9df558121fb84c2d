"""``PagedKVCache``: a pool of fixed-size KV blocks, a free-block stack and one block table per sequence.

The layout is the article's (notebook 02)::

    k, v : [num_blocks, num_layers, block_size, kv_heads, head_dim]

Token position ``p`` of sequence ``s`` lives in physical block ``tables[s][p // block_size]`` at offset
``p % block_size``, for every layer at once. Free blocks sit on a stack (a Python list): ``pop()`` takes the
top (the *last* element), ``append()`` gives a block back; both O(1), which is why a stack. The file reads
as the story: free stack -> add / append / free -> slot / block_table / gather -> checks and display.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

from pagedlib.checks import as_int, ceil_div
from pagedlib.sizing import format_bytes

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

    State (read freely, change only through the methods):
        k, v: ``[num_blocks, num_layers, block_size, kv_heads, head_dim]`` pools.
        free: the free-block stack, a ``list[int]``; the top (next block handed out) is ``free[-1]``.
        tables: ``dict[seq_id, list[int]]`` physical block ids of each sequence, in logical order.
        seq_lens: ``dict[seq_id, int]`` tokens stored per sequence.

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
                 free_order: Sequence[int] | None = None, fill: float = 0.0) -> None:
        self.num_blocks = as_int("num_blocks", num_blocks, minimum=1, maximum=2**31 - 1)  # int32 tables
        self.num_layers = as_int("num_layers", num_layers, minimum=1)
        self.block_size = as_int("block_size", block_size, minimum=1)
        self.kv_heads = as_int("kv_heads", kv_heads, minimum=1)
        self.head_dim = as_int("head_dim", head_dim, minimum=1)
        self.dtype = _check_dtype_and_fill(dtype, fill)
        shape = (self.num_blocks, self.num_layers, self.block_size, self.kv_heads, self.head_dim)
        _check_room(shape, dtype, device)
        self.free: list[int] = self._initial_free_stack(free_order)
        self.k = torch.full(shape, fill, dtype=dtype, device=device)
        self.v = torch.full(shape, fill, dtype=dtype, device=device)
        self.device = self.k.device  # normalised ("cuda" -> "cuda:0")
        self.tables: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}
        self._layer_rows = torch.arange(self.num_layers, device=self.device)[:, None] * self.block_size
        self._lock = threading.RLock()

    def _initial_free_stack(self, free_order: Sequence[int] | None) -> list[int]:
        order = [as_int(f"free_order[{i}]", b, minimum=0, maximum=self.num_blocks - 1)
                 for i, b in enumerate([] if free_order is None else free_order)]
        if len(set(order)) != len(order):
            raise ValueError(f"free_order must not repeat a block id, got {order}")
        order += sorted(set(range(self.num_blocks)) - set(order))
        return order[::-1]  # the stack's top is its last element: reverse so order[0] is popped first

    # ---------------------------------------------------------------------------------------------
    # ownership: the only two places that move blocks between the free stack and the sequences

    def _take_blocks(self, n: int, what: str) -> list[int]:
        """Pop ``n`` blocks off the free stack (all or none), in the order they come off."""
        if n > len(self.free):
            raise OutOfBlocksError(n, len(self.free), what)
        taken = self.free[len(self.free) - n:][::-1]
        del self.free[len(self.free) - n:]
        return taken

    def _release_blocks(self, blocks: Sequence[int]) -> None:
        """Push ``blocks`` back so that ``blocks[0]`` ends on top (undoes ``_take_blocks`` exactly)."""
        self.free.extend(reversed(blocks))

    # ---------------------------------------------------------------------------------------------
    # write side

    @_locked
    def add_sequence(self, seq_id: Hashable) -> None:
        """Register an empty sequence (no blocks yet). ``ValueError`` if ``seq_id`` is live or ``None``."""
        if seq_id is None:
            raise ValueError("seq_id must not be None (block_owners() uses None for a free block)")
        if seq_id in self.seq_lens:  # also the TypeError of an unhashable id, before anything changes
            raise ValueError(f"sequence id {seq_id!r} already exists")
        self.tables[seq_id] = []
        self.seq_lens[seq_id] = 0

    @_locked
    def append_tokens(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """Append ``n`` tokens (a prompt) at once, allocating every block they need up front.

        Args:
            k, v: ``[num_layers, n, kv_heads, head_dim]``.
        Returns:
            the newly allocated block ids, in logical order (empty if the last block had room).
        """
        self._check_seq(seq_id)
        self._check_kv("k", k, (self.num_layers, None, self.kv_heads, self.head_dim))
        self._check_kv("v", v, (self.num_layers, k.shape[1], self.kv_heads, self.head_dim))
        return self._append(seq_id, k, v)

    @_locked
    def append_token(self, seq_id: Hashable, k_vec: torch.Tensor, v_vec: torch.Tensor) -> Slot:
        """Append one token's K and V for every layer: ``append_tokens`` of one token.

        Args:
            k_vec, v_vec: ``[num_layers, kv_heads, head_dim]``.
        Returns:
            the ``Slot(block, offset)`` written; a new block was popped iff ``offset == 0``.
        """
        self._check_seq(seq_id)
        shape, dims = (self.num_layers, self.kv_heads, self.head_dim), "[num_layers, kv_heads, head_dim]"
        self._check_kv("k_vec", k_vec, shape, dims)
        self._check_kv("v_vec", v_vec, shape, dims)
        self._append(seq_id, k_vec[:, None], v_vec[:, None])                 # [num_layers, 1, H, D]
        return Slot(self.tables[seq_id][-1], (self.seq_lens[seq_id] - 1) % self.block_size)

    def _append(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """``append_tokens`` once its arguments are checked: take the blocks, write, then commit."""
        n, start, table = k.shape[1], self.seq_lens[seq_id], self.tables[seq_id]
        new = self._take_blocks(ceil_div(start + n, self.block_size) - len(table),
                                f"{n} tokens of sequence {seq_id!r}")
        self._write(_slots(table + new, start, start + n, self.block_size), k, v, new)
        table += new
        self.seq_lens[seq_id] = start + n
        return new

    @_locked
    def append_batch(self, seq_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor) -> list[Slot]:
        """One decode step: append one token to each of ``batch`` distinct sequences.

        All needed blocks are popped up front (all or nothing), then K and V of every layer are written
        with one indexed write per pool through flat slot ids ``block * block_size + offset`` (the
        ``slot_mapping`` of vLLM's ``reshape_and_cache``).

        Args:
            seq_ids: ``batch`` distinct live sequence ids, in the order of ``k``'s batch dim.
            k, v: ``[num_layers, batch, kv_heads, head_dim]``.
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
        bs = self.block_size
        offsets = [self.seq_lens[s] % bs for s in ids]
        new = self._take_blocks(offsets.count(0), f"a batch of {len(ids)} sequences")
        fresh = iter(new)
        blocks = [next(fresh) if off == 0 else self.tables[s][-1] for s, off in zip(ids, offsets)]
        self._write([b * bs + off for b, off in zip(blocks, offsets)], k, v, new)  # vLLM's slot_mapping
        for s, b, off in zip(ids, blocks, offsets):
            self.tables[s] += [b] if off == 0 else []
            self.seq_lens[s] += 1
        return [Slot(b, off) for b, off in zip(blocks, offsets)]

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

    def _write(self, slots: list[int], k: torch.Tensor, v: torch.Tensor, new: list[int]) -> None:
        """Write token ``i`` of ``k``, ``v`` (``[num_layers, n, kv_heads, head_dim]``, already checked) into
        flat slot ``slots[i]`` of every layer: one ``index_copy_`` per pool. If torch still fails (out of
        memory, an interrupt), the blocks ``new`` go back on the stack: the one rollback."""
        flat = (-1, self.kv_heads, self.head_dim)
        try:
            rows = self._rows(slots)
            # detach: a K/V that requires grad must not pull the pools into autograd (nor stay alive)
            self.k.view(flat).index_copy_(0, rows, k.detach().reshape(flat))  # [L, n, H, D] -> [L * n, H, D]
            self.v.view(flat).index_copy_(0, rows, v.detach().reshape(flat))
        except BaseException:
            self._release_blocks(new)
            raise

    @_locked
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

    @_locked
    def release_leading_blocks(self, seq_id: Hashable, n: int) -> list[int]:
        """Give back the first ``n`` blocks of a sequence, all full, whose tokens it no longer needs (a
        sliding window, ``pagedlib.window``). The sequence then holds ``n * block_size`` tokens fewer and
        its table starts at its former block ``n``; the caller keeps the offset of the first token held.
        The invariants hold as before. Returns the freed block ids (the first one ends on top)."""
        self._check_seq(seq_id)
        full = self.seq_lens[seq_id] // self.block_size
        n = as_int("n", n, minimum=0, maximum=full)
        blocks = self.tables[seq_id][:n]
        del self.tables[seq_id][:n]
        self.seq_lens[seq_id] -= n * self.block_size
        self._release_blocks(blocks)
        return blocks

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

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_tokens(self) -> int:  # token slots holding a token, over all sequences
        return sum(self.seq_lens.values())

    @property
    def num_allocated_slots(self) -> int:  # token slots in allocated blocks
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

        1. every block is free or held by exactly one sequence (once);
        2. no allocated block is on the free stack;
        3. every table entry (and every free-stack entry) is a valid block id;
        4. a sequence of length ``n`` holds exactly ``ceil(n / block_size)`` blocks.
        """
        if self.tables.keys() != self.seq_lens.keys():
            raise InvariantError("tables and seq_lens hold different sequence ids")
        held: dict[int, Hashable] = {}
        for s, table in self.tables.items():
            for b in table:
                _check_id(b, self.num_blocks, f"sequence {s!r}")
                if b in held:
                    other = "twice in its table" if held[b] == s else f"by {held[b]!r} too"
                    raise InvariantError(f"1: block {b} of sequence {s!r} is held {other}")
                held[b] = s
        for b in self.free:
            _check_id(b, self.num_blocks, "the free stack")
        if len(set(self.free)) != len(self.free):
            raise InvariantError("1: a block appears twice on the free stack")
        if on_both := sorted(held.keys() & set(self.free)):
            b = on_both[0]
            raise InvariantError(f"2: block {b} is held by {held[b]!r} and also on the free stack")
        if lost := sorted(set(range(self.num_blocks)) - held.keys() - set(self.free)):
            raise InvariantError(f"1: blocks {lost} are neither free nor held (leaked)")
        for s, n in self.seq_lens.items():
            if len(self.tables[s]) != ceil_div(n, self.block_size):
                raise InvariantError(f"4: sequence {s!r} of length {n} holds {len(self.tables[s])} blocks, "
                                     f"expected ceil({n}/{self.block_size}) = {ceil_div(n, self.block_size)}")

    # ---------------------------------------------------------------------------------------------
    # display and test helpers

    @_locked
    def block_owners(self) -> list[Hashable | None]:
        """``owners[b]``: the sequence holding physical block ``b``, or ``None`` if it is free."""
        owners: list[Hashable | None] = [None] * self.num_blocks
        for s, table in self.tables.items():
            for b in table:
                owners[b] = s
        return owners

    @_locked
    def fill_unused(self, value: float = float("nan")) -> None:
        """Write ``value`` into every slot that holds no token (free blocks, unwritten tails).

        Attention must ignore those slots; poisoning them with NaN makes a test prove it."""
        used = torch.zeros(self.num_blocks * self.block_size, dtype=torch.bool)
        for s, table in self.tables.items():
            used[_slots(table, 0, self.seq_lens[s], self.block_size)] = True
        unused = (~used).view(self.num_blocks, self.block_size).to(self.device)  # [num_blocks, bs]
        for pool in (self.k, self.v):
            pool.transpose(1, 2)[unused] = value  # view [num_blocks, bs, L, H, D]; writes through

    @_locked
    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        top = f"top of stack: {self.free[-1]}" if self.free else "stack empty"
        lines = [f"PagedKVCache(num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
                 f"block_size={self.block_size}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                 f"dtype={dtype}, device={self.device})",
                 f"  blocks: {self.num_used_blocks} used, {self.num_free_blocks} free ({top})",
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


def _check_dtype_and_fill(dtype: object, fill: object) -> torch.dtype:
    """``dtype`` must be supported and ``fill`` a real number it can hold (NaN and inf are fine)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype!r}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise ValueError(f"fill must be a real number, got {fill!r} ({type(fill).__name__})")
    if math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max:
        raise ValueError(f"fill must be representable in {dtype} (|fill| <= {torch.finfo(dtype).max:g}), "
                         f"got {fill!r}")
    return dtype  # type: ignore[return-value]


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


def _slots(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Flat slot ids ``block * block_size + offset`` of positions ``start .. stop-1`` of a sequence."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]
