"""Attention for a flat batch of query tokens (notebook 09): each sequence brings its last tokens, any number
(a decode's one, a prompt, a chunk after earlier chunks or a cached prefix), each attending causally to its
sequence's cached and new tokens through the block table. ``paged_attention_varlen`` (torch), its float64
oracle ``paged_attention_varlen_oracle`` and ``paged_attention_varlen_triton`` take the same arguments.

A sliding ``window`` (notebook 15) limits what each query sees: the query at position ``p`` sees the keys
``k`` with ``p - window < k <= p`` (``window`` tokens, itself included), as transformers and vLLM define it.
A table entry may then be ``NULL_BLOCK`` (-1) for a block wholly before the window of every new token of
its sequence (a sliding-window group gave it back): no path reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedlib.core.fp8 import FP8_DTYPES, per_head
from pagedlib.kernels._checks import check_scales, check_varlen_inputs, check_window_size
from pagedlib.kernels.attention import default_chunk_bytes, softmax_scale
from pagedlib.util import ceil_div

CHUNK_BYTES = 16 * 2**20  # bound on one call's padded K+V copy (at least; 64 MiB off the CPU)
PAD_LIMIT = 1.2  # a piece's padded copy holds at most this many times its own blocks (padding costs more)


def paged_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float | None = None, *, k_scale: float | torch.Tensor = 1.0,
                           v_scale: float | torch.Tensor = 1.0, window: int | None = None) -> torch.Tensor:
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
        window: a sliding window, an int >= 1 (the query at ``p`` sees keys ``p - window < k <= p``; table
            entries wholly before every window of a sequence may be ``NULL_BLOCK``); ``None``: causal.
    Returns:
        ``[T, q_heads, head_dim]``, like ``q``.
    """
    window = check_window_size(window)
    lens, starts = check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, window)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    scale = softmax_scale(q.shape[2], scale)
    _, block_size, kv_heads, head_dim = k_cache.shape
    bytes_per_token = 2 * kv_heads * head_dim * q.element_size()             # K and V, in q's dtype
    plan = plan_varlen(block_tables, lens, starts, block_size, bytes_per_token, window)
    return attend_varlen(q, k_cache, v_cache, plan, scale, k_scale, v_scale)


class Piece(NamedTuple):
    """Sequences that one SDPA call attends, padded to the longest (``plan_varlen``: once per step)."""

    rows: slice | torch.Tensor      # its rows of q (a slice when they are consecutive)
    blocks: torch.Tensor            # int64 [c * n_blocks]: the blocks to copy, sequence after sequence
    unused: torch.Tensor            # int64: slots of the copy no query sees: past a sequence's length, and
                                    # (window) before its first window (zeroed)
    seqs: int                       # c
    n: int                          # keys per sequence: the longest span copied (its length, or from the
                                    # first block its window reaches)
    scatter: tuple[torch.Tensor, torch.Tensor] | None  # each row's (sequence, index) in the padded queries
    mask: torch.Tensor | None       # bool [c, 1, m, n]: which keys each query sees; None: SDPA's causal case


