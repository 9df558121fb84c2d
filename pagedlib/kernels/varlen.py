"""Attention for a flat batch of query tokens (notebook 09): each sequence brings any number of new tokens,
its last ones (one for a decode, a whole prompt, or a chunk of one after earlier chunks or a cached
prefix), and each attends causally to its sequence's cached and new tokens through the block table.
``paged_attention_varlen`` is the torch path, ``paged_attention_varlen_oracle`` the float64 reference; the
Triton kernel ``paged_attention_varlen_triton`` takes the same arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlib.kernels._checks import check_varlen_inputs
from pagedlib.kernels.attention import default_chunk_bytes, plan_chunks, softmax_scale

CHUNK_BYTES = 16 * 2**20  # bound on one call's padded K+V copy (at least; 64 MiB off the CPU)


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float | None = None) -> torch.Tensor:
    """One layer's attention for every query token of a step, decodes and prefill chunks mixed.

    Args:
        q: ``[T, q_heads, head_dim]``, the new tokens of every sequence, one sequence after the other.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, the new tokens' K/V written.
        block_tables, seq_lens: int32 ``[batch, max_blocks]`` (padded with -1) and ``[batch]``: tokens
            stored per sequence, cached plus new.
        query_start_loc: int32 ``[batch + 1]``: sequence ``b``'s new tokens are rows
            ``query_start_loc[b]:query_start_loc[b + 1]`` of ``q``, at its last positions.
        scale: softmax scale; default ``head_dim ** -0.5``.
    Returns:
        ``[T, q_heads, head_dim]``, like ``q``.
    """
    lens, starts = check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    return attend_varlen(q, k_cache, v_cache, block_tables, seq_lens, lens, starts, softmax_scale(q.shape[2],
                                                                                                   scale))


def attend_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, lens: list[int], starts: list[int], scale: float) -> torch.Tensor:
    """``paged_attention_varlen`` on checked inputs, ``seq_lens`` and ``query_start_loc`` also given as the
    lists ``lens`` and ``starts`` (a caller that checked once per step calls this once per layer).

    Two groups: the decodes (one new token), and the prompts and chunks (padding a decode to a chunk's
    length would multiply its work); each in pieces of consecutive sequences whose padded K/V copy stays
    within ``CHUNK_BYTES`` (``plan_chunks``), one ``attend_padded`` call per piece."""
    new = [e - s for s, e in zip(starts, starts[1:])]                         # new tokens per sequence
    bs, per_token = k_cache.shape[1], 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    budget, pieces = max(CHUNK_BYTES, default_chunk_bytes(q.device)), []
    for group in ([b for b, m in enumerate(new) if m == 1], [b for b, m in enumerate(new) if m > 1]):
        chunks = plan_chunks([lens[b] for b in group], bs, per_token, budget)
        pieces += [group[r.start:r.stop] for r in chunks]
    if len(pieces) == 1:                                                       # one call: q as it is
        return attend_padded(q, k_cache, v_cache, block_tables, seq_lens, lens, new, scale)
    out = torch.empty_like(q)                                                  # [T, q_heads, D]
    for g in pieces:
        if g == list(range(g[0], g[-1] + 1)):      # consecutive sequences (decodes first, as vLLM orders a
            ids, rows = slice(g[0], g[-1] + 1), slice(starts[g[0]], starts[g[-1] + 1])  # step): views
        else:
            ids = torch.tensor(g, device=q.device)
            rows = torch.tensor([r for b in g for r in range(starts[b], starts[b + 1])], device=q.device)
        out[rows] = attend_padded(q[rows], k_cache, v_cache, block_tables[ids], seq_lens[ids],
                                  [lens[b] for b in g], [new[b] for b in g], scale)
    return out


def attend_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                  seq_lens: torch.Tensor, lens: list[int], new: list[int], scale: float) -> torch.Tensor:
    """``c`` sequences, each padded to the longest, in one gather and one SDPA call (checked inputs): ``q``
    ``[T, q_heads, head_dim]`` holds each sequence's ``new[b]`` tokens in turn; returns the same shape."""
    (T, q_heads, head_dim), bs, c, n, m = q.shape, k_cache.shape[1], len(lens), max(lens), max(new)
    dev = q.device
    # keys: positions past a length repeat the sequence's last token, so padding reads a stored token
    # (never an unused slot, which may hold NaN) and the mask gives it weight 0
    pos = torch.minimum(torch.arange(n, device=dev), seq_lens[:, None] - 1)    # [c, n]
    block, slot = tables.gather(1, pos // bs).long(), pos % bs                  # [c, n] each
    k, v = gather_tokens(k_cache, block, slot), gather_tokens(v_cache, block, slot)  # [c, kv_heads, n, D]
    # queries: [c, m, ...], sequence b's tokens first in its row, then zeros
    if min(new) == m:                                                           # no padding: a view
        seq = j = None
        qp = q.view(c, m, q_heads, head_dim)
    else:
        new_t = torch.tensor(new, device=dev)                                   # [c]
        seq = torch.repeat_interleave(torch.arange(c, device=dev), new_t)       # [T] each row's sequence
        j = torch.arange(T, device=dev) - (new_t.cumsum(0) - new_t)[seq]        # [T] its index there
        qp = q.new_zeros(c, m, q_heads, head_dim)
        qp[seq, j] = q
    # query j of sequence b sits at position lens[b] - new[b] + j and sees the keys up to it; whole prompts
    # of one length are SDPA's own causal case (which skips the masked half of the work)
    q_pos = (seq_lens - torch.tensor(new, device=dev))[:, None] + torch.arange(m, device=dev)  # [c, m]
    mask = None if min(new) == n else (torch.arange(n, device=dev) <= q_pos[:, :, None])[:, None]  # [c,1,m,n]
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True).transpose(1, 2)  # [c, m, q_heads, D]
    return o.reshape(T, q_heads, head_dim) if seq is None else o[seq, j]


