"""Argument checks of ``pagedlib.kernels``: a ``ValueError`` naming the argument, before any work. Each
public kernel runs them once, at its top; the helpers it calls take checked inputs and check nothing.
Plain ``if ...: raise`` throughout: a message is formatted only when it is raised (these run per layer)."""

from __future__ import annotations

import math
import numbers

import torch

from pagedlib.core import fp8
from pagedlib.core.fp8 import FP8_DTYPES
from pagedlib.core.groups import NULL_BLOCK
from pagedlib.util import as_int

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # the Triton kernel's limits
MAX_CPU_BLOCK_SIZE = 1024  # the CPU kernel keeps a block's scores on its stack: 64 KiB at most
MAX_BLOCK_SIZE = 128
MAX_SPLITS = 64
PAGED_ARGS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens")
CACHE_DIMS = ("block_size", "kv_heads", "head_dim")  # k_cache's dims 1, 2, 3


def check_number(name: str, value: object, zero_ok: bool = False) -> float:
    """``value`` as a float: finite and > 0 (``scale``), or >= 0 with inf allowed (``chunk_bytes``)."""
    number = math.nan  # what a bool or a non-number becomes: refused below
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    if zero_ok and not number >= 0:
        raise ValueError(f"{name} must be None or a number >= 0 (math.inf: no limit), got {value!r}")
    if not zero_ok and not 0 < number < math.inf:
        raise ValueError(f"{name} must be None or a finite number > 0, got {value!r}")
    return number


def check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, *, window: int | None = None,
                       new_tokens: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
    """``paged_attention``'s tensors (one device sync) -> ``(batch, q_heads, kv_heads, head_dim,
    block_size)``. With a checked ``window``, a table entry may be ``NULL_BLOCK`` where its block lies
    wholly before the window of the sequence's first new token (``new_tokens`` ``[batch]``: new tokens per
    sequence; default one each, a decode)."""
    for name, tensor in zip(PAGED_ARGS, (q, k_cache, v_cache, block_tables, seq_lens)):
        _check_dense(name, tensor, q)
    _check_shapes(q, k_cache, v_cache)
    batch, q_heads, q_dim = q.shape
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if batch < 1:
        raise ValueError("q must hold at least one sequence (batch >= 1), got batch 0")
    if q_dim != head_dim:
        raise ValueError(f"q's head_dim must equal the cache's head_dim {head_dim}, got {q_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must have a dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {q.dtype}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != q.dtype and cache.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {cache.dtype}")
    _check_tables(q, block_tables, seq_lens, num_blocks, block_size, window, new_tokens)
    return batch, q_heads, kv_heads, head_dim, block_size