def plan_varlen(block_tables: torch.Tensor, lens: list[int], starts: list[int], block_size: int,
                bytes_per_token: int, window: int | None = None) -> list[Piece]:
    """Cut a step (``seq_lens``, ``query_start_loc`` as lists) into pieces: the decodes apart (padding one
    to a chunk's length would multiply its work), each group sorted by length and cut where a piece's copy
    of K+V (``bytes_per_token``) would pass ``PAD_LIMIT`` times its own blocks or ``CHUNK_BYTES``. With a
    ``window``, a sequence's copy starts at the first block its first new token's window reaches, and its
    length is counted from there."""
    new = [end - start for start, end in zip(starts, starts[1:])]             # new tokens per sequence
    first = None  # with a window: each sequence's first block to copy (those before it: never read)
    spans = lens  # tokens from a sequence's first copied block to its end
    if window is not None:
        first = [max(0, n - m - window + 1) // block_size for n, m in zip(lens, new)]
        spans = [n - f * block_size for n, f in zip(lens, first)]
    decodes = [b for b, m in enumerate(new) if m == 1]
    prefills = [b for b, m in enumerate(new) if m > 1]
    device = block_tables.device
    tables = block_tables.tolist()
    budget = max(CHUNK_BYTES, default_chunk_bytes(device))
    pieces = []
    for group in (decodes, prefills):
        piece = []  # the open piece, padded to its last (longest) sequence
        own = 0     # the blocks its sequences hold
        for b in sorted(group, key=lambda b: spans[b]):
            blocks = ceil_div(spans[b], block_size)
            copy = (len(piece) + 1) * blocks                                   # its blocks with b in it
            if piece and (copy > PAD_LIMIT * (own + blocks) or copy * block_size * bytes_per_token > budget):
                pieces.append(plan_piece(tables, lens, starts, piece, block_size, device, window, first))
                piece = []
                own = 0
            piece.append(b)
            own += blocks
        if piece:
            pieces.append(plan_piece(tables, lens, starts, piece, block_size, device, window, first))
    return pieces


def plan_piece(tables: list[list[int]], lens: list[int], starts: list[int], seqs: list[int],
               block_size: int, device: torch.device, window: int | None = None,
               first: list[int] | None = None) -> Piece:
    """The ``Piece`` of sequences ``seqs`` (indices into the step's batch; ``tables``: the block tables).
    With a ``window``, ``first[b]``: sequence ``b``'s first block to copy (``plan_varlen``'s)."""
    long = partial(torch.tensor, dtype=torch.long, device=device)
    counts = [starts[b + 1] - starts[b] for b in seqs]                        # new tokens of each
    skip = [0] * len(seqs)  # tokens before each sequence's copy: its first copied block's first position
    if first is not None:
        skip = [first[b] * block_size for b in seqs]
    spans = [lens[b] - s for b, s in zip(seqs, skip)]                         # tokens in each copy
    n = max(spans)                                                            # keys per sequence
    width = ceil_div(n, block_size)                                           # blocks per sequence
    blocks = []
    unused = []
    for b, m, s, span in zip(seqs, counts, skip, spans):
        # table entries past a sequence's last block (-1) read block 0, zeroed like its tail; with a window,
        # so are the slots of its first block before its first new token's window (no query sees them)
        start = len(blocks) * block_size                                      # its first slot in the copy
        if window is not None:
            unused += range(start, start + max(0, lens[b] - m - window + 1) - s)
        used = ceil_div(span, block_size)
        unused += range(start + span, start + width * block_size)
        blocks += tables[b][s // block_size:s // block_size + used] + [0] * (width - used)
    scatter = None    # queries padded to [c, m] when the counts differ: each row's (sequence, index)
    if min(counts) != max(counts):
        scatter = (long([i for i, m in enumerate(counts) for _ in range(m)]),
                   long([j for m in counts for j in range(m)]))
    mask = piece_mask(spans, counts, n, window, device)
    rows = [r for b in seqs for r in range(starts[b], starts[b + 1])]                  # its rows of q
    if rows == list(range(rows[0], rows[-1] + 1)):
        rows = slice(rows[0], rows[-1] + 1)
    else:
        rows = long(rows)
    return Piece(rows, long(blocks), long(unused), len(seqs), n, scatter, mask)


def piece_mask(spans: list[int], counts: list[int], n: int, window: int | None,
               device: torch.device) -> torch.Tensor | None:
    """bool ``[c, 1, m, n]``: which key ``i`` of each sequence's copy (of ``spans`` tokens, ``n`` the
    longest) each of its ``counts`` new tokens sees; ``None`` for SDPA's own causal case (whole prompts of
    one length, no window that cuts: it skips the masked half of the work)."""
    if min(counts) == n and (window is None or window >= n):
        return None
    # query j of a sequence of m new tokens sits at index span - m + j of its copy; it sees the keys up to
    # it and, with a window, those after its index - window
    q_pos = torch.tensor([[span - m + j for j in range(max(counts))] for span, m in zip(spans, counts)],
                         device=device)                                       # [c, m]
    keys = torch.arange(n, device=device)                                     # [n]
    mask = keys <= q_pos[:, :, None]                                          # [c, m, n]
    if window is not None:
        mask &= keys > q_pos[:, :, None] - window
    return mask[:, None]                                                      # [c, 1, m, n]


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
    T, q_heads, head_dim = q.shape
    c = p.seqs
    kv = []
    for cache, s in ((k_cache, k_scale), (v_cache, v_scale)):
        x = cache.index_select(0, p.blocks)                                     # [c * n_blocks, bs, H, D]
        if cache.dtype in FP8_DTYPES:  # times its scale (checked by the caller), in q's dtype
            x = (x.float() * per_head(s)).to(q.dtype)
        x.view(-1, *x.shape[2:]).index_fill_(0, p.unused, 0.0)
        kv.append(x.view(c, -1, *x.shape[2:])[:, :p.n].transpose(1, 2))        # [c, H, n, D]: a view
    if p.scatter is None:  # every sequence brings as many tokens: q's rows are [c, m] already
        padded = q.view(c, -1, q_heads, head_dim)                               # [c, m, q_heads, D]
    else:
        padded = q.new_zeros(c, p.mask.shape[2], q_heads, head_dim).index_put_(p.scatter, q)
    out = F.scaled_dot_product_attention(padded.transpose(1, 2), *kv, attn_mask=p.mask,
                                         is_causal=p.mask is None, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)                                                   # [c, m, q_heads, D]
    if p.scatter is None:
        return out.reshape(T, q_heads, head_dim)
    return out[p.scatter]                                                       # [T, q_heads, D]


def paged_attention_varlen_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float | None = None, *,
                                  k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                                  window: int | None = None) -> torch.Tensor:
    """What ``paged_attention_varlen`` computes, in float64, one sequence at a time, reading only the slots
    that hold tokens some new token sees (from the first new token's window on) and masking with explicit
    positions. Returns float64 ``[T, q_heads, head_dim]``."""
    window = check_window_size(window)
    lens, starts = check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, window)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    T, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    scale = softmax_scale(head_dim, scale)
    out = torch.empty(T, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])                                 # its m new tokens in q
        m = starts[b + 1] - starts[b]
        first = 0                                                              # the first key any query sees
        if window is not None:
            first = max(0, n - m - window + 1)
        key_pos = torch.arange(first, n, device=q.device)                      # [keys]
        block = block_tables[b].long()[key_pos // block_size]                  # [keys]
        offset = key_pos % block_size                                          # [n]
        k = k_cache[block, offset].double() * per_head(k_scale)                # [keys, kv_heads, D]
        v = v_cache[block, offset].double() * per_head(v_scale)
        qb = q[rows].double().reshape(m, kv_heads, group, head_dim)            # [m, kv_heads, group, D]
        scores = torch.einsum("mhgd,nhd->mhgn", qb, k) * scale                 # [m, kv_heads, group, keys]
        q_pos = torch.arange(n - m, n, device=q.device)[:, None]               # [m, 1]: new tokens
        hidden = key_pos > q_pos                                               # [m, keys]
        if window is not None:
            hidden |= key_pos <= q_pos - window
        scores = scores.masked_fill(hidden[:, None, None, :], float("-inf"))
        out[rows] = torch.einsum("mhgn,nhd->mhgd", scores.softmax(-1), v).reshape(m, q_heads, head_dim)
    return out


@dataclass
class Step:
    """The ``T`` new tokens of one forward pass over ``B`` sequences, where they go, and how they attend:
    the attention metadata ``PagedLlama`` builds once per step and passes down every layer (no global
    context). It lives beside the attention it feeds, as vLLM's attention backends define their metadata."""

    tokens: torch.Tensor              # int64 [T]
    positions: torch.Tensor           # int64 [T]
    blocks: torch.Tensor              # int64 [T]: each token's slot is (block, offset)
    offsets: torch.Tensor             # int64 [T]
    query_start_loc: torch.Tensor     # int32 [B + 1]: sequence b's rows are [loc[b], loc[b + 1])
    block_tables: torch.Tensor        # int32 [B, max_blocks], after the step
    seq_lens: torch.Tensor            # int32 [B], after the step
    attention: str                    # "torch" (attend_varlen), "triton" or "cpu" (the fused kernels)
    # attend_varlen's plans, one per window (None: full attention): made at the first layer of that window,
    # kept for the others (a window changes the mask and the blocks copied)
    plans: dict[int | None, list[Piece]] = field(default_factory=dict)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               k_scale: float | torch.Tensor, v_scale: float | torch.Tensor,
               window: int | None = None) -> torch.Tensor:
        """One layer's attention for every new token: ``q`` ``[T, q_heads, head_dim]`` -> the same (the
        scales: an fp8 cache's, notebook 10; ``window``: a sliding-window layer's, an int >= 1, or ``None``
        for full attention). The torch path skips ``paged_attention_varlen``'s checks and plans the step
        once per window, at its first layer (as vLLM's backends build their metadata once a step). The
        step's one ``block_tables`` serves every layer: layers whose KV-cache group has tables of its own
        need a ``Step`` of their own."""
        if window is not None:
            window = check_window_size(window)
        if self.attention == "cpu":  # the fused C kernel: one call reads every block in place
            from pagedlib.kernels.cpu_varlen import attend_cpu

            return attend_cpu(q, k_pool, v_pool, self.block_tables, self.seq_lens, self.query_start_loc,
                              q.shape[-1] ** -0.5, k_scale, v_scale, window=window)
        if self.attention == "triton":
            # paged_attention_varlen's Triton twin, imported only when asked for (Linux wheels only)
            from pagedlib.kernels.triton_varlen import paged_attention_varlen_triton

            return paged_attention_varlen_triton(q, k_pool, v_pool, self.block_tables,
                                                 self.seq_lens, self.query_start_loc,
                                                 k_scale=k_scale, v_scale=v_scale, window=window)
        plan = self.plans.get(window)
        if plan is None:  # the bytes of K+V per token in the model's dtype (an fp8 pool's dequantized)
            kv_bytes_per_token = 2 * k_pool.shape[-2] * k_pool.shape[-1] * q.element_size()
            plan = plan_varlen(self.block_tables, self.seq_lens.tolist(), self.query_start_loc.tolist(),
                               k_pool.shape[1], kv_bytes_per_token, window)
            self.plans[window] = plan
        return attend_varlen(q, k_pool, v_pool, plan, q.shape[-1] ** -0.5, k_scale, v_scale)