def gather_tokens(cache: torch.Tensor, block: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``cache[block, slot]`` for a pool ``[num_blocks, block_size, kv_heads, head_dim]`` and int64 ``block``,
    ``slot`` ``[c, n]``, as ``[c, kv_heads, n, head_dim]``: a contiguous copy in SDPA's layout."""
    kv_heads, head_dim = cache.shape[2:]
    heads = torch.arange(kv_heads, device=cache.device)[:, None]             # [kv_heads, 1]
    strides = cache.stride()
    if strides[3] != 1 or any(s % head_dim for s in strides[:3]):           # an unusual view: index it
        return cache[block[:, None], slot[:, None], heads]
    # the pool as a table of head_dim-long rows (a view, no copy), read with one index_select: (block,
    # slot, head) is row (block * stride0 + slot * stride1 + head * stride2) / head_dim
    last = sum((size - 1) * s for size, s in zip(cache.shape[:3], strides[:3])) // head_dim
    rows = cache.as_strided((last + 1, head_dim), (head_dim, 1), cache.storage_offset())
    s0, s1, s2 = (s // head_dim for s in strides[:3])
    index = (block * s0 + slot * s1)[:, None, :] + heads * s2                # [c, kv_heads, n]
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, head_dim)


def paged_attention_varlen_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """What ``paged_attention_varlen`` computes, in float64, one sequence at a time, reading only the slots
    that hold tokens and masking with explicit positions. Returns float64 ``[T, q_heads, head_dim]``."""
    lens, starts = check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    (T, q_heads, head_dim), kv_heads, bs = q.shape, k_cache.shape[2], k_cache.shape[1]
    scale = softmax_scale(head_dim, scale)
    out = torch.empty(T, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        a, e = starts[b], starts[b + 1]
        key_pos = torch.arange(n, device=q.device)                             # [n]
        phys = block_tables[b].long()[key_pos // bs]                           # [n] block of each token
        k = k_cache[phys, key_pos % bs].double()                               # [n, kv_heads, D]
        v = v_cache[phys, key_pos % bs].double()
        qb = q[a:e].double().reshape(e - a, kv_heads, q_heads // kv_heads, head_dim)  # [m, kv_heads, g, D]
        scores = torch.einsum("mhgd,nhd->mhgn", qb, k) * scale                 # [m, kv_heads, g, n]
        q_pos = torch.arange(n - (e - a), n, device=q.device)                  # [m] the new tokens' positions
        scores = scores.masked_fill((key_pos > q_pos[:, None])[:, None, None, :], float("-inf"))
        out[a:e] = torch.einsum("mhgn,nhd->mhgd", scores.softmax(-1), v).reshape(e - a, q_heads, head_dim)
    return out
