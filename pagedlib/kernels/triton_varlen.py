"""The unified paged attention kernel in Triton (notebook 09): ``paged_attention_varlen_triton`` takes
``paged_attention_varlen``'s arguments and returns its result, decodes and prefill chunks in one launch.

One program per (query block of ``BLOCK_Q`` tokens of one sequence, KV head) finds its sequence by binary
search (``_find_sequence``) and walks the block table with the decode kernel's own loop (``_attend_tiles``,
through its ``_kv_tile``), its causal mask on: each of the ``BLOCK_Q * GROUP_P`` query rows is masked at its
own position. With a sliding window, a program's walk starts at the first key its first token's window
reaches (blocks before it are never read; ``NULL_BLOCK`` entries there are never loaded), and each row is
masked at its own window's start too."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedlib.kernels._checks import check_scales, check_triton, check_varlen_inputs, check_window_size
from pagedlib.kernels.attention import softmax_scale
from pagedlib.kernels.triton_decode import LOG2E, _attend_tiles, kernel_config, launch_options, scale_vector
from pagedlib.kernels.triton_mode import check_mode, interpreter_lock, interpreting


@triton.jit
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, qsl_ptr, out_ptr,  # q, out [T, H, D]; qsl [batch + 1]
    k_scale_ptr, v_scale_ptr,  # float32 [kv_heads]: an fp8 cache's scales (read if SCALED)
    qk_scale, num_seqs, window,  # softmax scale * log2(e); batch; sliding window (read if WINDOWED)
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn, stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,  # query heads per KV head; rounded up to a power of two
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,  # head_dim; rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # keys per loop step
    BLOCK_Q: tl.constexpr,  # query tokens per program (1: every token is its own query block)
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the interpreter multiplies bf16 bits wrongly)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32 rounding)
    SCALED: tl.constexpr = False,  # K/V are fp8: multiply by the scales after loading
    WINDOWED: tl.constexpr = False,  # a sliding window: a row at p sees keys p - window < k <= p only
):
    # grid: which query block of the flat batch, which KV head; first, whose tokens the block holds
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = (q_block - _first_block(q_start, seq, BLOCK_Q)) * BLOCK_Q  # its first token among the new ones
    if local >= q_len:  # a spare block: the grid gives a sequence up to one more than its tokens need
        return
    seq_len = tl.load(lens_ptr + seq)
    context = seq_len - q_len  # tokens before the new ones (earlier chunks, a cached prefix)

    # rows: BLOCK_Q tokens x the GQA group's GROUP_P heads, one [BLOCK_Q * GROUP_P, HEAD_DIM_P] tile
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    dims = tl.arange(0, HEAD_DIM_P)
    tok = local + rows // GROUP_P  # [rows] each row's token among the sequence's new ones
    heads = kv_head * GROUP + rows % GROUP_P  # [rows] and its query head
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)  # False on padding rows
    dim_ok = dims < HEAD_DIM  # False on the padding columns past head_dim
    q_offs = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = context + tok  # [rows] each row's position: it sees keys 0..q_pos (>= 0: never an empty row)

    # online softmax over the keys the block's last token sees, in fp32, each row masked at its position
    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM_P], tl.float32)
    end = tl.minimum(seq_len, context + local + BLOCK_Q)
    k_cols = k_ptr + kv_head * stride_kh + dims[None, :] * stride_kd  # [1, HEAD_DIM_P]: this head, slot 0
    v_cols = v_ptr + kv_head * stride_vh + dims[None, :] * stride_vd
    k_scale = tl.load(k_scale_ptr + kv_head)  # used if SCALED
    v_scale = tl.load(v_scale_ptr + kv_head)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, qk_scale,  # state; queries
                                  0, end, window, table_ptr + seq * stride_tb, stride_tn,  # keys; table
                                  k_cols, stride_kb, stride_ks, v_cols, stride_vb, stride_vs,  # K; V
                                  dim_ok, k_scale, v_scale, BLOCK_SIZE, TILE, DOT_FP32, PRECISION, SCALED,
                                  CAUSAL=True, WINDOWED=WINDOWED)
    l_i = tl.where(row_ok, l_i, 1.0) if WINDOWED else l_i  # a padding row may have seen no key: not 0 / 0
    o_offs = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _first_block(q_start, seq, BLOCK_Q: tl.constexpr):
    # sequence seq's first query block: its first token's block plus one spare per earlier sequence
    # (BLOCK_Q = 1: one block per token, no spares)
    first = q_start
    if BLOCK_Q > 1:
        first = q_start // BLOCK_Q + seq
    return first


@triton.jit
def _find_sequence(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    # binary search: the last sequence whose first query block is <= q_block. Sequence b's blocks start
    # at qsl[b] // BLOCK_Q + b: one spare per sequence, so the grid needs no host read of the lengths
    lo: tl.int32 = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid)
        if _first_block(start, mid, BLOCK_Q) <= q_block:
            lo = mid
        else:
            hi = mid
    return lo


def varlen_config(head_dim: int, group: int, decode: bool) -> dict[str, int]:
    """The decode kernel's compile-time sizes, plus ``BLOCK_Q`` query tokens per program: 1 for a decode
    step (one program per token, as the decode kernel), else about 64 rows (32 at head_dim 256)."""
    cfg = kernel_config(head_dim, group)
    if decode:
        return {**cfg, "BLOCK_Q": 1}
    rows = 64
    if cfg["HEAD_DIM_P"] > 128:
        rows = 32
    return {**cfg, "BLOCK_Q": max(1, rows // cfg["GROUP_P"])}


def launch_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float | None, *,
                  dot_fp32: bool | None = None, k_scale: float | torch.Tensor = 1.0,
                  v_scale: float | torch.Tensor = 1.0, window: int | None = None) -> torch.Tensor:
    """Launch the kernel on checked inputs, without a host synchronisation (the grid comes from shapes).
    ``scale``: the softmax scale (``None``: ``head_dim ** -0.5``); ``dot_fp32``: see ``launch_options``; the
    fp8 scales: as ``check_scales`` returns them; ``window``: checked, or ``None``."""
    T, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    batch = seq_lens.shape[0]
    if scale is None:
        scale = head_dim**-0.5
    # T == batch: one token per sequence (each has >= 1), a decode step
    cfg = varlen_config(head_dim, q_heads // kv_heads, decode=T == batch)
    q_blocks = T  # BLOCK_Q = 1: one program per token
    if cfg["BLOCK_Q"] > 1:
        q_blocks = T // cfg["BLOCK_Q"] + batch  # up to one spare per sequence (_first_block)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                # [T, q_heads, D]
    k_scales = scale_vector(k_scale, kv_heads, q.device)                       # float32 [kv_heads]
    v_scales = scale_vector(v_scale, kv_heads, q.device)
    with interpreter_lock():
        _varlen_kernel[(q_blocks, kv_heads)](
            q, k_cache, v_cache, block_tables, seq_lens.contiguous(), query_start_loc.contiguous(), out,
            k_scales, v_scales, scale * LOG2E, batch, window or 0, *q.stride(), *k_cache.stride(),
            *v_cache.stride(), *block_tables.stride(), *out.stride(), **launch_options(q, k_cache, dot_fp32),
            **cfg, WINDOWED=window is not None, num_warps=4)
    return out


def paged_attention_varlen_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, scale: float | None = None, *,
                                  k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                                  window: int | None = None) -> torch.Tensor:
    """``paged_attention_varlen`` with K/V read straight from the paged pool by one fused kernel, every
    argument checked first (no backward pass: inputs that require grad are refused while autograd records);
    ``window``: a sliding window, as ``paged_attention_varlen`` takes it."""
    check_mode()
    window = check_window_size(window)
    check_varlen_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, window)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    scale = softmax_scale(q.shape[-1], scale)
    check_triton(q, k_cache, v_cache, None, compiled=not interpreting())
    return launch_varlen(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale=k_scale,
                         v_scale=v_scale, window=window)
