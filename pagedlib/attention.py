"""Attention that reads its keys and values through block tables (notebook 04).

The same softmax(q K^T * scale) V, computed four ways:

- ``reference_paged_attention``: the article's oracle. One sequence, every layer, one query position; it
  copies K/V token by token through the block table into contiguous tensors, expands the KV heads for GQA
  and runs plain einsum attention. Slow on purpose: every step is visible.
- ``paged_attention``: one decode step of one layer for a batch of sequences of different lengths. Whole
  blocks are gathered through the tables, positions at or past a sequence's length are masked, and two
  matmuls with grouped query heads do the math (no KV head is repeated).
- ``paged_prefill_attention``: causal attention for a prompt (or a chunk of one) whose K/V were just
  written into the cache.
- ``contiguous_attention``: the baseline, PyTorch's ``scaled_dot_product_attention`` (SDPA) on ordinary
  contiguous K/V.

``paged_attention_oracle`` is a float64 version of ``paged_attention`` (same arguments) for checking
kernels, and ``check_paged_inputs`` is the validation every paged decode path shares (the Triton kernel
in ``pagedlib.triton_attention`` included).

GQA convention (the one of SDPA's ``enable_gqa`` and of ``repeat_interleave``): with ``group = q_heads //
kv_heads``, query head ``h`` attends with KV head ``h // group``.

Slots that hold no token (free blocks, the unwritten tail of a last block, blocks behind padded table
entries) may contain anything, NaN and inf included. No function here lets them reach a result.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CPU_CHUNK_BYTES",
    "check_paged_inputs",
    "contiguous_attention",
    "kv_bytes",
    "paged_attention",
    "paged_attention_oracle",
    "paged_prefill_attention",
    "reference_paged_attention",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

# On a CPU, paged_attention gathers and attends one sequence at a time by default: the gathered copy is
# still in the processor's cache when the matmuls read it, and a single sequence's [kv_heads, n, D] view
# needs no reshaping copy (notebook 04 measures the alternatives). On a GPU: the whole batch at once.
CPU_CHUNK_BYTES = 0


def kv_bytes(seq_lens: torch.Tensor | list[int], kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that one decode step must read: ``2 * sum(seq_lens) * kv_heads * head_dim *
    dtype_bytes`` (the numerator of the GB/s figures)."""
    total = int(sum(seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens))
    return 2 * total * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


# ------------------------------------------------------------------------------------------------------
# validation


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    check_values: bool = True,
) -> tuple[int, int, int, int, int]:
    """Validate the arguments of a paged decode step; raise ``ValueError`` naming the first bad one.

    Args:
        q: ``[batch, q_heads, head_dim]``, float32/float16/bfloat16 (float64 for oracles).
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, q's dtype and device (strided
            views such as ``PagedKVCache.layer(l)`` are fine).
        block_tables: int32 ``[batch, max_blocks]``; entries past a sequence's last block are ignored
            (conventionally -1).
        seq_lens: int32 ``[batch]``, each in ``[1, max_blocks * block_size]``.
        check_values: also check the values of ``seq_lens`` and of the table entries a sequence uses
            (each in ``[0, num_blocks)``). This reads the tensors (one device synchronisation on a GPU).
    Returns:
        ``(batch, q_heads, kv_heads, head_dim, block_size)``.
    """
    for name, t in [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)]:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [batch, q_heads, head_dim], got {list(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    batch, q_heads, q_dim = q.shape
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    if batch < 1:
        raise ValueError("q must hold at least one sequence (batch >= 1), got batch 0")
    if q_dim != head_dim:
        raise ValueError(f"q's head_dim must equal the cache's head_dim {head_dim}, got {q_dim}")
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must have a dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {q.dtype}")
    for name, t in [("k_cache", k_cache), ("v_cache", v_cache)]:
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    for name, t in [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)]:
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be an int32 tensor of shape [batch={batch}, max_blocks], "
                         f"got {block_tables.dtype} {list(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be an int32 tensor of shape [batch={batch}], "
                         f"got {seq_lens.dtype} {list(seq_lens.shape)}")
    if check_values:
        _check_paged_values(block_tables, seq_lens, num_blocks, block_size)
    return batch, q_heads, kv_heads, head_dim, block_size


