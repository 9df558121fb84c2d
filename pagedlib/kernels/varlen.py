"""Attention for a flat batch of query tokens (notebook 09): each sequence brings its last tokens, any number
(a decode's one, a prompt, a chunk after earlier chunks or a cached prefix), each attending causally to its
sequence's cached and new tokens through the block table. ``paged_attention_varlen`` (torch), its float64
oracle ``paged_attention_varlen_oracle`` and ``paged_attention_varlen_triton`` take the same arguments."""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedlib.core.fp8 import FP8_DTYPES, per_head
from pagedlib.kernels._checks import check_scales, check_varlen_inputs
from pagedlib.kernels.attention import default_chunk_bytes, softmax_scale
from pagedlib.util import ceil_div

CHUNK_BYTES = 16 * 2**20  # bound on one call's padded K+V copy (at least; 64 MiB off the CPU)
PAD_LIMIT = 1.2  # a piece's padded copy holds at most this many times its own blocks (padding costs more)


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float | None = None, *, k_scale: float | torch.Tensor = 1.0,
                           v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """One layer's attention for every query token of a step, decodes and prefill chunks mixed.

    Args:
        q: ``[T, q_heads, head_dim]``, the new tokens of every sequence, one sequence after the other.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, the new tokens' K/V written.
        block_tables, seq_lens: int32 ``[batch, max_blocks]`` (padded with -1) and ``[batch]``: tokens
            stored per sequence, cached plus new.
        query_start_loc: int32 ``[batch + 1]``: sequence ``b``'s new tokens are rows
            ``query_start_loc[b]:query_start_loc[b + 1]`` of ``q``, at its last positions.
        scale: softmax scale; default ``head_dim ** -0.5``.
        k_scale, v_scale: an fp8 cache's scales, a float or ``[kv_heads]`` (``pagedlib.core.fp8``).
    Returns:
        ``[T, q_heads, head_dim]``, like ``q``.
    """
    lens, starts = check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    plan = plan_varlen(block_tables, lens, starts, k_cache.shape[1],
                       2 * k_cache.shape[2] * k_cache.shape[3] * q.element_size())
    return attend_varlen(q, k_cache, v_cache, plan, softmax_scale(q.shape[2], scale), k_scale, v_scale)


class Piece(NamedTuple):
    """Sequences that one SDPA call attends, padded to the longest (``plan_varlen``: once per step)."""

    rows: slice | torch.Tensor      # its rows of q (a slice when they are consecutive)
    blocks: torch.Tensor            # int64 [c * n_blocks]: the blocks to copy, sequence after sequence
    unused: torch.Tensor            # int64: slots of the copy at or past their sequence's length (zeroed)
    seqs: int                       # c
    n: int                          # keys per sequence: the longest length
    scatter: tuple[torch.Tensor, torch.Tensor] | None  # each row's (sequence, index) in the padded queries
    mask: torch.Tensor | None       # bool [c, 1, m, n]: which keys each query sees; None: SDPA's causal case


def plan_varlen(block_tables: torch.Tensor, lens: list[int], starts: list[int], block_size: int,
                bytes_per_token: int) -> list[Piece]:
    """Cut a step (``seq_lens``, ``query_start_loc`` as lists) into pieces: the decodes apart (padding one
    to a chunk's length would multiply its work), each group sorted by length and cut where a piece's copy
    of K+V (``bytes_per_token``) would pass ``PAD_LIMIT`` times its own blocks or ``CHUNK_BYTES``."""
    new = [e - s for s, e in zip(starts, starts[1:])]                         # new tokens per sequence
    dev, tables, pieces = block_tables.device, block_tables.tolist(), []
    budget = max(CHUNK_BYTES, default_chunk_bytes(dev))
    for group in ([b for b, m in enumerate(new) if m == 1], [b for b, m in enumerate(new) if m > 1]):
        piece, own = [], 0                   # the open piece, padded to its last (longest), and its blocks
        for b in sorted(group, key=lambda b: lens[b]):
            blocks = ceil_div(lens[b], block_size)
            copy = (len(piece) + 1) * blocks                                   # its blocks with b in it
            if piece and (copy > PAD_LIMIT * (own + blocks) or copy * block_size * bytes_per_token > budget):
                pieces.append(plan_piece(tables, lens, starts, piece, block_size, dev))
                piece, own = [], 0
            piece.append(b)
            own += blocks
        pieces += [plan_piece(tables, lens, starts, piece, block_size, dev)] if piece else []
    return pieces


