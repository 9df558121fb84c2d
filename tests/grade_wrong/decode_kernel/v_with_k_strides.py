"""Catches: equals the float64 oracle on a few cases, smallest first (GQA groups 1-8, MQA, a strided cache)

Addresses V with K's strides (a copy-paste slip): right whenever V is laid out like K, wrong when V has
its own strides."""

import pagedlib  # noqa: F401, I001  (before triton: without CUDA it selects Triton's interpreter)
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, qk_scale,
                  stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  stride_tb, stride_ob, stride_oh,
                  GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    n = tl.load(lens_ptr + seq)
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM_P)
    heads = kv_head * GROUP + rows
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    for start in range(0, n, TILE):
        pos = start + tl.arange(0, TILE)
        valid = pos < n
        block = tl.load(table_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k_rows = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        v_rows = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)   # [TILE, HEAD_DIM_P]
        v = tl.load(v_ptr + v_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * qk_scale                      # [GROUP_P, TILE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out, mask=q_mask)


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
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
