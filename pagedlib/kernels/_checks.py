"""Argument checks of ``pagedlib.kernels``: a ``ValueError`` naming the argument, before any work."""

from __future__ import annotations

import math
import numbers

import torch

from pagedlib.core import fp8
from pagedlib.core.fp8 import FP8_DTYPES
from pagedlib.util import as_int, refuse

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM, MAX_BLOCK_SIZE, MAX_SPLITS = 256, 128, 64  # the Triton kernel's limits
PAGED_ARGS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens")


def check_number(name: str, value: object, zero_ok: bool = False) -> float:
    """``value`` as a float: finite and > 0 (``scale``), or >= 0 with inf allowed (``chunk_bytes``)."""
    x = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    what = "a number >= 0 (math.inf: no limit)" if zero_ok else "a finite number > 0"
    refuse((not (x >= 0 if zero_ok else 0 < x < math.inf), f"{name} must be None or {what}, got {value!r}"))
    return x


def check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens) -> tuple[int, int, int, int, int]:
    """``paged_attention``'s tensors (one device sync) -> ``(batch, q_heads, kv_heads, head_dim, bs)``."""
    for name, t in zip(PAGED_ARGS, (q, k_cache, v_cache, block_tables, seq_lens)):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            what = f"a {t.layout} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a dense torch.Tensor, got {what}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if q.dim() != 3:
        hint = " (one query token per sequence; for several, paged_prefill_attention)" if q.dim() == 4 else ""
        raise ValueError(f"q must have shape [batch, q_heads, head_dim], got {list(q.shape)}{hint}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    (batch, q_heads, q_dim), (_, block_size, kv_heads, head_dim) = q.shape, k_cache.shape
    for i, size in enumerate(k_cache.shape[1:]):
        if size < 1:
            raise ValueError(f"k_cache's {('block_size', 'kv_heads', 'head_dim')[i]} (dim {i + 1}) must be "
                             f">= 1, got shape {list(k_cache.shape)}")
    refuse((batch < 1, "q must hold at least one sequence (batch >= 1), got batch 0"),
           (q_dim != head_dim, f"q's head_dim must equal the cache's head_dim {head_dim}, got {q_dim}"),
           (q_heads % kv_heads, f"q_heads ({q_heads}) must be a multiple of the cache's kv_heads "
                                f"({kv_heads})"))
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must have a dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype and t.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    _check_tables(q, block_tables, seq_lens, k_cache.shape[0], block_size)
    return batch, q_heads, kv_heads, head_dim, block_size


def _check_tables(q, tables, lens, num_blocks: int, bs: int) -> None:
    _tensor(tables, 2, torch.int32, must="block_tables must be an int32 tensor of shape [batch, max_blocks]")
    _tensor(lens, 1, torch.int32, must="seq_lens must be an int32 tensor of shape [batch]")
    n = lens.shape[0]
    refuse((tables.shape[0] != n, f"block_tables and seq_lens must describe the same sequences, got "
                                  f"{tables.shape[0]} rows and {n} lengths"),
           (q.shape[0] != n,
            f"q must hold one query token per sequence, [batch={n}, q_heads, head_dim], got {list(q.shape)} "
            "(several tokens of one sequence: use paged_prefill_attention)"))
    max_blocks, lens = tables.shape[1], lens.long()                                    # [batch]
    bad_len = (lens < 1) | (lens > max_blocks * bs)                                     # [batch]
    used = torch.arange(max_blocks, device=lens.device) < (lens[:, None] + bs - 1) // bs  # [batch, blocks]
    bad_entry = used & ((tables < 0) | (tables >= num_blocks))
    if not bool(bad_len.any() | bad_entry.any()):  # the one sync when all is well
        return
    if bad_len.any():
        i = int(bad_len.nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} must be between 1 and the block table's capacity "
                         f"max_blocks * block_size = {max_blocks} * {bs} = {max_blocks * bs}")
    b, j = (int(x) for x in bad_entry.nonzero()[0])
    raise ValueError(f"block_tables[{b}, {j}] = {int(tables[b, j])} is not a block id in [0, num_blocks="
                     f"{num_blocks}), yet sequence {b} (length {int(lens[b])}) keeps positions "
                     f"{j * bs}..{min(int(lens[b]), (j + 1) * bs) - 1} there")


def _got(x: object) -> object:
    return list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def _tensor(t, dim: int, dtype: torch.dtype | None = None, rows: int = 0, *, must: str) -> None:
    """Refuse ``t`` with ``"{must}, got ..."`` unless it is a tensor of ``dim`` dimensions, of ``dtype`` (the
    message then names the dtype it got too), at least ``rows`` long."""
    if isinstance(t, torch.Tensor) and t.dim() == dim and len(t) >= rows and dtype in (None, t.dtype):
        return
    got = f"{t.dtype} {list(t.shape)}" if dtype and isinstance(t, torch.Tensor) else _got(t)
    raise ValueError(f"{must}, got {got}")


def check_reference(cache, seq_id, q) -> None:
    """A sequence of ``cache`` with tokens, ``q`` ``[num_layers, 1, q_heads, head_dim]`` in its dtype."""
    pool = cache.k                                      # [num_blocks, num_layers, block_size, kv_heads, D]
    _, layers, _, kv_heads, dim = pool.shape
    refuse((not isinstance(q, torch.Tensor) or q.dim() != 4 or (*q.shape[:2], q.shape[3]) != (layers, 1, dim),
            f"q must have shape [num_layers={layers}, 1, q_heads, head_dim={dim}], got {_got(q)}"))
    refuse((q.shape[2] % kv_heads,
            f"q_heads ({q.shape[2]}) must be a multiple of the cache's kv_heads ({kv_heads})"),
           (q.dtype != pool.dtype or q.device != pool.device, f"q must have the cache's dtype {pool.dtype} "
            f"and device {pool.device}, got {q.dtype} on {q.device}"))
    refuse((cache.seq_lens[seq_id] < 1,  # KeyError for an unknown sequence
            f"sequence {seq_id!r} is empty: attention needs at least one token"))


