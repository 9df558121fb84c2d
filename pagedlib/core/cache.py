"""``PagedKVCache``, the paged KV cache of notebooks 02-08: a ``BlockManager`` beside a ``KVPool``, every
argument checked first (``_checks.py``), so a call that raises changes nothing; an interrupted append is
undone too (cached blocks evicted for it come back as plain free blocks). Single-threaded, like nano-vllm's
and vLLM's block managers: a caller that uses one cache from several threads serialises the calls."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedlib import figures
from pagedlib.core import _checks as checks
from pagedlib.core._checks import SUPPORTED_DTYPES, UnknownSequenceError  # noqa: F401 (re-exported)

# re-exported: callers import the errors from here
from pagedlib.core.blocks import BlockManager, InvariantError, OutOfBlocksError, Reservation  # noqa: F401
from pagedlib.core.fp8 import FP8_DTYPES, dequantize
from pagedlib.core.groups import NULL_BLOCK, KVGroup, layers_per_group
from pagedlib.core.kv_pool import KVPool


class Slot(NamedTuple):
    """Where one token lives: physical ``block`` id and ``offset`` inside it."""

    block: int
    offset: int


@dataclass
class Batch:
    """The rows of one forward pass, sequence after sequence: what the model reads of a step (vLLM's
    ``SchedulerOutput``, flattened). Every slot is reserved already; the tables and lengths include the new
    tokens. The model makes the ``copies`` first, then writes each new token's K/V into its slot."""

    seq_ids: list[Hashable]
    token_ids: list[list[int] | None]  # each sequence's new tokens (None: a simulated request's, unknown)
    slots: list[list[int]]            # each new token's slot: block * block_size + offset
    block_tables: list[list[int]]     # each sequence's table after the step
    seq_lens: list[int]               # tokens each sequence holds after the step
    copies: list[tuple[int, int]]     # (source, destination) blocks to copy before any K/V is written
    # a cache of several KV-cache groups (notebook 15, ``core/groups.py``): per group g, each sequence's new
    # slots and table (``slots`` and ``block_tables`` are group 0's); None: one group
    group_slots: list[list[list[int]]] | None = None
    group_tables: list[list[list[int]]] | None = None


def padded_tables(tables: list[list[int]], width: int, device: torch.device | str) -> torch.Tensor:
    """int32 ``[len(tables), width]`` block tables, each padded with -1 (the attention kernels' layout)."""
    rows = [table + [-1] * (width - len(table)) for table in tables]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width).to(device)


