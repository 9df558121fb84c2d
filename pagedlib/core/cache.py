"""``PagedKVCache``, the paged KV cache of notebooks 02-08: a ``BlockManager`` beside a ``KVPool``, every
argument checked first (``_checks.py``), so a call that raises changes nothing; an interrupted append is
undone too (cached blocks evicted for it come back as plain free blocks). Single-threaded, like nano-vllm's
and vLLM's block managers: a caller that uses one cache from several threads serialises the calls."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

from pagedlib.core import _checks as checks
from pagedlib.core._checks import SUPPORTED_DTYPES, UnknownSequenceError  # noqa: F401 (re-exported)

# re-exported: callers import the errors from here
from pagedlib.core.blocks import BlockManager, InvariantError, OutOfBlocksError  # noqa: F401
from pagedlib.core.fp8 import FP8_DTYPES, dequantize
from pagedlib.core.kv_pool import KVPool
from pagedlib.core.prefix_cache import PrefixCache

# what state_diff compares
_STATE = ("k", "v", "free", "tables", "seq_lens", "ref_counts", "cow_copies", "prefix_cache",
          "token_ids")


class Slot(NamedTuple):
    """Where one token lives: physical ``block`` id and ``offset`` inside it."""

    block: int
    offset: int


class PagedKVCache:
    """Paged KV cache for ``num_layers`` layers: token ``p`` of sequence ``s`` lives in block
    ``tables[s][p // block_size]`` at offset ``p % block_size``, for every layer at once.

    Args:
        dtype, device: of both pools (a dtype of ``SUPPORTED_DTYPES``); K/V arguments must match exactly,
            except that an fp8 cache takes fp32/fp16/bf16 K/V and stores them quantized (notebook 10).
        k_scale, v_scale: an fp8 cache's scales, a float or ``[kv_heads]`` (``None``: 1.0, vLLM's default).
        free_order: blocks handed out first, in this order (``BlockManager``). fill: every slot's first value.
        enable_prefix_caching: find full blocks again by their token ids, which then come with every append.
        prefix_cache: ``"hash"`` (vLLM's chained block hashes, notebook 06) or ``"radix"`` (SGLang's tree).
    """

    def __init__(self, num_blocks: int, num_layers: int, block_size: int, kv_heads: int,
                 head_dim: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 free_order: Sequence[int] | None = None, fill: float = 0.0,
                 enable_prefix_caching: bool = False, prefix_cache: str = "hash",
                 k_scale: float | torch.Tensor | None = None,
                 v_scale: float | torch.Tensor | None = None) -> None:
        sizes = (num_blocks, num_layers, block_size, kv_heads, head_dim)
        sizes, order = checks.new_cache(sizes, dtype, device, free_order, fill,
                                        enable_prefix_caching, prefix_cache)
        self.num_blocks, self.num_layers, self.block_size, self.kv_heads, self.head_dim = sizes
        scales = checks.check_scales(k_scale, v_scale, dtype, self.kv_heads, device)
        self.k_scale, self.v_scale = scales
        self.dtype = dtype
        self.prefix_cache_kind = prefix_cache
        self.manager = BlockManager(self.num_blocks, self.block_size, order, enable_prefix_caching,
                                    prefix_cache)
        self.pool = KVPool(sizes, dtype=dtype, device=device, fill=fill, k_scale=self.k_scale,
                           v_scale=self.v_scale)
        # read these; only the manager and the pool change them (in place)
        self.free = self.manager.free
        self.tables = self.manager.tables
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
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens.values())

    @property
    def num_allocated_slots(self) -> int:
        return sum(len(table) for table in self.tables.values()) * self.block_size

    @property
    def utilization(self) -> float:
        """Tokens per allocated slot (1.0 with nothing allocated); 1 - utilization: internal fragmentation."""
        if self.num_allocated_slots == 0:
            return 1.0
        return self.num_tokens / self.num_allocated_slots

    def add_sequence(self, seq_id: Hashable, prompt_token_ids: Sequence[int] | None = None) -> int:
        """Checked ``BlockManager.add_sequence``; the caller appends K/V for the prompt tokens not found. If
        the radix cache's partial-block copy is interrupted, the sequence is not added."""
        checks.seq(self, seq_id, new=True)
        prompt = checks.token_ids(self, "prompt_token_ids", prompt_token_ids) or []
        self.manager.add_sequence(seq_id, prompt)
        try:
            # radix only
            return self.manager.share_partial_block(seq_id, prompt, self.pool.copy_blocks)
        except BaseException:
            self.manager.free_sequence(seq_id)
            raise

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Checked ``BlockManager.fork``: parallel sampling, beam search (notebook 06)."""
        checks.seq(self, parent_id)
        checks.seq(self, child_id, "child_id", new=True)
        self.manager.fork(parent_id, child_id)

    def append_tokens(self, seq_id: Hashable, k: torch.Tensor, v: torch.Tensor,
                      token_ids: Sequence[int] | None = None) -> list[int]:
        """Append ``n`` tokens (``k``, ``v``: ``[num_layers, n, kv_heads, head_dim]``). Returns the blocks
        holding them that the sequence did not hold before (a copied last block included)."""
        checks.seq(self, seq_id)
        ids = checks.appended(self, k, v, token_ids)
        before = set(self.tables[seq_id])
        self._append([seq_id], [k.shape[1]], k, v, ids)
        return [block for block in self.tables[seq_id] if block not in before]

    def append_token(self, seq_id: Hashable, k_vec: torch.Tensor, v_vec: torch.Tensor,
                     token_id: int | None = None) -> Slot:
        """Append one token (``k_vec``, ``v_vec``: ``[num_layers, kv_heads, head_dim]``); returns its slot."""
        checks.seq(self, seq_id)
        ids = checks.appended(self, k_vec, v_vec, token_id, one=True)
        slot = self._append([seq_id], [1], k_vec[:, None], v_vec[:, None], ids)[0]  # [L, 1, H, D]
        return Slot(*divmod(slot, self.block_size))

    def append_batch(self, seq_ids: Sequence[Hashable], k: torch.Tensor, v: torch.Tensor,
                     token_ids: Sequence[int] | None = None) -> list[Slot]:
        """One decode step: one token for each of ``batch`` distinct sequences, all or nothing."""
        ids = checks.live_ids(self, seq_ids, distinct=True)
        tokens = checks.appended(self, k, v, token_ids, len(ids), "[num_layers, batch, H, D]")
        slots = self._append(ids, [1] * len(ids), k, v, tokens)
        return [Slot(*divmod(slot, self.block_size)) for slot in slots]

    def reserve(self, seq_ids: Sequence[Hashable], counts: Sequence[int],
                token_ids: Sequence[int] | None = None,
                write: Callable[[list[list[int]]], None] | None = None) -> list[list[int]]:
        """``BlockManager.reserve``: each sequence's new slots, copy-on-write copies made. ``write(slots)``
        writes the K/V (the model: layer by layer); if it raises, the reservation is undone. Blocks filled
        become findable by prefix caching once ``write`` returns (without ``write``: at once)."""
        ids, counts, tokens = checks.reservation(self, seq_ids, counts, token_ids)

        def copy_then_write(slots, copies):  # copies: (source, copy) block pairs
            self.pool.copy_blocks(copies)
            if write is not None:
                write(slots)

        return self.manager.reserve(ids, counts, tokens, copy_then_write)[0]

    def _append(self, seq_ids: list, counts: list[int], k: torch.Tensor, v: torch.Tensor,
                token_ids: list[int] | None) -> list[int]:
        """Reserve, then copy and write K/V inside the reservation's all-or-nothing scope: the flat slots."""
        flat: list[int] = []

        def write(slots, copies):  # as reserve's, with the pool's K/V written here
            for sequence_slots in slots:
                flat.extend(sequence_slots)
            self.pool.copy_blocks(copies)
            self.pool.write(flat, k, v)

        self.manager.reserve(seq_ids, counts, token_ids, write)
        return flat

    def free_sequence(self, seq_id: Hashable) -> list[int]:
        """Checked ``BlockManager.free_sequence``."""
        checks.seq(self, seq_id)
        return self.manager.free_sequence(seq_id)

    def release_leading_blocks(self, seq_id: Hashable, n: int) -> list[int]:
        """Checked ``BlockManager.release_leading_blocks`` (a sliding window; prefix caching off)."""
        n = checks.leading_blocks(self, seq_id, n)
        return self.manager.release_leading_blocks(seq_id, n)

    def slot(self, seq_id: Hashable, pos: int) -> Slot:
        """``Slot(block, offset)`` of token ``pos`` (``0 <= pos < seq_len``)."""
        pos = checks.position(self, seq_id, pos)
        return Slot(self.tables[seq_id][pos // self.block_size], pos % self.block_size)

    def block_table(self, seq_ids: Iterable[Hashable], width: int | None = None) -> torch.Tensor:
        """int32 ``[batch, width]`` block tables padded with -1 (``width``: default the longest)."""
        tables = [self.tables[seq_id] for seq_id in checks.live_ids(self, seq_ids)]
        width = checks.width(tables, width)
        rows = [table + [-1] * (width - len(table)) for table in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width).to(self.device)

    def seq_lens_tensor(self, seq_ids: Iterable[Hashable]) -> torch.Tensor:
        """int32 ``[batch]`` lengths of ``seq_ids``, on the cache's device."""
        lens = [self.seq_lens[seq_id] for seq_id in checks.live_ids(self, seq_ids)]
        return torch.tensor(lens, dtype=torch.int32).to(self.device)

    def gather(self, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of a sequence's K and V, ``[num_layers, seq_len, kv_heads, head_dim]``: the
        values they stand for (an fp8 cache's stored values times its scales, as float32)."""
        checks.seq(self, seq_id)
        k, v = self.pool.gather(self.manager.slots(seq_id))
        if self.dtype in FP8_DTYPES:
            return dequantize(k, self.k_scale), dequantize(v, self.v_scale)
        return k, v

    def layer(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
        """Views ``k[:, l]``, ``v[:, l]``: ``[num_blocks, block_size, kv_heads, head_dim]``, no copy."""
        return self.pool.layer(checks.index("l", l, -self.num_layers, self.num_layers))

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
        """``PrefixCache.stats()``; all 0 when prefix caching is off."""
        if self.prefix_cache is None:
            return PrefixCache(self.block_size).stats()
        return self.prefix_cache.stats()

    def sequence_utilization(self, seq_id: Hashable) -> float:
        """Utilization of one sequence's blocks (1.0 for an empty sequence)."""
        checks.seq(self, seq_id)
        allocated = len(self.tables[seq_id]) * self.block_size
        if allocated == 0:
            return 1.0
        return self.seq_lens[seq_id] / allocated

    def check_invariants(self) -> None:
        """``BlockManager.check_invariants``: ``InvariantError`` naming the first broken invariant."""
        self.manager.check_invariants()

    def block_holders(self) -> list[list[Hashable]]:
        """``holders[b]``: every sequence holding block ``b`` (``ref_count(b)`` of them), in table order."""
        return [[seq_id for seq_id, _ in entries] for entries in self.manager.holders()]

    def block_owners(self) -> list[Hashable | None]:
        """``owners[b]``: the first sequence holding block ``b``, or ``None`` if it is free."""
        return [(holders or [None])[0] for holders in self.block_holders()]

    def fill_unused(self, value: float = float("nan")) -> None:
        """Write ``value`` into every slot that holds no token (cached free blocks keep their content):
        attention must ignore those slots, and NaN there makes a test prove it."""
        used = [slot for seq_id in self.tables for slot in self.manager.slots(seq_id)]
        kept: list[int] = []  # cached blocks nobody holds
        if self.prefix_cache is not None:
            kept = list(self.prefix_cache.free_queue)
        offsets = range(self.block_size)
        used += [block * self.block_size + offset for block in kept for offset in offsets]
        self.pool.fill_except(used, value)

    def state_diff(self, before: PagedKVCache) -> list[str]:
        """Names of the attributes in which this cache differs from ``before`` (a ``copy.deepcopy``), pools
        bit for bit with NaN equal to NaN: ``[]`` means a failed call changed nothing."""
        return [name for name in _STATE if not _same(getattr(self, name), getattr(before, name))]

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        blocks = f"  blocks: {self.num_used_blocks} used, {self.num_free_blocks} free"
        if self.prefix_cache is not None:
            blocks += f", {len(self.prefix_cache.free_queue)} of them cached"
        if self.free:
            blocks += f" (top of stack: {self.free[-1]})"
        else:
            blocks += " (stack empty)"
        shared = sum(count > 1 for count in self.ref_counts)
        if shared or self.cow_copies:
            blocks += f", {shared} shared, {self.cow_copies} copied"
        lines = [f"PagedKVCache(num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
                 f"block_size={self.block_size}, kv_heads={self.kv_heads}, "
                 f"head_dim={self.head_dim}, dtype={dtype}, device={self.device})",
                 blocks,
                 f"  tokens: {self.num_tokens} in {self.num_allocated_slots} allocated slots "
                 f"(utilization {self.utilization:.0%})"]
        for seq_id, table in list(self.tables.items())[:8]:
            lines.append(f"  seq {seq_id!r}: len {self.seq_lens[seq_id]}, table {table}")
        if len(self.tables) > 8:
            lines.append(f"  ... and {len(self.tables) - 8} more sequences")
        return "\n".join(lines)


def _same(now: object, before: object) -> bool:
    """Equal, and for tensors bit for bit with NaN equal to NaN."""
    if not isinstance(now, torch.Tensor):
        return now == before
    if not isinstance(before, torch.Tensor):
        return False
    if now.dtype != before.dtype or now.shape != before.shape:
        return False
    if torch.equal(now, before):
        return True
    return bool(((now == before) | (now.isnan() & before.isnan())).all())
