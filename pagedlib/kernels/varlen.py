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
from pagedlib.kernels.attention import _gather, softmax_scale


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

    The decodes (one new token each) share one batched call; each longer chunk gets one SDPA call."""
    decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if len(decode) == len(lens):                    # a pure decode step: q's rows are the sequences
        return decode_rows(q, k_cache, v_cache, block_tables, seq_lens, lens, scale)
    out = torch.empty_like(q)                                                  # [T, q_heads, D]
    if decode == list(range(len(decode))):          # decodes first, as a scheduler orders them: slices
        rows = ids = slice(0, len(decode))
    else:
        rows = torch.tensor([starts[b] for b in decode], device=q.device)      # [n_decode] rows of q
        ids = torch.tensor(decode, device=q.device)                            # [n_decode] sequences
    if decode:
        out[rows] = decode_rows(q[rows], k_cache, v_cache, block_tables[ids], seq_lens[ids],
                                [lens[b] for b in decode], scale)
    for b in (b for b in range(len(lens)) if starts[b + 1] - starts[b] > 1):
        sl = slice(starts[b], starts[b + 1])
        out[sl] = causal_chunk(q[sl], k_cache, v_cache, block_tables[b], lens[b], scale)
    return out


def decode_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                seq_lens: torch.Tensor, lens: list[int], scale: float) -> torch.Tensor:
    """One query token per sequence (checked inputs, ``lens`` is ``seq_lens`` as a list): ``q`` ``[c,
    q_heads, head_dim]`` -> the same, through one block gather and one SDPA call for all ``c``."""
    (c, q_heads, head_dim), bs, kv_heads, n = q.shape, k_cache.shape[1], k_cache.shape[2], max(lens)
    n_blocks = ceil_div(n, bs)
    # whole blocks, one index_select each for K and V; table entries past a sequence's last block (-1
    # padding) become block 0, gathered like the others, then masked
    used = torch.arange(n_blocks, device=q.device) * bs < seq_lens[:, None]      # [c, n_blocks]
    ids = torch.where(used, tables[:, :n_blocks], 0).long()                      # [c, n_blocks]
    k, v = _gather(k_cache, ids, n), _gather(v_cache, ids, n)                    # [c, n, kv_heads, D]
    mask = None
    if min(lens) < n:  # zero the slots past each length in the copy: a NaN key would poison its score
        mask = torch.arange(n, device=q.device) < seq_lens[:, None]             # [c, n]
        k, v = (x.masked_fill_(~mask[:, :, None, None], 0.0) for x in (k, v))
        mask = mask[:, None, None]                                               # [c, 1, 1, n]
    qg = q.reshape(c, kv_heads, q_heads // kv_heads, head_dim)    # a GQA group's heads are query rows
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale)                              # [c, kv_heads, group, D]
    return o.reshape(c, q_heads, head_dim)


def causal_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 seq_len: int, scale: float) -> torch.Tensor:
    """The last ``n`` positions of one sequence of ``seq_len`` tokens (checked inputs): ``q`` ``[n, q_heads,
    head_dim]`` -> the same; query ``i`` sits at position ``seq_len - n + i`` and sees keys up to there."""
    n = q.shape[0]
    ids = table[None, : ceil_div(seq_len, k_cache.shape[1])].long()           # [1, n_blocks]
    # only the seq_len stored tokens are gathered: no unused slot (NaN) reaches SDPA
    k = _gather(k_cache, ids, seq_len).transpose(1, 2)                        # [1, kv_heads, seq_len, D]
    v = _gather(v_cache, ids, seq_len).transpose(1, 2)
    pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]       # [n, 1] query positions
    mask = None if n == seq_len else torch.arange(seq_len, device=q.device) <= pos  # [n, seq_len]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale, enable_gqa=True)          # [1, q_heads, n, D]
    return o[0].transpose(0, 1)                                               # [n, q_heads, D]


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