def plan_piece(tables: list[list[int]], lens: list[int], starts: list[int], g: list[int],
               block_size: int, device: torch.device) -> Piece:
    """The ``Piece`` of sequences ``g`` (indices into the step's batch; ``tables``: the block tables)."""
    long = partial(torch.tensor, dtype=torch.long, device=device)
    counts, n, blocks, unused = [starts[b + 1] - starts[b] for b in g], max(lens[b] for b in g), [], []
    width = ceil_div(n, block_size)                                           # blocks per sequence
    for b in g:       # table entries past a sequence's last block (-1) read block 0, zeroed like its tail
        used = ceil_div(lens[b], block_size)
        unused += range(len(blocks) * block_size + lens[b], (len(blocks) + width) * block_size)
        blocks += tables[b][:used] + [0] * (width - used)
    scatter = None if min(counts) == max(counts) else (    # queries padded to [c, m]: each row's (b, j)
        long([i for i, m in enumerate(counts) for _ in range(m)]),
        long([j for m in counts for j in range(m)]))
    # query j of sequence b sits at position lens[b] - new[b] + j and sees the keys up to it; whole prompts
    # of one length are SDPA's own causal case (which skips the masked half of the work)
    q_pos = long([[lens[b] - m + j for j in range(max(counts))] for b, m in zip(g, counts)])  # [c, m]
    mask = None if min(counts) == n else (torch.arange(n, device=device) <= q_pos[:, :, None])[:, None]
    rows = [r for b in g for r in range(starts[b], starts[b + 1])]                      # its rows of q
    rows = slice(rows[0], rows[-1] + 1) if rows == list(range(rows[0], rows[-1] + 1)) else long(rows)
    return Piece(rows, long(blocks), long(unused), len(g), n, scatter, mask)


def attend_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: list[Piece],
                  scale: float, k_scale: float | torch.Tensor = 1.0,
                  v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``paged_attention_varlen`` on checked inputs cut into pieces by ``plan_varlen`` (once per step), the
    scales as ``check_scales`` returns them: one ``attend_padded`` call per piece."""
    out = torch.empty_like(q)                                                  # [T, q_heads, D]
    for p in plan:
        out[p.rows] = attend_padded(q[p.rows], k_cache, v_cache, p, scale, k_scale, v_scale)
    return out


def attend_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: Piece, scale: float,
                  k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """One piece in one SDPA call on a copy of its blocks (one ``index_select`` per pool), zero at and past
    each sequence's length so that no NaN of an unused slot survives (fp8: dequantized into ``q``'s dtype).
    ``q`` ``[T, q_heads, head_dim]`` holds each sequence's new tokens in turn; returns the same shape."""
    (T, q_heads, head_dim), c, kv = q.shape, p.seqs, []
    for cache, s in ((k_cache, k_scale), (v_cache, v_scale)):
        x = cache.index_select(0, p.blocks)                                     # [c * n_blocks, bs, H, D]
        if cache.dtype in FP8_DTYPES:  # times its scale (checked by the caller), in q's dtype
            x = (x.float() * per_head(s)).to(q.dtype)
        x.view(-1, *x.shape[2:]).index_fill_(0, p.unused, 0.0)
        kv.append(x.view(c, -1, *x.shape[2:])[:, :p.n].transpose(1, 2))        # [c, H, n, D]: a view
    qp = q.view(c, -1, q_heads, head_dim) if p.scatter is None else \
        q.new_zeros(c, p.mask.shape[2], q_heads, head_dim).index_put_(p.scatter, q)  # [c, m, q_heads, D]
    o = F.scaled_dot_product_attention(qp.transpose(1, 2), *kv, attn_mask=p.mask, is_causal=p.mask is None,
                                       scale=scale, enable_gqa=True).transpose(1, 2)  # [c, m, q_heads, D]
    return o.reshape(T, q_heads, head_dim) if p.scatter is None else o[p.scatter]


def paged_attention_varlen_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float | None = None, *,
                                  k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0
                                  ) -> torch.Tensor:
    """What ``paged_attention_varlen`` computes, in float64, one sequence at a time, reading only the slots
    that hold tokens and masking with explicit positions. Returns float64 ``[T, q_heads, head_dim]``."""
    lens, starts = check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    (T, q_heads, head_dim), kv_heads, bs = q.shape, k_cache.shape[2], k_cache.shape[1]
    scale = softmax_scale(head_dim, scale)
    out = torch.empty(T, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for b, (n, a, e) in enumerate(zip(lens, starts, starts[1:])):
        key_pos = torch.arange(n, device=q.device)                             # [n]
        slot = block_tables[b].long()[key_pos // bs], key_pos % bs             # [n] block, offset each
        k, v = (x[slot].double() * per_head(s) for x, s in ((k_cache, k_scale), (v_cache, v_scale)))
        qb = q[a:e].double().reshape(e - a, kv_heads, q_heads // kv_heads, head_dim)  # [m, kv_heads, g, D]
        scores = torch.einsum("mhgd,nhd->mhgn", qb, k) * scale                 # [m, kv_heads, g, n]
        q_pos = torch.arange(n - (e - a), n, device=q.device)                  # [m] the new tokens' positions
        scores = scores.masked_fill((key_pos > q_pos[:, None])[:, None, None, :], float("-inf"))
        out[a:e] = torch.einsum("mhgn,nhd->mhgd", scores.softmax(-1), v).reshape(e - a, q_heads, head_dim)
    return out
