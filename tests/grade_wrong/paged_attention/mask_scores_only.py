"""Catches: garbage past each length never changes the result (NaN, 1e4, table entries naming garbage blocks)

Gathers whole blocks and masks the scores of slots past the length with -inf, but leaves their V rows in:
a weight of 0 times a NaN value is still NaN."""

import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(seq_lens[b])
        blocks = block_tables[b, : (n + block_size - 1) // block_size].long()
        k = k_cache[blocks].flatten(0, 1).float().repeat_interleave(q_heads // kv_heads, dim=1)
        v = v_cache[blocks].flatten(0, 1).float().repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        scores = scores.masked_fill(torch.arange(k.shape[0]) >= n, float("-inf"))
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
