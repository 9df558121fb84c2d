"""The unified paged attention kernel in Triton (notebook 09): ``paged_attention_varlen_triton`` takes
``paged_attention_varlen``'s arguments and returns its result, decodes and prefill chunks in one launch.

One program per (query block of ``BLOCK_Q`` tokens of one sequence, KV head) finds its sequence by binary
search (``_find_sequence``) and walks the block table as the decode kernel does (``_varlen_tiles``, through
its ``_kv_tile``), each of its ``BLOCK_Q * GROUP_P`` query rows masked at its own position (causal)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlib.kernels._checks import check_scales, check_triton, check_varlen_inputs
from pagedlib.kernels.attention import softmax_scale
from pagedlib.kernels.triton_decode import LOG2E, _kv_tile, kernel_config
from pagedlib.kernels.triton_mode import check_mode, interpreter_lock, interpreting


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, qsl_ptr, out_ptr,  # q, out [T, H, D]; qsl [batch + 1]
    k_scale_ptr, v_scale_ptr,  # float32 [kv_heads]: an fp8 cache's scales (read if SCALED)
    qk_scale, num_seqs,  # softmax scale * log2(e); batch
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,  # query heads per KV head; rounded up to a power of two
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,  # head_dim; rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # keys per loop step
    BLOCK_Q: tl.constexpr,  # query tokens per program (1: every token is its own query block)
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the interpreter multiplies bf16 bits wrongly)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32 rounding)
    SCALED: tl.constexpr = False,  # K/V are fp8: multiply by the scales after loading
):
    # grid: which query block of the flat batch, which KV head; first, whose tokens the block holds
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    seq = _find_sequence(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    first = (q_start // BLOCK_Q + seq) if BLOCK_Q > 1 else q_start  # the sequence's first query block
    local = (q_block - first) * BLOCK_Q  # this block's first token, counted among the sequence's new ones
    if local >= q_len:  # a spare block: the grid gives a sequence up to one more than its tokens need
        return
    seq_len = tl.load(lens_ptr + seq)
    context = seq_len - q_len  # tokens before the new ones (earlier chunks, a cached prefix)

    # rows: BLOCK_Q tokens x the GQA group's GROUP_P heads, one [BLOCK_Q * GROUP_P, HEAD_DIM_P] tile
    rows, dims = tl.arange(0, BLOCK_Q * GROUP_P), tl.arange(0, HEAD_DIM_P)
    tok, heads = local + rows // GROUP_P, kv_head * GROUP + rows % GROUP_P
    row_ok, dim_ok = (tok < q_len) & (rows % GROUP_P < GROUP), dims < HEAD_DIM
    q_offs = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = context + tok  # [rows] each row's position: it sees keys 0..q_pos (>= 0: never an empty row)

    # online softmax over the keys the block's last token sees, in fp32
    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    end = tl.minimum(seq_len, context + local + BLOCK_Q)
    k_cols = k_ptr + kv_head * stride_kh + dims[None, :] * stride_kd  # [1, HEAD_DIM_P]: this head, slot 0
    v_cols = v_ptr + kv_head * stride_vh + dims[None, :] * stride_vd
    k_scale, v_scale = tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)  # used if SCALED
    acc, l_i = _varlen_tiles(acc, l_i, m_i, q, q_pos, qk_scale, end, table_ptr + seq * stride_tb, stride_tn,
                             k_cols, stride_kb, stride_ks, v_cols, stride_vb, stride_vs, dim_ok, k_scale,
                             v_scale, BLOCK_SIZE, TILE, DOT_FP32, PRECISION, SCALED)

    o_offs = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _varlen_tiles(acc, l_i, m_i, q, q_pos, qk_scale, end, table_ptr, stride_tn, k_cols, stride_kb, stride_ks,
                  v_cols, stride_vb, stride_vs, dim_ok, k_scale, v_scale, BLOCK_SIZE: tl.constexpr,
                  TILE: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
    # the inner loop: keys 0..end-1 in tiles of TILE, each row masked past its own position
    for tile_start in range(0, end, TILE):
        pos = tile_start + tl.arange(0, TILE)  # [TILE] key positions in the sequence
        valid = pos < end  # masks the ragged last tile: slots past it are never read
        k, v = _kv_tile(table_ptr, stride_tn, k_cols, stride_kb, stride_ks, v_cols, stride_vb, stride_vs,
                        pos, valid, dim_ok, BLOCK_SIZE)  # [TILE, HEAD_DIM_P] each
        if SCALED:  # fp8 -> fp32, times the scale, in registers; then q's dtype for the dots
            k, v = (k.to(tl.float32) * k_scale).to(q.dtype), (v.to(tl.float32) * v_scale).to(q.dtype)
        if DOT_FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [rows, TILE], base-2 logits
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))  # causal
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees key 0 in the first tile
        alpha = tl.exp2(m_i - m_new)  # how much the old state shrinks (0 on the first tile)
        p = tl.exp2(s - m_new[:, None])  # [rows, TILE], 0 at masked keys
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i


@triton.jit
def _find_sequence(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # binary search: the last sequence whose first query block is <= q_block. Sequence b's blocks start
    # at qsl[b] // BLOCK_Q + b: one spare per sequence, so the grid needs no host read of the lengths
    lo: tl.int32 = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid)
        first = (start // BLOCK_Q + mid) if BLOCK_Q > 1 else start
        if first <= q_block:
            lo = mid
        else:
            hi = mid
    return lo


def varlen_config(head_dim: int, group: int, decode: bool) -> dict[str, int]:
    """The decode kernel's compile-time sizes, plus ``BLOCK_Q`` query tokens per program: 1 for a decode
    step (one program per token, as the decode kernel), else about 64 rows (32 at head_dim 256)."""
    cfg = kernel_config(head_dim, group)
    rows = 64 if cfg["HEAD_DIM_P"] <= 128 else 32
    return {**cfg, "BLOCK_Q": 1 if decode else max(1, rows // cfg["GROUP_P"])}


def launch_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None, *,
                  dot_fp32: bool | None = None, k_scale: float | torch.Tensor = 1.0,
                  v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Launch the kernel on checked inputs, without a host synchronisation (the grid comes from shapes).
    ``dot_fp32``: upcast dot operands (default: only in the interpreter); the scales: as ``check_scales``
    returns them."""
    (T, q_heads, head_dim), (_, block_size, kv_heads, _), batch = q.shape, k_cache.shape, seq_lens.shape[0]
    # T == batch: one token per sequence (each has >= 1), a decode step
    cfg = varlen_config(head_dim, q_heads // kv_heads, decode=T == batch)
    grid = (T if cfg["BLOCK_Q"] == 1 else T // cfg["BLOCK_Q"] + batch, kv_heads)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    scales = [s if isinstance(s, torch.Tensor) else torch.full((kv_heads,), s, device=q.device)
              for s in (k_scale, v_scale)]  # float32 [kv_heads]: a fill, not a copy from the host
    with interpreter_lock():
        _varlen_kernel[grid](
            q, k_cache, v_cache, block_tables, seq_lens.contiguous(), query_start_loc.contiguous(), out,
            *scales, softmax_scale(head_dim, scale) * LOG2E, batch, *q.stride(), *k_cache.stride(),
            *v_cache.stride(), *block_tables.stride(), *out.stride(), BLOCK_SIZE=block_size,
            DOT_FP32=interpreting() if dot_fp32 is None else dot_fp32,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SCALED=k_cache.dtype != q.dtype, **cfg,
            num_warps=4)
    return out


def paged_attention_varlen_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float | None = None, *,
                                  k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0
                                  ) -> torch.Tensor:
    """``paged_attention_varlen`` with K/V read straight from the paged pool by one fused kernel, every
    argument checked first (no backward pass: inputs that require grad are refused while autograd records)."""
    check_mode()
    check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    check_triton(q, k_cache, v_cache, None, compiled=not interpreting())
    return launch_varlen(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                         softmax_scale(q.shape[-1], scale), k_scale=k_scale, v_scale=v_scale)
