"""pagedlib's answer to task ``kv_bytes``: ``teach.sizing``'s formulas behind the task's signatures."""

from pagedlib.teach.sizing import ModelSpec, blocks_needed
from pagedlib.teach.sizing import kv_bytes_per_token as per_token


def kv_bytes_per_token(num_layers, num_q_heads, num_kv_heads, head_dim, dtype_bytes):
    return per_token(ModelSpec("task", num_layers, num_kv_heads, head_dim, num_q_heads), dtype_bytes)


def paged_kv_bytes(seq_lens, block_size, bytes_per_token):
    return sum(blocks_needed(n, block_size) for n in seq_lens) * block_size * bytes_per_token
