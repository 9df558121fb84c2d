"""Build it yourself, notebook 04: attention through a block table, one decode step.

Write ``paged_attention`` below, then grade it:  python -m pagedlib.grade paged_attention
(or, in a notebook: ``from pagedlib.grade import grade; grade("paged_attention")``).

Checked against pagedlib's float64 oracle (``paged_attention_oracle``) within the dtype's tolerance
(``TOLERANCES`` of ``pagedlib.kernels.attention``), on generated batches: block sizes 1 to 32, context
lengths at, just before and just after block boundaries, GQA groups 1, 2, 4 and 8, MQA (one KV head),
float32, float16 and bfloat16, caches that are contiguous or a strided view of one layer of a pool; that
query head h reads KV head h // group (query head 13 of 16 reads KV head 3 of 4), for its keys and its
values; that what sits past each sequence's length never changes the result (NaN or 1e4 in the unused
slots of the last block and in free blocks, unused table entries naming free blocks instead of -1); a
sequence of one token; the softmax scale, given and by default.
"""

import torch


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """One decode step of one layer: each sequence's newest query attends to all of its cached keys.

    q:            [batch, q_heads, head_dim], one query token per sequence.
    k_cache:      [num_blocks, block_size, kv_heads, head_dim], the pool of key blocks (it may be a strided
                  view, one layer of a bigger pool: index it, do not ``.view`` it); v_cache the same.
    block_tables: int32 [batch, max_blocks]: sequence b's token p sits in block block_tables[b, p //
                  block_size], at slot p % block_size. Only the first ceil(seq_lens[b] / block_size)
                  entries of a row are the sequence's; the rest may be -1 or any block id at all.
    seq_lens:     int32 [batch], each >= 1: how many tokens each sequence has (its context length).
    scale:        the softmax scale; None means head_dim ** -0.5.

    GQA: q_heads is a multiple of kv_heads; query head h uses KV head h // (q_heads // kv_heads).
    Slots past a sequence's length (the rest of its last block, blocks behind unused table entries) hold
    anything, NaN included: none may change the result. Compute in float32 (or better) whatever the
    dtype; return [batch, q_heads, head_dim] in q's dtype. Read the inputs only.
    """
    raise NotImplementedError
