"""Build it yourself, notebook 05: the fused decode kernel, an online softmax over tiles of the block table.

Write the body of ``decode_kernel`` below (about 30 lines; the launcher ``decode_attention`` is written),
then grade it:  python -m pagedlib.grade decode_kernel
(or, in a notebook: ``from pagedlib.grade import grade; grade("decode_kernel")``).

One program runs per (sequence, KV head): program ``(seq, kv_head)`` computes the output of the query heads
``kv_head * GROUP ... kv_head * GROUP + GROUP - 1`` (the GQA group of that KV head) as one
``[GROUP_P, HEAD_DIM_P]`` tile. Triton's tile sizes are powers of two, so ``GROUP_P`` and ``HEAD_DIM_P`` round
``GROUP`` and ``HEAD_DIM`` up: mask the padding rows and columns on every load and store. It walks the
sequence's positions ``0 .. seq_len - 1``, ``TILE`` at a time: position ``p`` is in block
``table[p // BLOCK_SIZE]``, slot ``p % BLOCK_SIZE``. Positions at or past ``seq_len`` must never be read (the
slots past a sequence's length hold anything, NaN included, and the table entries past its last block are -1
or any block id). Keep the online softmax's state in float32 (notebook 05, section 2): the running max
``m_i`` and sum ``l_i`` per query row, the weighted sum of V ``acc`` per row; when a tile raises the max,
rescale ``l_i`` and ``acc`` by ``alpha``; at the end store ``acc / l_i``. ``qk_scale`` is the softmax scale
times log2(e): ``tl.exp2(x * qk_scale)`` is ``exp(x * scale)``. ``tl.dot`` or ``tl.sum`` of a broadcast
product both work in the interpreter (compiled for a GPU, ``tl.dot`` needs its reduction dimension >= 16).

Checked in Triton's interpreter (pagedlib selects it on a machine without CUDA; the grader always uses it),
case by case, smallest first, against pagedlib's float64 oracle (float32's tolerance, atol 1e-5 and rtol
1.3e-6; 1e-3 where the scores reach 300, whose float32 logits are themselves off by ~1e-5): block sizes 1
to 16, GQA groups 1 to 8 (3 included) and MQA, head_dim 8 to 24, a strided K with V laid out apart (its
own strides); that query head h reads KV head h // group (query head 13 of 16 reads KV head 3 of 4), keys
and values; lengths that are not a multiple of the block size or of the tile; NaN or 1e4 past each length
and unused table entries naming blocks full of garbage; scores that rise tile after tile (a missing
rescale) and up to 300 (no overflow); scores that fall from 300 to 0 (a max that follows each tile down
overflows) and scores all between -400 and -300 (a max that starts at 0, not -inf, underflows to 0 / 0);
and that every load and store stays inside its tensor: the grader watches each address whose mask is
true, and one outside the tensors the kernel was given fails, saying whether a load or a store, which
tensor and by how many elements, before it is read or written.
"""

import pagedlib  # noqa: F401, I001  (before triton: without CUDA it selects Triton's interpreter)
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * LOG2E)


@triton.jit
def decode_kernel(
    q_ptr,  # float32 [batch, q_heads, head_dim]: each sequence's newest query
    k_ptr, v_ptr,  # float32 [num_blocks, block_size, kv_heads, head_dim]: the key and value pools
    table_ptr,  # int32 [batch, max_blocks]: block tables, -1 (or any id) past each sequence's last block
    lens_ptr,  # int32 [batch]: seq_len of each sequence, >= 1
    out_ptr,  # float32 [batch, q_heads, head_dim]: write every query head's output here
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,  # q's strides for sequence and head (its last dimension's stride is 1, as all are)
    stride_kb, stride_ks, stride_kh,  # k_ptr's strides for block, slot, KV head
    stride_vb, stride_vs, stride_vh,  # v_ptr's, the same
    stride_tb,  # the block table's row stride
    stride_ob, stride_oh,  # out's strides for sequence and head
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,  # query heads per KV head; rounded up to a power of two
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,  # head_dim; rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # positions per loop step
):
    # program (seq, kv_head): tl.program_id(0) is the sequence, tl.program_id(1) the KV head
    raise NotImplementedError


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """One decode step of one layer with ``decode_kernel``: notebook 04's ``paged_attention`` arguments and
    result. ``q`` [batch, q_heads, head_dim]; ``k_cache``, ``v_cache`` [num_blocks, block_size, kv_heads,
    head_dim] (strided views allowed, last dimension contiguous); ``block_tables`` int32 [batch, max_blocks];
    ``seq_lens`` int32 [batch], each >= 1; ``scale`` default head_dim ** -0.5. All float32. Returns [batch,
    q_heads, head_dim]. Written for you: the lesson is the kernel."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = q_heads // kv_heads
    if scale is None:
        scale = head_dim**-0.5
    assert q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == block_tables.stride(1) == 1
    out = torch.empty_like(q)
    decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, TILE=16)
    return out
