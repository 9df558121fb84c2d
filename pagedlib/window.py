"""Sliding-window attention on the paged cache (notebook 07).

With a sliding window of ``w`` positions (Mistral 7B uses w = 4096), the token at position ``i`` attends
to positions ``i - w + 1 .. i`` only. Paging composes with it: once a whole block lies before the window
of a sequence's newest token, no later token can see it either, so the block goes back to the free stack
and the sequence holds at most ``ceil(w / block_size) + 1`` blocks however long it grows.

The cache then holds the sequence's tokens from a block boundary on: its ``seq_lens`` counts the tokens
still held and ``tables`` starts at the first block still held. The caller keeps the position of the
first held token (the number of positions released) where it needs it, e.g. for rotary embeddings.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from pagedlib.attention import check_paged_inputs, softmax_scale
from pagedlib.cache import PagedKVCache
from pagedlib.checks import as_int, ceil_div

__all__ = ["release_outside_window", "sliding_window_attention", "sliding_window_mask"]


def release_outside_window(cache: PagedKVCache, seq_id: Hashable, window: int) -> int:
    """Give back the leading blocks of ``seq_id`` that lie wholly before the window of its newest token.

    Returns the number of token positions released (a multiple of ``block_size``; 0 if none)."""
    window = as_int("window", window, minimum=1)
    held = cache.seq_lens[seq_id]             # KeyError for an unknown sequence, before any change
    dead = max(0, held - window) // cache.block_size
    if dead:
        cache.release_leading_blocks(seq_id, dead)
    return dead * cache.block_size


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
