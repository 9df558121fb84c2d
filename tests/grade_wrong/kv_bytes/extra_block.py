"""Catches: a paged cache holds whole blocks, and a sequence of 0 tokens none, exactly (no floats)

Off by one at a block boundary: n // block_size + 1 blocks, one too many when n is a multiple."""


def kv_bytes_per_token(num_layers, num_q_heads, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def paged_kv_bytes(seq_lens, block_size, bytes_per_token):
    return sum(n // block_size + 1 for n in seq_lens) * block_size * bytes_per_token
