"""Catches: the softmax scale is honoured: a given scale is used, and None means head_dim ** -0.5

Always scales by head_dim ** -0.5, whatever scale it is given."""

import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        pos = torch.arange(int(seq_lens[b]))
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float().repeat_interleave(q_heads // kv_heads, dim=1)
        v = v_cache[blocks, pos % block_size].float().repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * head_dim**-0.5
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