def _check_paged_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                        block_size: int) -> None:
    """Lengths within the tables' capacity; used table entries valid. One sync when all is well."""
    max_blocks = block_tables.shape[1]
    lens = seq_lens.long()                                                          # [batch]
    bad_len = (lens < 1) | (lens > max_blocks * block_size)                         # [batch]
    used = torch.arange(max_blocks, device=lens.device) < (lens[:, None] + block_size - 1) // block_size
    bad_entry = used & ((block_tables < 0) | (block_tables >= num_blocks))           # [batch, max_blocks]
    if not bool(bad_len.any() | bad_entry.any()):
        return
    if bad_len.any():
        i = int(bad_len.nonzero()[0, 0])
        raise ValueError(f"seq_lens[{i}] = {int(lens[i])} must be between 1 and the block table's capacity "
                         f"max_blocks * block_size = {max_blocks} * {block_size} = {max_blocks * block_size}")
    b, j = (int(x) for x in bad_entry.nonzero()[0])
    last = min(int(lens[b]), (j + 1) * block_size) - 1
    raise ValueError(f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is not a block id in "
                     f"[0, num_blocks={num_blocks}), yet sequence {b} (length {int(lens[b])}) keeps "
                     f"positions {j * block_size}..{last} there")


# ------------------------------------------------------------------------------------------------------
# the article's oracle


