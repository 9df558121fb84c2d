"""Catches: garbage past each length never changes the result (NaN, 1e4, table entries naming garbage blocks)

Gathers every block whose table entry is not -1, then trims the last block's unused slots from the end
of what it gathered: right while unused entries are -1, wrong when they name real blocks."""

import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    out = torch.empty_like(q)
    for b in range(batch):
        blocks = block_tables[b][block_tables[b] >= 0].long()
        k = k_cache[blocks].flatten(0, 1).float().repeat_interleave(q_heads // kv_heads, dim=1)
        v = v_cache[blocks].flatten(0, 1).float().repeat_interleave(q_heads // kv_heads, dim=1)
        keep = k.shape[0] - (-int(seq_lens[b])) % block_size      # drop the last block's unused slots
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k[:keep]) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[:keep]).to(q.dtype)
    return out
