"""Catches: a token costs K and V in every layer, for every KV head (never the query heads)

Counts the KV heads as num_q_heads / group with true division: the right number of bytes, but a float."""


def kv_bytes_per_token(num_layers, num_q_heads, num_kv_heads, head_dim, dtype_bytes):
    group = num_q_heads // num_kv_heads
    return 2 * num_layers * (num_q_heads / group) * head_dim * dtype_bytes


def paged_kv_bytes(seq_lens, block_size, bytes_per_token):
    blocks = sum((n + block_size - 1) // block_size for n in seq_lens)
    return blocks * block_size * bytes_per_token
