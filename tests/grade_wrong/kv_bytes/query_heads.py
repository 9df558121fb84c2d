"""Catches: a token costs K and V in every layer, for every KV head (never the query heads)

Counts the query heads: with GQA only the KV heads are cached."""


def kv_bytes_per_token(num_layers, num_q_heads, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_q_heads * head_dim * dtype_bytes


def paged_kv_bytes(seq_lens, block_size, bytes_per_token):
    return sum(-(-n // block_size) for n in seq_lens) * block_size * bytes_per_token
