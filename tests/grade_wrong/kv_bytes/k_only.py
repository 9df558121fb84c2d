"""Catches: the six models of notebook 01 cost what its table says

Forgets V (no factor 2); the first check catches it as well, the table names the model."""


def kv_bytes_per_token(num_layers, num_q_heads, num_kv_heads, head_dim, dtype_bytes):
    return num_layers * num_kv_heads * head_dim * dtype_bytes


def paged_kv_bytes(seq_lens, block_size, bytes_per_token):
    return sum(-(-n // block_size) for n in seq_lens) * block_size * bytes_per_token
