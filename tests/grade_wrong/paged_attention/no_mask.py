"""Catches: garbage past each length never changes the result (NaN, 1e4, table entries naming garbage blocks)

Gathers the sequence's whole blocks and attends to every slot of them, the unused tail of the last block
included: nothing is masked."""

import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    out = torch.empty_like(q)
    for b in range(batch):
        n_blocks = (int(seq_lens[b]) + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].flatten(0, 1).float()                 # [n_blocks * block_size, kv_heads, D]
        v = v_cache[blocks].flatten(0, 1).float()
        k = k.repeat_interleave(q_heads // kv_heads, dim=1)
        v = v.repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
