"""Attention that reads its keys and values through block tables (notebook 04).

The same softmax(q K^T * scale) V, computed four ways:

- ``reference_paged_attention``: the article's oracle. One sequence, every layer, one query position; it
  copies K/V token by token through the block table into contiguous tensors, repeats the KV heads for GQA
  and runs plain einsum attention. Slow on purpose: every step is visible.
- ``paged_attention``: one decode step of one layer for a batch of sequences of different lengths:
  gather whole blocks through the tables, mask the positions past each sequence's length, two matmuls.
- ``paged_prefill_attention``: causal attention for a prompt (or a chunk of one) whose K/V were just
  written into the cache.
- ``contiguous_attention``: the baseline, PyTorch's ``scaled_dot_product_attention`` (SDPA) on ordinary
  contiguous K/V.

``paged_attention_oracle`` computes what ``paged_attention`` computes in float64, for checking kernels
against ``TOLERANCES`` and ``REL_ERROR_LIMITS``; ``check_paged_inputs`` is the validation every paged
decode path shares (the Triton kernel of ``pagedlib.kernels.triton_decode`` included).

GQA convention (the one of SDPA's ``enable_gqa`` and of ``repeat_interleave``): with ``group = q_heads //
kv_heads``, query head ``h`` attends with KV head ``h // group``.

Contract of every function here: inputs are only read, never written (a call that raises has changed
nothing); slots that hold no token (free blocks, the unwritten tail of a last block, blocks behind
padded table entries) may contain anything, NaN and inf included, and never reach a result; no state is
kept between calls, so several threads may call these functions at once, as long as no thread writes the
cache (``PagedKVCache.append_tokens`` and friends) while another reads it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F

from pagedlib.checks import as_int, ceil_div

__all__ = [
    "REL_ERROR_LIMITS",
    "SUPPORTED_DTYPES",
    "TOLERANCES",
    "check_paged_inputs",
    "contiguous_attention",
    "default_chunk_bytes",
    "kv_bytes",
    "paged_attention",
    "paged_attention_oracle",
    "paged_prefill_attention",
    "plan_chunks",
    "reference_paged_attention",
    "rel_error",
    "softmax_scale",
]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: Elementwise tolerances between two attention outputs of one dtype (``assert_close(a, b, **TOL)``): the
#: article's absolute ones plus about one unit in the last place of the output (for bf16 outputs above 1,
#: one ulp, 0.0078, is already more than 5e-3, so no implementation could meet an absolute bound alone).
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 5e-3, "rtol": 1.6e-2},
}

#: Limits of ``rel_error(out, paged_attention_oracle(...))`` for a kernel's output of each dtype.
REL_ERROR_LIMITS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def softmax_scale(head_dim: int, scale: object = None) -> float:
    """The softmax scale: ``head_dim ** -0.5`` when ``scale`` is None, else ``scale`` checked to be a
    finite number > 0 (``ValueError`` naming ``scale`` otherwise)."""
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < float(scale) < math.inf:
        raise ValueError(f"scale must be None or a finite number > 0, got {scale!r}")
    return float(scale)


def kv_bytes(seq_lens: torch.Tensor | list[int], kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that one decode step must read: ``2 * sum(seq_lens) * kv_heads * head_dim *
    dtype_bytes`` (the numerator of the GB/s figures)."""
    lens = seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens
    total = sum(as_int(f"seq_lens[{i}]", n, minimum=0) for i, n in enumerate(lens))
    return 2 * total * as_int("kv_heads", kv_heads, minimum=1) * as_int("head_dim", head_dim, minimum=1) \
        * dtype.itemsize


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64: one number for a whole output, compared with
    ``REL_ERROR_LIMITS``."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


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
    _check_reference_query(q, cache.k, num_layers, kv_heads, head_dim)
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
    scores = torch.einsum("lqhd,lkhd->lhqk", q.to(acc), k_exp.to(acc)) * softmax_scale(head_dim)
    probs = torch.softmax(scores, dim=-1)                                      # [L, q_heads, 1, seq_len]
    return torch.einsum("lhqk,lkhd->lqhd", probs, v_exp.to(acc)).to(q.dtype)  # [L, 1, q_heads, D]


