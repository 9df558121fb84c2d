"""Attention for a flat batch of query tokens (notebook 09): each sequence brings any number of new tokens,
its last ones (one for a decode, a whole prompt, or a chunk of one after earlier chunks or a cached
prefix), and each attends causally to its sequence's cached and new tokens through the block table.
``paged_attention_varlen`` is the torch path, ``paged_attention_varlen_oracle`` the float64 reference; the
Triton kernel ``paged_attention_varlen_triton`` takes the same arguments."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlib.checks import ceil_div
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
    (T, q_heads, head_dim), c, n, m = q.shape, len(lens), max(lens), max(new)
    dev = q.device
    k, v = (gather_padded(x, tables, seq_lens, n) for x in (k_cache, v_cache))  # [c, kv_heads, n, D]
    # queries: [c, m, ...], sequence b's tokens first in its row, then zeros
    if min(new) == m:                                                           # no padding: a view
        seq = j = None
        qp = q.reshape(c, m, q_heads, head_dim)
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


def gather_padded(cache: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, n: int) -> torch.Tensor:
    """Positions ``0..n-1`` of ``c`` sequences of a pool ``[num_blocks, block_size, kv_heads, head_dim]``
    (``tables`` ``[c, max_blocks]``, ``seq_lens`` ``[c]``): a copy, viewed as ``[c, kv_heads, n, head_dim]``
    for SDPA (a contiguous one measured no faster here), zero at and past each sequence's length (no NaN of
    an unused slot survives)."""
    c, (bs, kv_heads, head_dim) = tables.shape[0], cache.shape[1:]
    n_blocks = ceil_div(n, bs)
    # whole blocks in one index_select; table entries past a sequence's last block (-1) read block 0
    used = torch.arange(n_blocks, device=cache.device) * bs < seq_lens[:, None]       # [c, n_blocks]
    ids = torch.where(used, tables[:, :n_blocks], 0).long()                          # [c, n_blocks]
    x = cache.index_select(0, ids.reshape(-1)).view(c * n_blocks * bs, kv_heads * head_dim)  # token rows
    unused = torch.arange(n_blocks * bs, device=cache.device) >= seq_lens[:, None]   # [c, n_blocks * bs]
    x.index_fill_(0, unused.reshape(-1).nonzero().squeeze(1), 0.0)
    return x.view(c, n_blocks * bs, kv_heads, head_dim)[:, :n].transpose(1, 2)


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
