"""Build it yourself, notebook 01: what a KV cache costs.

Write the two functions below, then grade them:  python -m pagedlib.grade kv_bytes
(or, in a notebook: ``from pagedlib.grade import grade; grade("kv_bytes")``).

Checked: the bytes of one token for any model shape (integers up to 256 per field, GQA included), the six
models of notebook 01's table, and the bytes a paged cache holds for any list of sequence lengths (up to
2**62 tokens: integers only, a float would round). Both return an int: a float equal to it fails.
"""


def kv_bytes_per_token(num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       dtype_bytes: int) -> int:
    """Bytes of K and V that one token occupies across all layers (only K and V are cached)."""
    raise NotImplementedError


def paged_kv_bytes(seq_lens: list[int], block_size: int, bytes_per_token: int) -> int:
    """Bytes a paged cache holds for sequences of these lengths: each takes whole blocks of ``block_size``
    tokens, as few as hold its tokens."""
    raise NotImplementedError