# ------------------------------------------------------------------------------------------------------
# vectorized paged attention: gather -> mask -> two matmuls


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
        chunk_bytes: the batch is processed in chunks of consecutive sequences whose gathered K+V copy
            fits in this many bytes (``plan_chunks``); default ``default_chunk_bytes(q.device)``.
    Returns:
        ``[batch, q_heads, head_dim]``, like ``q``.

    Inputs are only read. The call keeps no state: threads may call it at once (but not while another
    thread writes the cache). Autograd works as for any PyTorch code.
    """
    batch, q_heads, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables,
                                                                        seq_lens)
    scale = softmax_scale(head_dim, scale)
    chunk_bytes = default_chunk_bytes(q.device) if chunk_bytes is None else _check_chunk_bytes(chunk_bytes)
    lens = seq_lens.tolist()
    bytes_per_token = 2 * kv_heads * head_dim * q.element_size()
    out = torch.empty_like(q)                                                  # [batch, q_heads, D]
    for chunk in plan_chunks(lens, block_size, bytes_per_token, chunk_bytes):
        sl = slice(chunk.start, chunk.stop)
        out[sl] = _attend_chunk(q[sl], k_cache, v_cache, block_tables[sl], seq_lens[sl], lens[sl], scale)
    return out


def _attend_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  seq_lens: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """``paged_attention`` for ``c`` sequences (validated inputs; ``lens`` is ``seq_lens`` as a list)."""
    c, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    n = max(lens)                                       # every sequence is padded to the longest
    n_blocks = ceil_div(n, block_size)
    acc = torch.float32                                 # scores, softmax and sums in float32

    # 1. gather whole blocks. Table entries past a sequence's last block (-1 padding) become block 0:
    #    gathered like the others, then masked.
    used = torch.arange(n_blocks, device=q.device) * block_size < seq_lens[:, None]  # [c, n_blocks]
    ids = torch.where(used, tables[:, :n_blocks], 0).long()                        # [c, n_blocks]
    k = _gather(k_cache, ids, n).to(acc).transpose(1, 2)                           # [c, kv_heads, n, D]
    v = _gather(v_cache, ids, n).to(acc).transpose(1, 2)

    # 2. scores with grouped heads: the `group` query heads of a KV head are rows of one matrix
    qg = q.reshape(c, kv_heads, q_heads // kv_heads, head_dim).to(acc) * scale    # [c, kv_heads, group, D]
    scores = torch.matmul(qg, k.transpose(2, 3))                                   # [c, kv_heads, group, n]

    # 3. mask positions at or past each length: replace the score (a NaN key gives a NaN score) and zero
    #    the V row (0 * NaN is NaN). A chunk of equal lengths has nothing to mask.
    if min(lens) < n:
        invalid = torch.arange(n, device=q.device) >= seq_lens[:, None]            # [c, n]
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        v = v.masked_fill(invalid[:, None, :, None], 0.0)

    # 4. softmax, then the second matmul
    out = torch.matmul(torch.softmax(scores, dim=-1), v)                           # [c, kv_heads, group, D]
    return out.reshape(c, q_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Copy the blocks ``ids`` (int64 ``[c, n_blocks]``, valid) out of ``cache`` ``[num_blocks,
    block_size, kv_heads, head_dim]`` with one ``index_select`` and keep the first ``n_tokens``
    positions: ``[c, n_tokens, kv_heads, head_dim]``."""
    c, n_blocks = ids.shape
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, ids.reshape(-1))               # [c * n_blocks, block_size, kv_heads, D]
    return blocks.view(c, n_blocks * block_size, kv_heads, head_dim)[:, :n_tokens]


GPU_CHUNK_BYTES = 64 * 2**20


def default_chunk_bytes(device: torch.device) -> int:
    """``paged_attention``'s default ``chunk_bytes``. On a CPU 0, one sequence per chunk: its copy is still
    in the processor's cache when the matmuls read it, and nothing is padded (``python -m pagedlib.bench
    attention`` measures it several times faster than one chunk for the whole batch). Elsewhere (GPUs)
    ``GPU_CHUNK_BYTES``: chunks of up to 64 MiB of gathered K+V, few launches, bounded memory."""
    return 0 if device.type == "cpu" else GPU_CHUNK_BYTES


def plan_chunks(seq_lens: list[int], block_size: int, bytes_per_token: int,
                chunk_bytes: float) -> list[range]:
    """Cut a batch into chunks of consecutive sequences for ``paged_attention``.

    A chunk's gathered copy is padded to its longest sequence in whole blocks: ``len(chunk) *
    n_blocks * block_size * bytes_per_token`` bytes. A sequence joins the current chunk while that stays
    within ``chunk_bytes``; a chunk holds at least one sequence. So no copy is larger than
    ``max(chunk_bytes, the longest sequence's own blocks)``, however long or uneven the batch.
    """
    if not seq_lens:
        return []
    chunks, start, width = [], 0, 0                     # width: padded tokens per sequence of the chunk
    for i, n in enumerate(seq_lens):
        padded = ceil_div(n, block_size) * block_size
        if i > start and (i + 1 - start) * max(width, padded) * bytes_per_token > chunk_bytes:
            chunks.append(range(start, i))
            start, width = i, 0
        width = max(width, padded)
    chunks.append(range(start, len(seq_lens)))
    return chunks


