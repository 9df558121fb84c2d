"""Catches: a sequence of one token attends to that token

Counts a sequence's blocks as seq_len // block_size, so the partly filled last block is left out (a
sequence of one token in a block of 16 has no block at all, and attends to nothing)."""

import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    out = torch.empty_like(q)
    for b in range(batch):
        blocks = block_tables[b, : int(seq_lens[b]) // block_size].long()
        k = k_cache[blocks].flatten(0, 1).float().repeat_interleave(q_heads // kv_heads, dim=1)
        v = v_cache[blocks].flatten(0, 1).float().repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