def _check_dense(name: str, tensor: object, q: torch.Tensor) -> None:
    """A dense (strided) tensor on ``q``'s device (``q`` itself is checked first)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a dense torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name} must be a dense torch.Tensor, got a {tensor.layout} tensor")
    if tensor.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {tensor.device}")


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """``q`` ``[batch, q_heads, head_dim]``; ``k_cache`` and ``v_cache`` one shape ``[num_blocks,
    block_size, kv_heads, head_dim]``, each of the last three >= 1."""
    if q.dim() != 3:
        hint = ""
        if q.dim() == 4:
            hint = " (one query token per sequence; for several, paged_prefill_attention)"
        raise ValueError(f"q must have shape [batch, q_heads, head_dim], got {list(q.shape)}{hint}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    for dim, size in enumerate(k_cache.shape[1:], start=1):
        if size < 1:
            raise ValueError(f"k_cache's {CACHE_DIMS[dim - 1]} (dim {dim}) must be >= 1, "
                             f"got shape {list(k_cache.shape)}")


def _check_tables(q, tables, lens, num_blocks: int, block_size: int, window: int | None = None,
                  new_tokens: torch.Tensor | None = None) -> None:
    """int32 ``block_tables`` ``[batch, max_blocks]`` and ``seq_lens`` ``[batch]``: every length from 1 to
    the table's capacity, every entry a sequence uses a block id, or ``NULL_BLOCK`` before the window of
    every new token when there is a ``window`` (one device sync when all is well)."""
    _check_tensor(tables, 2, torch.int32,
                  must="block_tables must be an int32 tensor of shape [batch, max_blocks]")
    _check_tensor(lens, 1, torch.int32, must="seq_lens must be an int32 tensor of shape [batch]")
    batch = lens.shape[0]
    if tables.shape[0] != batch:
        raise ValueError(f"block_tables and seq_lens must describe the same sequences, got {tables.shape[0]} "
                         f"rows and {batch} lengths")
    if q.shape[0] != batch:
        raise ValueError(f"q must hold one query token per sequence, [batch={batch}, q_heads, head_dim], got "
                         f"{list(q.shape)} (several tokens of one sequence: use paged_prefill_attention)")
    max_blocks = tables.shape[1]
    lens = lens.long()                                                               # [batch]
    bad_len = (lens < 1) | (lens > max_blocks * block_size)                          # [batch]
    blocks_used = (lens[:, None] + block_size - 1) // block_size                     # [batch, 1]
    column = torch.arange(max_blocks, device=lens.device)                            # [max_blocks]
    used = column < blocks_used                                                      # [batch, max_blocks]
    bad_entry = used & ((tables < 0) | (tables >= num_blocks))                       # [batch, max_blocks]
    first_key = None
    if window is not None:  # blocks before the first new token's window may have been given back
        first_key = (lens - _new_tokens(new_tokens, lens) - window + 1).clamp(min=0)  # [batch]
        skipped = column < (first_key // block_size)[:, None]                        # [batch, max_blocks]
        bad_entry &= ~(skipped & (tables == NULL_BLOCK))
    if not bool(bad_len.any() | bad_entry.any()):  # the one sync when all is well
        return
    if bad_len.any():
        b = int(bad_len.nonzero()[0, 0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} must be between 1 and the block table's capacity "
                         f"max_blocks * block_size = {max_blocks} * {block_size} = {max_blocks * block_size}")
    b, j = bad_entry.nonzero()[0].tolist()
    _refuse_entry(tables, lens, b, j, num_blocks, block_size, window, first_key)


def _refuse_entry(tables, lens, b: int, j: int, num_blocks: int, block_size: int, window: int | None,
                  first_key: torch.Tensor | None) -> None:
    """Raise for ``block_tables[b, j]``, an entry sequence ``b`` needs that names no block of the pool
    (``first_key`` ``[batch]``: with a window, the first position each sequence's first new token sees)."""
    last = min(int(lens[b]), (j + 1) * block_size) - 1
    what = ""
    if window is not None:
        what = (f"; with window {window}, only blocks wholly before position {int(first_key[b])} (where the "
                f"window of its first new token starts) may be NULL_BLOCK ({NULL_BLOCK})")
    raise ValueError(f"block_tables[{b}, {j}] = {int(tables[b, j])} is not a block id in [0, num_blocks="
                     f"{num_blocks}), yet sequence {b} (length {int(lens[b])}) keeps positions "
                     f"{j * block_size}..{last} there{what}")


def _new_tokens(new_tokens: torch.Tensor | None, lens: torch.Tensor) -> torch.Tensor:
    """New tokens per sequence as int64 ``[batch]``: ``new_tokens``, or one each (a decode step)."""
    if new_tokens is None:
        return torch.ones_like(lens)
    return new_tokens.long()


def check_window_size(window: object) -> int | None:
    """A sliding ``window`` (tokens a query sees, itself included) as an int >= 1, or ``None``: full
    causal attention."""
    if window is None:
        return None
    return as_int("window", window, minimum=1)


def _got(x: object) -> object:
    """What a message says was passed: a tensor's shape, else the type's name."""
    if isinstance(x, torch.Tensor):
        return list(x.shape)
    return type(x).__name__


def _check_tensor(t: object, dim: int, dtype: torch.dtype | None = None, rows: int = 0, *, must: str) -> None:
    """Refuse ``t`` with ``"{must}, got ..."`` unless it is a tensor of ``dim`` dimensions, of ``dtype`` (the
    message then names the dtype it got too), at least ``rows`` long."""
    if isinstance(t, torch.Tensor) and t.dim() == dim and len(t) >= rows and dtype in (None, t.dtype):
        return
    got = _got(t)
    if dtype is not None and isinstance(t, torch.Tensor):
        got = f"{t.dtype} {list(t.shape)}"
    raise ValueError(f"{must}, got {got}")


def check_reference(cache, seq_id, q) -> None:
    """A sequence of ``cache`` with tokens, ``q`` ``[num_layers, 1, q_heads, head_dim]`` in its dtype; one
    full-attention group (the pool's second dimension is then every layer, and every table entry a block)."""
    if cache.manager.by_group:  # several KV-cache groups, or a window group
        raise ValueError(f"the reference reads a cache of one full-attention group, not "
                         f"{'; '.join(map(str, cache.groups))} (notebook 15: paged_attention_varlen takes a "
                         f"window and a group's block table)")
    pool = cache.k                                      # [num_blocks, num_layers, block_size, kv_heads, D]
    _, num_layers, _, kv_heads, head_dim = pool.shape
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or (*q.shape[:2], q.shape[3]) != (num_layers, 1,
                                                                                           head_dim):
        raise ValueError(f"q must have shape [num_layers={num_layers}, 1, q_heads, head_dim={head_dim}], "
                         f"got {_got(q)}")
    if q.shape[2] % kv_heads:
        raise ValueError(f"q_heads ({q.shape[2]}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if q.dtype != pool.dtype or q.device != pool.device:
        raise ValueError(f"q must have the cache's dtype {pool.dtype} and device {pool.device}, "
                         f"got {q.dtype} on {q.device}")
    if cache.seq_lens[seq_id] < 1:  # a KeyError for an unknown sequence
        raise ValueError(f"sequence {seq_id!r} is empty: attention needs at least one token")


def check_prefill(q, k_cache, v_cache, table, seq_len) -> int:
    """``paged_prefill_attention``'s arguments -> ``seq_len`` as an int."""
    _check_tensor(q, 3, rows=1, must="q must be a tensor of shape [n >= 1, q_heads, head_dim]")
    _check_tensor(table, 1, torch.int32, must="block_table must be a 1-D int32 tensor [max_blocks]")
    seq_len = as_int("seq_len", seq_len, minimum=1)
    n = q.shape[0]
    if seq_len < n:
        raise ValueError(f"seq_len must be >= n = {n} (the queries are its last n positions), got {seq_len}")
    lens = torch.tensor([seq_len], dtype=torch.int32, device=table.device)
    check_paged_inputs(q[-1:], k_cache, v_cache, table[None], lens)  # the last query as a decode
    return seq_len


def check_contiguous(q, k, v) -> None:
    """``contiguous_attention``'s ``q`` ``[batch, q_heads, q_len, D]``, ``k``, ``v`` ``[batch, kv_heads,
    kv_len, D]``."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[::3] != k.shape[::3]:
        raise ValueError(f"q must be [batch, q_heads, q_len, head_dim] and k, v both [batch, kv_heads, "
                         f"kv_len, head_dim] (one batch, one head_dim); got {_got(q)}, {_got(k)}, {_got(v)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")


def check_window(q_len, kv_len, window) -> tuple[int, int, int]:
    """``sliding_window_mask``'s sizes as ints."""
    q_len = as_int("q_len", q_len, minimum=1)
    kv_len = as_int("kv_len", kv_len, minimum=1)
    window = as_int("window", window, minimum=1)
    if q_len > kv_len:
        raise ValueError("q_len must be <= kv_len (the queries are the last q_len of kv_len positions), "
                         f"got q_len={q_len}, kv_len={kv_len}")
    return q_len, kv_len, window


def check_triton(q, k_cache, v_cache, num_splits, compiled: bool) -> int | None:
    """What the Triton kernels add to the checks of their torch twins -> ``num_splits`` as an int or None."""
    head_dim = q.shape[-1]
    block_size = k_cache.shape[1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be at most {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
    if block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"k_cache's block_size must be a power of two from 1 to {MAX_BLOCK_SIZE}, "
                         f"got {block_size}")
    if compiled and q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor for the compiled kernel, got device {q.device}")
    e4m3 = k_cache.dtype == torch.float8_e4m3fn
    if compiled and e4m3 and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError("a float8_e4m3fn cache needs compute capability 8.9+ for the Triton kernel "
                         "(Triton has no e4m3 below it); use float8_e5m2")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("q, k_cache and v_cache must not require grad: the Triton kernel has no backward "
                         "pass (call it under torch.no_grad(), or pass detached tensors)")
    if num_splits is None:
        return None
    return as_int("num_splits", num_splits, minimum=1, maximum=MAX_SPLITS)


def check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        window: int | None = None) -> tuple[list[int], list[int]]:
    """``paged_attention_varlen``'s arguments (two device syncs) -> ``(seq_lens, query_start_loc)`` as
    lists: ``query_start_loc`` starts at 0, rises by >= 1 per sequence to ``T``, and no sequence has more
    new tokens than ``seq_lens`` stores. ``window``: checked by ``check_window_size``; with one, table
    entries wholly before a sequence's windows may be ``NULL_BLOCK``."""
    _check_tensor(q, 3, rows=1, must="q must be a tensor of shape [T >= 1, q_heads, head_dim] (the new "
                                     "tokens of every sequence)")
    _check_tensor(query_start_loc, 1, torch.int32, rows=2,
                  must="query_start_loc must be an int32 tensor of shape [batch + 1] (batch >= 1)")
    batch = len(query_start_loc) - 1
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc must be on q's device {q.device}, got {query_start_loc.device}")
    if isinstance(seq_lens, torch.Tensor) and list(seq_lens.shape) != [batch]:
        raise ValueError(f"seq_lens must hold one length per sequence of query_start_loc, [batch={batch}], "
                         f"got {_got(seq_lens)}")
    starts = query_start_loc.tolist()
    new = [end - start for start, end in zip(starts, starts[1:])]  # new tokens per sequence
    if starts[0] != 0 or min(new) < 1 or starts[-1] != q.shape[0]:
        shown = starts
        if len(starts) > 10:
            shown = [*starts[:10], "..."]
        raise ValueError(f"query_start_loc must rise from 0 by at least 1 per sequence to T = {q.shape[0]} "
                         f"(q's rows), got {shown}")
    new_tokens = None
    if window is not None:
        new_tokens = query_start_loc.diff()                                          # [batch]
    check_paged_inputs(q[:batch], k_cache, v_cache, block_tables, seq_lens,  # caches: q's dtype or fp8
                       window=window, new_tokens=new_tokens)
    lens = seq_lens.tolist()
    for b in range(batch):
        if new[b] > lens[b]:
            raise ValueError(f"sequence {b} has {new[b]} new tokens in q but seq_lens[{b}] = {lens[b]} (its "
                             "cached plus new tokens) is smaller")
    return lens, starts


def check_cpu_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The fused CPU kernel's limits: checked tensors on the CPU, ``head_dim`` at most ``MAX_HEAD_DIM``,
    ``block_size`` at most ``MAX_CPU_BLOCK_SIZE``, each cache's ``head_dim`` contiguous (a pool's
    per-layer view is)."""
    if q.device.type != "cpu":
        raise ValueError(f"the CPU kernel takes tensors on the CPU, got q on {q.device}")
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM} for the CPU kernel, got {q.shape[2]}")
    if k_cache.shape[1] > MAX_CPU_BLOCK_SIZE:
        raise ValueError(f"block_size must be at most {MAX_CPU_BLOCK_SIZE} for the CPU kernel, got "
                         f"{k_cache.shape[1]}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.stride(3) != 1:
            raise ValueError(f"{name}'s head_dim must be contiguous (stride 1) for the CPU kernel, got "
                             f"strides {list(cache.stride())}")


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