def _check_chunk_bytes(chunk_bytes: object) -> float:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, numbers.Real) or not chunk_bytes >= 0:
        raise ValueError(f"chunk_bytes must be None or a number >= 0 (math.inf: the whole batch at once), "
                         f"got {chunk_bytes!r}")
    return float(chunk_bytes)


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
    its own); ``n == 1`` is a decode step. Inputs are only read; threads as for ``paged_attention``.

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
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 1 \
            or block_table.dtype != torch.int32:
        got = f"{block_table.dtype} {list(block_table.shape)}" if isinstance(block_table, torch.Tensor) \
            else type(block_table).__name__
        raise ValueError(f"block_table must be a 1-D int32 tensor [max_blocks], got {got}")
    n = q.shape[0]
    seq_len = as_int("seq_len", seq_len, minimum=1)
    if seq_len < n:
        raise ValueError(f"seq_len must be >= n = {n} (the queries are its last n positions), got {seq_len}")
    lens = torch.tensor([seq_len], dtype=torch.int32, device=block_table.device)
    check_paged_inputs(q[-1:], k_cache, v_cache, block_table[None], lens)
    scale = softmax_scale(q.shape[2], scale)
    ids = block_table[None, : ceil_div(seq_len, k_cache.shape[1])].long()     # [1, n_blocks]
    # 4-D [1, heads, tokens, D] views: SDPA's fused CPU kernel takes 4-D inputs only
    k = _gather(k_cache, ids, seq_len).transpose(1, 2)                         # [1, kv_heads, seq_len, D]
    v = _gather(v_cache, ids, seq_len).transpose(1, 2)
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q must be [batch, q_heads, q_len, head_dim] and k, v both [batch, kv_heads, "
                         f"kv_len, head_dim]; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k.shape[1]})")
    scale = softmax_scale(q.shape[3], scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def paged_attention_oracle(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """What ``paged_attention`` computes, in float64: one sequence at a time, reading only the slots that
    hold tokens (so garbage elsewhere cannot matter). Same arguments; returns float64 ``[batch, q_heads,
    head_dim]``, not rounded to ``q``'s dtype, so that an output's error against it is never hidden."""
    batch, q_heads, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables,
                                                                        seq_lens)
    scale = softmax_scale(head_dim, scale)
    group = q_heads // kv_heads
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)                                 # [n]
        phys = block_tables[b].long()[pos // block_size]                       # [n] block of each token
        k = k_cache[phys, pos % block_size].double()                           # [n, kv_heads, D]
        v = v_cache[phys, pos % block_size].double()
        qb = q[b].double().reshape(kv_heads, group, head_dim)                  # [kv_heads, group, D]
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * scale                   # [kv_heads, group, n]
        out[b] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(q_heads, head_dim)
    return out


# ------------------------------------------------------------------------------------------------------
# validation


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    """Validate ``paged_attention``'s tensor arguments; raise ``ValueError`` naming the first bad one and
    what was expected. Beyond shapes, dtypes (``SUPPORTED_DTYPES``, the pools in q's) and devices, it
    checks each length (in ``[1, max_blocks * block_size]``) and each table entry a sequence uses (in
    ``[0, num_blocks)``); that reads the tensors (one device synchronisation on a GPU). Strided views
    such as ``PagedKVCache.layer(l)`` are fine. Returns ``(batch, q_heads, kv_heads, head_dim,
    block_size)``.
    """
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables,
             "seq_lens": seq_lens}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            what = f"a {t.layout} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a dense torch.Tensor, got {what}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    geometry = _check_shapes(q, k_cache, v_cache)
    _check_tables(q, block_tables, seq_lens)
    _check_paged_values(block_tables, seq_lens, k_cache.shape[0], geometry[4])
    return geometry


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    """Shapes and dtypes of ``q`` and the pools; returns ``(batch, q_heads, kv_heads, head_dim,
    block_size)``."""
    if q.dim() != 3:
        hint = " (one query token per sequence; for several, paged_prefill_attention)" if q.dim() == 4 else ""
        raise ValueError(f"q must have shape [batch, q_heads, head_dim], got {list(q.shape)}{hint}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must have shape [num_blocks, block_size, kv_heads, head_dim], "
                         f"got {list(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache must have k_cache's shape {list(k_cache.shape)}, "
                         f"got {list(v_cache.shape)}")
    batch, q_heads, q_dim = q.shape
    _, block_size, kv_heads, head_dim = k_cache.shape
    for what, size in (("block_size (dim 1)", block_size), ("kv_heads (dim 2)", kv_heads),
                       ("head_dim (dim 3)", head_dim)):
        if size < 1:
            raise ValueError(f"k_cache's {what} must be >= 1, got shape {list(k_cache.shape)}")
    if batch < 1:
        raise ValueError("q must hold at least one sequence (batch >= 1), got batch 0")
    if q_dim != head_dim:
        raise ValueError(f"q's head_dim must equal the cache's head_dim {head_dim}, got {q_dim}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must have a dtype in {[str(d) for d in SUPPORTED_DTYPES]}, got {q.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    return batch, q_heads, kv_heads, head_dim, block_size


def _check_tables(q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Dtypes and shapes of ``block_tables`` and ``seq_lens``, and that they hold one row per query."""
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be an int32 tensor of shape [batch, max_blocks], "
                         f"got {block_tables.dtype} {list(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be an int32 tensor of shape [batch], "
                         f"got {seq_lens.dtype} {list(seq_lens.shape)}")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables and seq_lens must describe the same sequences, got "
                         f"{block_tables.shape[0]} rows and {seq_lens.shape[0]} lengths")
    if q.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"q must hold one query token per sequence, [batch={seq_lens.shape[0]}, q_heads, "
                         f"head_dim], got {list(q.shape)} (several tokens of one sequence: use "
                         f"paged_prefill_attention)")


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


def _check_reference_query(q: torch.Tensor, pool: torch.Tensor, num_layers: int, kv_heads: int,
                           head_dim: int) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != num_layers or q.shape[1] != 1 \
            or q.shape[3] != head_dim:
        got = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must have shape [num_layers={num_layers}, 1, q_heads, head_dim={head_dim}], "
                         f"got {got}")
    if q.shape[2] % kv_heads:
        raise ValueError(f"q_heads ({q.shape[2]}) must be a multiple of the cache's kv_heads ({kv_heads})")
    if q.dtype != pool.dtype or q.device != pool.device:
        raise ValueError(f"q must have the cache's dtype {pool.dtype} and device {pool.device}, "
                         f"got {q.dtype} on {q.device}")


# sliding windows (notebook 07)

def sliding_window_mask(q_len: int, kv_len: int, window: int, device: torch.device | str | None = None
                        ) -> torch.Tensor:
    """bool ``[q_len, kv_len]``: the queries are the last ``q_len`` of ``kv_len`` positions, and query
    ``i`` (at position ``p = kv_len - q_len + i``) may see key ``j`` iff ``p - window < j <= p``.
    ``True`` means "attend", as SDPA's ``attn_mask`` takes it."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]   # [q_len, 1]
    k_pos = torch.arange(kv_len, device=device)[None, :]                   # [1, kv_len]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def sliding_window_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step with a sliding window: each sequence's newest token attends to its last
    ``window`` positions, read through the block table.

    Args:
        q: ``[batch, q_heads, head_dim]``, the query of each sequence's newest token.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``.
        block_tables: int32 ``[batch, max_blocks]`` (padded with -1): the blocks the cache still holds.
        seq_lens: int32 ``[batch]``: tokens the cache still holds (>= 1), the newest one included.
        window: positions each query sees, its own included.
    Returns:
        ``[batch, q_heads, head_dim]``.

    Released blocks start at a block boundary, so the window is simply the last ``min(window, n)`` held
    tokens. Blocks are gathered whole (``[batch, n_blocks * block_size, kv_heads, head_dim]``); slots
    outside the window or past the length get the score ``-inf`` and a zeroed V row (they may hold NaN).
    """
    batch, q_heads, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables,
                                                                        seq_lens)
    window = as_int("window", window, minimum=1)
    scale = softmax_scale(head_dim, scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    lens = seq_lens.long()[:, None]                                          # [batch, 1]
    n_blocks = ceil_div(int(seq_lens.max()), block_size)
    tables = block_tables[:, :n_blocks].long().clamp(min=0)                  # -1 padding -> block 0, masked
    width = n_blocks * block_size
    k = k_cache[tables].reshape(batch, width, kv_heads, head_dim).to(acc)    # [batch, width, kv_heads, D]
    v = v_cache[tables].reshape(batch, width, kv_heads, head_dim).to(acc)
    pos = torch.arange(width, device=q.device)[None, :]                      # [1, width]
    hidden = (pos >= lens) | (pos < lens - window)                           # [batch, width]
    v = v.masked_fill(hidden[:, :, None, None], 0.0)
    qg = q.to(acc).view(batch, kv_heads, q_heads // kv_heads, head_dim) * scale
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k)                          # [batch, kv_heads, group, width]
    scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgn,bnhd->bhgd", scores.softmax(-1), v)             # [batch, kv_heads, group, D]
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)