class PagedKVCache:
    """Paged KV cache for ``num_layers`` layers: token ``p`` of sequence ``s`` lives in block
    ``tables[s][p // block_size]`` at offset ``p % block_size``, for every layer at once.

    With KV-cache ``groups`` (notebook 15) each group ``g`` has its own table per sequence,
    ``group_tables[g][s]`` (``tables`` is group 0's), over one pool of ``[num_blocks, layers_per_group,
    block_size, kv_heads, head_dim]``: layer ``l`` lives at its index inside its group in the blocks of its
    group's table (``layer(l)``). A sliding-window group gives back the blocks wholly before its window
    (``NULL_BLOCK`` entries).

    Args:
        dtype, device: of both pools (a dtype of ``SUPPORTED_DTYPES``); K/V arguments must match exactly,
            except that an fp8 cache takes fp32/fp16/bf16 K/V and stores them quantized (notebook 10).
        k_scale, v_scale: an fp8 cache's scales, a float or ``[kv_heads]`` (``None``: 1.0, vLLM's default).
        free_order: blocks handed out first, in this order (``BlockManager``). fill: every slot's first value.
        enable_prefix_caching: find full blocks again by their token ids, which then come with every append.
        prefix_cache: ``"hash"`` (vLLM's chained block hashes, notebook 06) or ``"radix"`` (SGLang's tree).
        groups: the KV-cache groups (``core.groups.kv_groups``), every layer in exactly one; ``None``: one
            full-attention group of every layer (notebooks 02-14).
    """

    def __init__(self, num_blocks: int, num_layers: int, block_size: int, kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 free_order: Sequence[int] | None = None, fill: float = 0.0,
                 enable_prefix_caching: bool = False, prefix_cache: str = "hash",
                 k_scale: float | torch.Tensor | None = None,
                 v_scale: float | torch.Tensor | None = None,
                 groups: Sequence[KVGroup] | None = None) -> None:
        sizes = (num_blocks, num_layers, block_size, kv_heads, head_dim)
        sizes, order = checks.new_cache(sizes, dtype, device, free_order, fill,
                                        enable_prefix_caching, prefix_cache)
        self.num_blocks, self.num_layers, self.block_size, self.kv_heads, self.head_dim = sizes
        self.groups = checks.groups(groups, self.num_layers)
        scales = checks.check_scales(k_scale, v_scale, dtype, self.kv_heads, device)
        self.k_scale, self.v_scale = scales
        self.dtype = dtype
        self.manager = BlockManager(self.num_blocks, self.block_size, order, enable_prefix_caching,
                                    prefix_cache, self.groups)
        # [num_blocks, layers_per_group, block_size, H, D]: a block holds one group's layers
        pool_sizes = (self.num_blocks, layers_per_group(self.groups), *sizes[2:])
        self.pool = KVPool(pool_sizes, dtype=dtype, device=device, fill=fill, k_scale=self.k_scale,
                           v_scale=self.v_scale)
        # layer l -> (its group, its index in the group: where it lives in a block)
        self.layer_place = {layer: (g, i) for g, group in enumerate(self.groups)
                            for i, layer in enumerate(group.layers)}
        # per group: its layers' rows of a [num_layers, ...] K/V (None: every layer, in order: no copy)
        self._group_rows = [None if group.layers == tuple(range(self.num_layers)) else list(group.layers)
                            for group in self.groups]
        # read these; only the manager and the pool change them (in place)
        self.free = self.manager.free
        self.tables = self.manager.tables
        self.group_tables = self.manager.group_tables
        self.seq_lens = self.manager.seq_lens
        self.ref_counts = self.manager.ref_counts
        self.token_ids = self.manager.token_ids
        self.prefix_cache = self.manager.prefix_cache
        self.k = self.pool.k
        self.v = self.pool.v
        self.device = self.pool.device

    @property
    def cow_copies(self) -> int:
        return self.manager.cow_copies

    @property
    def num_free_blocks(self) -> int:  # cached blocks nobody holds count as free
        return self.manager.num_free_blocks


    @property
    def num_cached_free_blocks(self) -> int:  # free, and still findable by a prefix-cache lookup
        return self.manager.num_cached_free_blocks

    # figures read off the cache (notebooks 02, 07), ``pagedlib.figures``' functions as properties
    num_used_blocks = property(figures.num_used_blocks)  # blocks some table holds
    num_tokens = property(figures.num_tokens)  # tokens held by every sequence
    num_allocated_slots = property(figures.num_allocated_slots)  # slots of every block a table names
    num_filled_slots = property(figures.num_filled_slots)  # slots holding a token's K/V, every group's
    utilization = property(figures.utilization)  # filled slots per allocated slot (1.0 with none)
    __repr__ = figures.describe  # sizes, blocks, tokens, the first eight tables

    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int] | None = None) -> int:
        """Checked ``BlockManager.add_sequence``: the tokens found; the caller appends K/V for the prompt
        tokens not found. The radix cache's partial-block copy is made at once; if it is interrupted, the
        sequence is not added."""
        checks.seq(self, seq_id, new=True)
        prompt = checks.token_ids(self, "prompt_token_ids", prompt_token_ids) or []
        self.manager.add_sequence(seq_id, prompt)
        try:
            self.pool.copy_blocks(self.manager.share_partial_block(seq_id, prompt))  # radix only
        except BaseException:
            self.manager.free_sequence(seq_id)
            raise
        return self.seq_lens[seq_id]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Checked ``BlockManager.fork``: parallel sampling, beam search (notebook 06)."""
        checks.seq(self, parent_id)
        checks.seq(self, child_id, "child_id", new=True)
        self.manager.fork(parent_id, child_id)

    def append_tokens(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor,
                      token_ids: Sequence[int] | None = None) -> list[int]:
        """Append ``n`` tokens (``k``, ``v``: ``[num_layers, n, kv_heads, head_dim]``). Returns the blocks
        holding them that the sequence did not hold before (a copied last block included), group after
        group."""
        checks.seq(self, seq_id)
        ids = checks.appended(self, k, v, token_ids)
        before = [set(tables[seq_id]) for tables in self.group_tables]
        self._append([seq_id], [k.shape[1]], k, v, ids)
        return [block for tables, held in zip(self.group_tables, before)
                for block in tables[seq_id] if block not in held]

    def append_token(self, seq_id: Hashable, k_vec: torch.Tensor, v_vec: torch.Tensor,
                     token_id: int | None = None) -> Slot:
        """Append one token (``k_vec``, ``v_vec``: ``[num_layers, kv_heads, head_dim]``); returns its slot
        (group 0's)."""
        checks.seq(self, seq_id)
        ids = checks.appended(self, k_vec, v_vec, token_id, one=True)
        slot = self._append([seq_id], [1], k_vec[:, None], v_vec[:, None], ids)[0]  # [L, 1, H, D]
        return Slot(*divmod(slot, self.block_size))

    def append_batch(self, seq_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor,
                     token_ids: Sequence[int] | None = None) -> list[Slot]:
        """One decode step: one token for each of ``batch`` distinct sequences, all or nothing (their slots:
        group 0's)."""
        ids = checks.live_ids(self, seq_ids, distinct=True)
        tokens = checks.appended(self, k, v, token_ids, len(ids), "[num_layers, batch, H, D]")
        slots = self._append(ids, [1] * len(ids), k, v, tokens)
        return [Slot(*divmod(slot, self.block_size)) for slot in slots]

    @contextmanager
    def reserving(self, seq_ids: Sequence[Hashable], chunks: Sequence[Sequence[int]]) -> Iterator[Batch]:
        """A one-off step's ``Batch`` (an engine's come from its scheduler): slots for ``chunks[i]`` more
        tokens of each ``seq_ids[i]``, checked, all or nothing. Committed when the ``with`` block ends, undone
        if it raises (an interrupted forward pass leaves nothing findable without its K/V)."""
        ids, rows = checks.chunks(self, seq_ids, chunks)
        tokens = [token for row in rows for token in row]
        with self._reservation(ids, [len(row) for row in rows], tokens) as record:
            group_tables = [[list(tables[seq_id]) for seq_id in ids] for tables in self.group_tables]
            batch = Batch(ids, rows, record.slots, group_tables[0], [self.seq_lens[s] for s in ids],
                          record.copies)
            if len(self.groups) > 1:
                batch.group_slots, batch.group_tables = record.group_slots, group_tables
            yield batch

    @contextmanager
    def _reservation(self, seq_ids: list, counts: list[int], token_ids: list[int] | None
                     ) -> Iterator[Reservation]:
        """``BlockManager.reserve``'s record, committed when the ``with`` block ends and undone if it raises:
        the one all-or-nothing scope of ``reserving`` and the appends."""
        record = self.manager.reserve(seq_ids, counts, token_ids)
        try:
            yield record
        except BaseException:
            self.manager.undo(record)
            raise
        self.manager.commit(record)

    def _append(self, seq_ids: list, counts: list[int], k: torch.Tensor, v: torch.Tensor,
                token_ids: list[int] | None) -> list[int]:
        """Reserve, copy and write K/V (each group's layers into its slots), all or nothing: group 0's flat
        slots."""
        with self._reservation(seq_ids, counts, token_ids) as record:
            self.pool.copy_blocks(record.copies)
            for rows, group_slots in zip(self._group_rows, record.group_slots):
                flat = [slot for sequence_slots in group_slots for slot in sequence_slots]
                if rows is None:
                    self.pool.write(flat, k, v)
                else:  # [group's layers, n, H, D]
                    self.pool.write(flat, k[rows], v[rows])
        return [slot for sequence_slots in record.slots for slot in sequence_slots]

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Checked ``BlockManager.free_sequence``."""
        checks.seq(self, seq_id)
        return self.manager.free_sequence(seq_id)

    def slot(self, seq_id: Hashable, pos: int, group: int = 0) -> Slot:
        """``Slot(block, offset)`` of token ``pos`` (``0 <= pos < seq_len``) in ``group``; ``IndexError`` for
        a position whose block the group's window gave back (no block holds it any more)."""
        pos = checks.position(self, seq_id, pos)
        group = checks.index("group", group, 0, len(self.groups))
        block = self.group_tables[group][seq_id][pos // self.block_size]
        if block == NULL_BLOCK:
            raise IndexError(f"pos {pos} of sequence {seq_id!r} is before the window of group {group} "
                             f"({self.groups[group]}): its block was given back (NULL_BLOCK)")
        return Slot(block, pos % self.block_size)

    def block_table(self, seq_ids: Iterable[Hashable], width: int | None = None, group: int = 0
                    ) -> torch.Tensor:
        """int32 ``[batch, width]`` block tables of ``group`` padded with -1 (``width``: default the
        longest); a given-back entry is -1 too (``NULL_BLOCK``)."""
        group = checks.index("group", group, 0, len(self.groups))
        tables = [self.group_tables[group][seq_id] for seq_id in checks.live_ids(self, seq_ids)]
        return padded_tables(tables, checks.width(tables, width), self.device)

    def seq_lens_tensor(self, seq_ids: Iterable[Hashable]) -> torch.Tensor:
        """int32 ``[batch]`` lengths of ``seq_ids``, on the cache's device."""
        lens = [self.seq_lens[seq_id] for seq_id in checks.live_ids(self, seq_ids)]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    def gather(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of a sequence's K and V, ``[num_layers, seq_len, kv_heads, head_dim]``: the
        values they stand for (an fp8 cache's stored values times its scales, as float32); NaN for the
        tokens a window group gave back, in that group's layers."""
        checks.seq(self, seq_id)
        if self.manager.windows == (None,):  # one group of every layer, nothing given back
            return self._gather(self.manager.slots(seq_id), self.num_layers)
        length = self.seq_lens[seq_id]
        dtype = torch.float32 if self.dtype in FP8_DTYPES else self.dtype
        shape = (self.num_layers, length, self.kv_heads, self.head_dim)
        k = torch.full(shape, float("nan"), dtype=dtype, device=self.device)
        v = torch.full_like(k, float("nan"))
        for g, group in enumerate(self.groups):
            slots = self.manager.slots(seq_id, g)
            kept = [p for p, slot in enumerate(slots) if slot != NULL_BLOCK]
            k_g, v_g = self._gather([slots[p] for p in kept], len(group.layers))  # [group's layers, n, H, D]
            layers = torch.tensor(group.layers, device=self.device)[:, None]
            positions = torch.tensor(kept, dtype=torch.long, device=self.device)
            k[layers, positions], v[layers, positions] = k_g, v_g
        return k, v

    def _gather(self, slots: list[int], layers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool's K and V at ``slots`` in a block's first ``layers`` layers, as values."""
        k, v = self.pool.gather(slots, layers)
        if self.dtype in FP8_DTYPES:
            return dequantize(k, self.k_scale), dequantize(v, self.v_scale)
        return k, v

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        """Views of layer ``l``'s K and V, ``[num_blocks, block_size, kv_heads, head_dim]``, no copy: index
        ``i`` of every block, where ``l`` is layer ``i`` of its group (read through that group's tables)."""
        l = checks.index("l", l, -self.num_layers, self.num_layers)  # noqa: E741
        _, i = self.layer_place[l % self.num_layers]
        return self.k[:, i], self.v[:, i]

    def group_of(self, l: int) -> int:  # noqa: E741
        """The group of layer ``l``: the index into ``group_tables`` its attention reads."""
        l = checks.index("l", l, -self.num_layers, self.num_layers)  # noqa: E741
        return self.layer_place[l % self.num_layers][0]

    def ref_count(self, block_id: int) -> int:
        """How many tables hold block ``block_id`` (0: it is free)."""
        return self.ref_counts[checks.block_id(self, block_id)]

    def is_cached(self, block_id: int) -> bool:
        """Block ``block_id`` holds content that prefix caching can find (in use, or free but kept)."""
        block_id = checks.block_id(self, block_id)
        if self.prefix_cache is None:
            return False
        return self.prefix_cache.is_cached(block_id)

    def prefix_cache_stats(self) -> dict[str, float]:
        """The prefix cache's lookup counters and hit rate (all 0 when prefix caching is off)."""
        return figures.prefix_cache_stats(self.prefix_cache)

    def sequence_utilization(self, seq_id: Hashable) -> float:
        """Filled slots per slot of one sequence's blocks, every KV-cache group's (1.0 for an empty
        sequence)."""
        checks.seq(self, seq_id)
        return figures.sequence_utilization(self, seq_id)
