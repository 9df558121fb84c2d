import torch


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = head_dim**-0.5
    out = torch.empty_like(q)
    for b in range(batch):
        pos = torch.arange(int(seq_lens[b]))                      # this sequence's positions only
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].float()             # [n, kv_heads, head_dim]
        v = v_cache[blocks, pos % block_size].float()
        k = k.repeat_interleave(q_heads // kv_heads, dim=1)       # [n, q_heads, head_dim]
        v = v.repeat_interleave(q_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
