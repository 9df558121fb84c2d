"""``PagedKVCache``, the paged KV cache of notebooks 02-08: a ``BlockManager`` beside a ``KVPool``, every
argument checked first (``_checks.py``), so a call that raises changes nothing; an interrupted append is
undone too (cached blocks evicted for it come back as plain free blocks). Single-threaded, like nano-vllm's
and vLLM's block managers: a caller that uses one cache from several threads serialises the calls."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import NamedTuple

import torch

from pagedlib import testing
from pagedlib.core import _checks as checks
from pagedlib.core._checks import SUPPORTED_DTYPES, UnknownSequenceError  # noqa: F401 (re-exported)

# re-exported: callers import the errors from here
from pagedlib.core.blocks import BlockManager, InvariantError, OutOfBlocksError  # noqa: F401
from pagedlib.core.fp8 import FP8_DTYPES, dequantize
from pagedlib.core.kv_pool import KVPool


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

    # figures read off the cache (notebooks 02, 07): functions of ``pagedlib.testing`` as properties
    num_tokens = property(testing.num_tokens)  # tokens of every sequence
    num_allocated_slots = property(testing.num_allocated_slots)  # slots of every block a table names
    utilization = property(testing.utilization)  # tokens per allocated slot (1.0 with none)

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
        l = checks.index("l", l, -self.num_layers, self.num_layers)  # noqa: E741
        return self.k[:, l], self.v[:, l]

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
        """The prefix cache's lookup counters and hit rate (``testing.prefix_cache_stats``); all 0 when
        prefix caching is off."""
        return testing.prefix_cache_stats(self.prefix_cache)

    def sequence_utilization(self, seq_id: Hashable) -> float:
        """Utilization of one sequence's blocks (1.0 for an empty sequence): ``testing``'s."""
        checks.seq(self, seq_id)
        return testing.sequence_utilization(self, seq_id)

    def check_invariants(self) -> None:
        """``testing.check_invariants`` of the block manager: ``InvariantError`` naming the first broken
        invariant."""
        testing.check_invariants(self.manager)

    # looks inside, for tests, notebook checks and widgets: functions of ``pagedlib.testing`` as methods
    block_holders = testing.block_holders  # every sequence holding each block, in table order
    block_owners = testing.block_owners  # the first sequence holding each block, None for a free one
    fill_unused = testing.fill_unused  # NaN (or ``value``) into every slot that holds no token
    state_diff = testing.state_diff  # the attributes in which the cache differs from ``before``
    __repr__ = testing.describe  # sizes, blocks, tokens, the first eight tables
