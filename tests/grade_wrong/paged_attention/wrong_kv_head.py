"""Catches: query head h reads KV head h // group (query head 13 of 16 reads KV head 3 of 4)

Repeats the KV heads with ``repeat`` instead of ``repeat_interleave``: query head h reads KV head
h % kv_heads."""

import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    out = torch.empty_like(q)
    for b in range(batch):
        pos = torch.arange(int(seq_lens[b]))
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().repeat(1, q_heads // kv_heads, 1)
        v = v_cache[blocks, pos % block_size].float().repeat(1, q_heads // kv_heads, 1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
