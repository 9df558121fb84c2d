"""Catches: a paged cache holds whole blocks, and a sequence of 0 tokens none, exactly (no floats)

Rounds up through a float: right for short sequences, wrong past 2**53 tokens."""

import math


def kv_bytes_per_token(num_layers, num_q_heads, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def paged_kv_bytes(seq_lens, block_size, bytes_per_token):
    return sum(math.ceil(n / block_size) for n in seq_lens) * block_size * bytes_per_token