def check_prefill(q, k_cache, v_cache, table, seq_len) -> int:
    _tensor(q, 3, rows=1, must="q must be a tensor of shape [n >= 1, q_heads, head_dim]")
    _tensor(table, 1, torch.int32, must="block_table must be a 1-D int32 tensor [max_blocks]")
    seq_len, n = as_int("seq_len", seq_len, minimum=1), q.shape[0]
    refuse((seq_len < n, f"seq_len must be >= n = {n} (the queries are its last n positions), got {seq_len}"))
    lens = torch.tensor([seq_len], dtype=torch.int32, device=table.device)
    check_paged_inputs(q[-1:], k_cache, v_cache, table[None], lens)
    return seq_len


def check_contiguous(q, k, v) -> None:
    refuse(*((not isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}")
             for name, t in (("q", q), ("k", k), ("v", v))))
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[::3] != k.shape[::3]:
        raise ValueError(f"q must be [batch, q_heads, q_len, head_dim] and k, v both [batch, kv_heads, "
                         f"kv_len, head_dim] (one batch, one head_dim); got {_got(q)}, {_got(k)}, {_got(v)}")
    refuse((q.shape[1] % k.shape[1], f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})"))


def check_window(q_len, kv_len, window) -> tuple[int, int, int]:
    q_len, kv_len, window = (as_int(n, x, minimum=1) for n, x in zip(("q_len", "kv_len", "window"),
                                                                     (q_len, kv_len, window)))
    refuse((q_len > kv_len, "q_len must be <= kv_len (the queries are the last q_len of kv_len positions), "
                            f"got q_len={q_len}, kv_len={kv_len}"))
    return q_len, kv_len, window


def check_triton(q, k_cache, v_cache, num_splits, compiled: bool) -> int | None:
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be at most {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
    if block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"k_cache's block_size must be a power of two from 1 to {MAX_BLOCK_SIZE}, "
                         f"got {block_size}")
    if compiled and q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor for the compiled kernel, got device {q.device}")
    refuse((compiled and k_cache.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(q.device)
            < (8, 9), "a float8_e4m3fn cache needs compute capability 8.9+ for the Triton kernel (Triton has "
                      "no e4m3 below it); use float8_e5m2"))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("q, k_cache and v_cache must not require grad: the Triton kernel has no backward "
                         "pass (call it under torch.no_grad(), or pass detached tensors)")
    return None if num_splits is None else as_int("num_splits", num_splits, minimum=1, maximum=MAX_SPLITS)


def check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc
                        ) -> tuple[list[int], list[int]]:
    """``paged_attention_varlen``'s arguments (two device syncs) -> ``(seq_lens, query_start_loc)`` as
    lists: ``query_start_loc`` starts at 0, rises by >= 1 per sequence to ``T``, and no sequence has more
    new tokens than ``seq_lens`` stores."""
    qsl = query_start_loc
    _tensor(q, 3, rows=1, must="q must be a tensor of shape [T >= 1, q_heads, head_dim] (the new tokens of "
                               "every sequence)")
    _tensor(qsl, 1, torch.int32, rows=2, must="query_start_loc must be an int32 tensor of shape [batch + 1] "
                                             "(batch >= 1)")
    refuse((qsl.device != q.device, f"query_start_loc must be on q's device {q.device}, got {qsl.device}"),
           (isinstance(seq_lens, torch.Tensor) and list(seq_lens.shape) != [len(qsl) - 1],
            f"seq_lens must hold one length per sequence of query_start_loc, [batch={len(qsl) - 1}], got "
            f"{_got(seq_lens)}"))
    starts, T = qsl.tolist(), q.shape[0]
    new = [b - a for a, b in zip(starts, starts[1:])]
    shown = starts if len(starts) <= 10 else [*starts[:10], "..."]
    refuse((starts[0] != 0 or min(new) < 1 or starts[-1] != T,
            f"query_start_loc must rise from 0 by at least 1 per sequence to T = {T} (q's rows), "
            f"got {shown}"))
    check_paged_inputs(q[: len(new)], k_cache, v_cache, block_tables, seq_lens)  # caches: q's dtype or fp8
    lens = seq_lens.tolist()
    for b, (n, m) in enumerate(zip(lens, new)):
        if m > n:
            raise ValueError(f"sequence {b} has {m} new tokens in q but seq_lens[{b}] = {n} (its cached plus "
                             "new tokens) is smaller")
    return lens, starts


def check_scales(k_cache: torch.Tensor, k_scale: object, v_scale: object) -> tuple:
    """The scales as ``PagedKVCache`` holds them (``fp8.check_scales``); 1.0 for a cache not in fp8, which
    takes no other (``None`` means 1.0)."""
    if k_cache.dtype in FP8_DTYPES:
        return fp8.check_scales(k_scale, v_scale, k_cache.dtype, k_cache.shape[2], k_cache.device)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not _is_one(scale):
            raise ValueError(f"{name} applies to a float8 cache only, got {scale!r} for a {k_cache.dtype} "
                             "cache")
    return 1.0, 1.0


def _is_one(scale: object) -> bool:
    """``None`` or a number equal to 1 (not a bool): the scale of a cache that is not in fp8."""
    if scale is None:
        return True
    return isinstance(scale, numbers.Real) and not isinstance(scale, bool) and scale == 1