def reference_paged_attention(cache: Any, seq_id: Any, q: torch.Tensor) -> torch.Tensor:
    """Decode attention for one sequence and every layer, the slow and obvious way.

    Args:
        cache: a ``PagedKVCache`` (uses ``k``, ``v`` ``[num_blocks, num_layers, block_size, kv_heads,
            head_dim]``, ``tables``, ``seq_lens``, ``block_size``).
        seq_id: a sequence the cache holds (at least one token).
        q: ``[num_layers, 1, q_heads, head_dim]``, the query of the newest position, cache's dtype.
    Returns:
        ``[num_layers, 1, q_heads, head_dim]``.
    """
    num_layers, kv_heads, head_dim = cache.k.shape[1], cache.k.shape[3], cache.k.shape[4]
    if q.dim() != 4 or q.shape[0] != num_layers or q.shape[1] != 1 or q.shape[3] != head_dim:
        raise ValueError(f"q must have shape [num_layers={num_layers}, 1, q_heads, head_dim={head_dim}], "
                         f"got {list(q.shape)}")
    if q.shape[2] % kv_heads:
        raise ValueError(f"q_heads ({q.shape[2]}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if q.dtype != cache.k.dtype or q.device != cache.k.device:
        raise ValueError(f"q must have the cache's dtype {cache.k.dtype} and device {cache.k.device}, "
                         f"got {q.dtype} on {q.device}")
    seq_len, blocks = cache.seq_lens[seq_id], cache.tables[seq_id]
    if seq_len < 1:
        raise ValueError(f"sequence {seq_id!r} is empty: attention needs at least one token")

    # 1. gather, one token at a time: position p lives in block blocks[p // block_size], slot p % block_size
    k_full = cache.k.new_empty(num_layers, seq_len, kv_heads, head_dim)      # [L, seq_len, kv_heads, D]
    v_full = torch.empty_like(k_full)
    for pos in range(seq_len):
        phys, off = blocks[pos // cache.block_size], pos % cache.block_size
        k_full[:, pos] = cache.k[phys, :, off]                                 # [L, kv_heads, D]
        v_full[:, pos] = cache.v[phys, :, off]

    # 2. GQA: repeat every KV head for the `group` query heads that share it
    group = q.shape[2] // kv_heads
    k_exp = k_full.repeat_interleave(group, dim=2)                             # [L, seq_len, q_heads, D]
    v_exp = v_full.repeat_interleave(group, dim=2)

    # 3. attention, accumulated in (at least) float32 as real kernels do, rounded once at the end
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("lqhd,lkhd->lhqk", q.to(acc), k_exp.to(acc)) * head_dim**-0.5  # [L, q_heads, 1, n]
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("lhqk,lkhd->lqhd", probs, v_exp.to(acc)).to(q.dtype)  # [L, 1, q_heads, D]


# ------------------------------------------------------------------------------------------------------
# vectorized paged attention


_workspaces = threading.local()  # per thread: {(slot, dtype): buffer}
_WORKSPACE_MAX_BYTES = 64 * 2**20


def _workspace(slot: int, numel: int, like: torch.Tensor) -> torch.Tensor | None:
    """A reusable CPU buffer of ``numel`` elements (``slot`` 0 for K, 1 for V), or ``None`` (allocate).

    On a CPU, a fresh multi-MiB tensor on every call costs page faults that take longer than the copy
    itself; reusing one buffer avoids them. (GPU allocators cache memory already.) Each thread has its
    own buffers, so concurrent calls from different threads never share one."""
    if like.device.type != "cpu" or numel * like.element_size() > _WORKSPACE_MAX_BYTES:
        return None
    buffers: dict[tuple[int, torch.dtype], torch.Tensor] = _workspaces.__dict__.setdefault("buffers", {})
    buf = buffers.get((slot, like.dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(slot, like.dtype)] = torch.empty(numel, dtype=like.dtype)
    return buf[:numel]


def _gather(cache: torch.Tensor, tables: torch.Tensor, n_tokens: int,
            slot: int | None = None) -> torch.Tensor:
    """Copy whole blocks out of ``cache`` ``[num_blocks, block_size, kv_heads, head_dim]`` through
    ``tables`` (int64 ``[c, n_blocks]``, valid ids) and keep the first ``n_tokens`` positions:
    ``[c, n_tokens, kv_heads, head_dim]``. With a workspace ``slot``, the copy lands in a reused buffer
    (valid until the next call with that slot)."""
    c, n_blocks = tables.shape
    _, block_size, kv_heads, head_dim = cache.shape
    shape = (c * n_blocks, block_size, kv_heads, head_dim)
    buf = None if slot is None else _workspace(slot, math.prod(shape), cache)
    ids = tables.reshape(-1)
    if buf is None:
        blocks = cache.index_select(0, ids)          # [c * n_blocks, bs, H, D]; faster than cache[tables]
    else:
        blocks = torch.index_select(cache, 0, ids, out=buf.view(shape))
    return blocks.view(c, n_blocks * block_size, kv_heads, head_dim)[:, :n_tokens]


def _chunks(lens: list[int], block_size: int, bytes_per_token: int, budget: float) -> Iterator[range]:
    """Split the batch into runs of consecutive sequences whose gathered K/V (padded to the longest
    sequence of the run, in whole blocks) fit in ``budget`` bytes; a run holds at least one sequence."""
    start = 0
    while start < len(lens):
        stop, width = start + 1, -(-lens[start] // block_size)
        while stop < len(lens):
            w = max(width, -(-lens[stop] // block_size))
            if (stop + 1 - start) * w * block_size * bytes_per_token > budget:
                break
            stop, width = stop + 1, w
        yield range(start, stop)
        start = stop


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    chunk_bytes: float | None = None,
) -> torch.Tensor:
    """One decode step of one layer for a batch of sequences of different lengths.

    Args:
        q: ``[batch, q_heads, head_dim]``, the query of each sequence's newest position.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` (e.g. ``cache.layer(l)``).
        block_tables: int32 ``[batch, max_blocks]``, padded with -1.
        seq_lens: int32 ``[batch]``, each >= 1.
        scale: softmax scale; default ``head_dim ** -0.5``.
        chunk_bytes: gather runs of consecutive sequences whose K+V copy fits in this many bytes (a run
            holds at least one sequence). Default: ``CPU_CHUNK_BYTES`` (0: one sequence per run) on a
            CPU, the whole batch in one run on a GPU.
    Returns:
        ``[batch, q_heads, head_dim]``, like ``q``.

    For each run of ``c`` sequences: gather their blocks (``[c, n, kv_heads, head_dim]``, ``n`` the
    longest length of the run), then attend with grouped heads: ``q`` viewed as ``[c, kv_heads, group,
    head_dim]`` against K ``[c, kv_heads, n, head_dim]``, so no KV head is ever repeated. Positions at or
    past a sequence's length get the score ``-inf`` (replaced, not added: the slot may hold NaN) and a
    zeroed V row (``0 * NaN`` would be NaN). Scores and softmax run in float32 (or float64).
    """
    batch, q_heads, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables,
                                                                        seq_lens)
    if chunk_bytes is None:
        chunk_bytes = math.inf if q.device.type == "cuda" else CPU_CHUNK_BYTES
    scale = head_dim**-0.5 if scale is None else scale
    acc = torch.promote_types(q.dtype, torch.float32)          # accumulation dtype
    group = q_heads // kv_heads
    lens = seq_lens.tolist()
    lens_dev = seq_lens.long()
    out = torch.empty_like(q)                                                  # [batch, q_heads, D]
    bytes_per_token = 2 * kv_heads * head_dim * q.element_size()
    for run in _chunks(lens, block_size, bytes_per_token, chunk_bytes):
        sl, c = slice(run.start, run.stop), len(run)
        n = max(lens[sl])
        n_blocks = -(-n // block_size)
        tables = block_tables[sl, :n_blocks].long()                            # [c, n_blocks]
        if -(-min(lens[sl]) // block_size) < n_blocks:
            # entries past a sequence's last block (-1 padding) point at block 0: gathered, then masked
            used = torch.arange(n_blocks, device=q.device) * block_size < lens_dev[sl, None]
            tables = torch.where(used, tables, 0)
        k = _gather(k_cache, tables, n, slot=0).to(acc).transpose(1, 2)        # [c, kv_heads, n, D]
        v = _gather(v_cache, tables, n, slot=1).to(acc).transpose(1, 2)
        qg = q[sl].view(c, kv_heads, group, head_dim).to(acc) * scale          # [c, kv_heads, group, D]
        scores = torch.matmul(qg, k.transpose(2, 3))                           # [c, kv_heads, group, n]
        if min(lens[sl]) < n:  # some rows of the run are garbage
            invalid = torch.arange(n, device=q.device) >= lens_dev[sl, None]    # [c, n]
            scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
            v = v.masked_fill(invalid[:, None, :, None], 0.0)
        probs = torch.softmax(scores, dim=-1)                                  # [c, kv_heads, group, n]
        out[sl] = torch.matmul(probs, v).view(c, q_heads, head_dim)            # [c, q_heads, D]
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention for the last ``n`` positions of one sequence, whose K/V are already in the cache.

    With ``n == seq_len`` this is the prefill of a fresh prompt; with ``n < seq_len`` it is a chunk of a
    prompt after earlier tokens (query ``i`` sits at position ``seq_len - n + i`` and sees positions up to
    its own); ``n == 1`` is a decode step.

    Args:
        q: ``[n, q_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_table: int32 ``[max_blocks]``, the sequence's physical blocks (padding allowed).
        seq_len: tokens stored, the prompt included (``n <= seq_len``).
        scale: softmax scale; default ``head_dim ** -0.5``.
    Returns:
        ``[n, q_heads, head_dim]``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] < 1:
        raise ValueError(f"q must be a tensor of shape [n >= 1, q_heads, head_dim], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 1:
        raise ValueError("block_table must be a 1-D int32 tensor [max_blocks]")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < q.shape[0]:
        raise ValueError(f"seq_len must be an int >= n = {q.shape[0]} (the queries are its last n "
                         f"positions), got {seq_len!r}")
    lens = torch.tensor([seq_len], dtype=torch.int32, device=block_table.device)
    check_paged_inputs(q[-1:], k_cache, v_cache, block_table[None], lens)
    n = q.shape[0]
    block_size = k_cache.shape[1]
    tables = block_table[None, : -(-seq_len // block_size)].long()            # [1, n_blocks]
    # 4-D [1, heads, tokens, D] views: SDPA's fused CPU kernel takes 4-D inputs only
    k = _gather(k_cache, tables, seq_len).transpose(1, 2)                      # [1, kv_heads, seq_len, D]
    v = _gather(v_cache, tables, seq_len).transpose(1, 2)
    qh = q.transpose(0, 1)[None]                                               # [1, q_heads, n, D]
    if n == seq_len:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos = torch.arange(seq_len - n, seq_len, device=q.device)              # [n] query positions
        mask = torch.arange(seq_len, device=q.device) <= pos[:, None]         # [n, seq_len]
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)                                                # [n, q_heads, D]


# ------------------------------------------------------------------------------------------------------
# baseline and oracle


def contiguous_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, causal: bool = False
) -> torch.Tensor:
    """The baseline: SDPA on contiguous K/V, grouped heads without repeating K/V (``enable_gqa``).

    Args:
        q: ``[batch, q_heads, q_len, head_dim]`` (``q_len`` 1 for decode).
        k, v: ``[batch, kv_heads, kv_len, head_dim]``, ``q_heads`` a multiple of ``kv_heads``.
        causal: mask future keys (prefill, with ``q_len == kv_len``).
    Returns:
        ``[batch, q_heads, q_len, head_dim]``.
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [batch, q_heads, q_len, head_dim] and k, v both [batch, kv_heads, "
                         f"kv_len, head_dim]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def paged_attention_oracle(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``paged_attention`` computed in float64, one sequence at a time, reading only the slots that hold
    tokens (so garbage elsewhere cannot matter). Same arguments; returns ``[batch, q_heads, head_dim]``
    in ``q``'s dtype (the float64 result rounded once)."""
    batch, q_heads, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables,
                                                                        seq_lens)
    scale = head_dim**-0.5 if scale is None else scale
    group = q_heads // kv_heads
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)                                 # [n]
        phys = block_tables[b].long()[pos // block_size]                       # [n] block of each token
        k = k_cache[phys, pos % block_size].double()                           # [n, kv_heads, D]
        v = v_cache[phys, pos % block_size].double()
        qb = q[b].double().view(kv_heads, group, head_dim)                     # [kv_heads, group, D]
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * scale                   # [kv_heads, group, n]
        out[b] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(q_heads, head_dim)
    return out.to(q.dtype)
