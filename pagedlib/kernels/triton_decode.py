"""A fused Triton paged-attention decode kernel (notebook 05): ``paged_attention_triton`` takes
``paged_attention``'s arguments and returns its result without a contiguous copy of K/V. One program per
(sequence, KV head, split) walks its block table a tile of tokens at a time (``_kv_tile``) with an online
softmax in fp32 (``_attend_tiles``, shared with the varlen kernel, which turns its causal mask on); with
split-K, ``_merge_splits_kernel`` combines their partial states by log-sum-exp. Every load is masked at the
sequence length: slots that hold no token are never read."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedlib.kernels._checks import MAX_HEAD_DIM as MAX_HEAD_DIM  # re-exported: checks.py reads it
from pagedlib.kernels._checks import MAX_SPLITS, check_scales, check_triton
from pagedlib.kernels.attention import check_paged_inputs, softmax_scale
from pagedlib.kernels.triton_mode import check_mode, interpreter_lock, interpreting
from pagedlib.util import as_int

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e))


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr,  # inputs
    k_scale_ptr, v_scale_ptr,  # float32 [kv_heads]: an fp8 cache's scales (read if SCALED)
    out_ptr, m_ptr, l_ptr,  # output [B, H, D], or partial acc [B, H, S, D] and partial m, l [B, H, S]
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_os, stride_od,
    tokens_per_split,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,  # query heads per KV head; rounded up to a power of two
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,  # head_dim; rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # tokens per loop step (>= 16: the K dimension of the second dot)
    SPLIT: tl.constexpr,  # write partial (m, l, acc) for the merge kernel instead of the final output
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the interpreter multiplies bf16 bits wrongly)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32 rounding)
    SCALED: tl.constexpr = False,  # K/V are fp8: multiply by the scales after loading
):
    # grid: which sequence, which KV head (= which GQA group of query heads), which split of the context
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, tl.load(lens_ptr + seq))

    # the GQA group: query heads kv_head*GROUP ... kv_head*GROUP + GROUP-1, one [GROUP_P, HEAD_DIM_P] tile
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM_P)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP  # False on the padding rows past the group
    dim_ok = dims < HEAD_DIM  # False on the padding columns past head_dim
    q_offs = seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # online softmax over the tiles, in fp32: running max m_i, running sum l_i, weighted sum of V acc
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    k_cols = k_ptr + kv_head * stride_kh + dims[None, :] * stride_kd  # [1, HEAD_DIM_P]: this head, slot 0
    v_cols = v_ptr + kv_head * stride_vh + dims[None, :] * stride_vd
    k_scale = tl.load(k_scale_ptr + kv_head)  # used if SCALED
    v_scale = tl.load(v_scale_ptr + kv_head)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, 0, qk_scale,  # state; queries (q_pos 0: not read)
                                  start, end, 0, table_ptr + seq * stride_tb, stride_tn,  # keys; table
                                  k_cols, stride_kb, stride_ks, v_cols, stride_vb, stride_vs,  # K; V
                                  dim_ok, k_scale, v_scale, BLOCK_SIZE, TILE, DOT_FP32, PRECISION, SCALED,
                                  CAUSAL=False, WINDOWED=False)
    # write: the final output, or this split's partial state for the merge kernel
    o_offs = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :] * stride_od
    o_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + o_offs, acc, mask=o_mask)
        ml_offs = (seq * (tl.num_programs(1) * GROUP) + heads) * tl.num_programs(2) + split
        tl.store(m_ptr + ml_offs, m_i, mask=row_ok)  # -inf for a split past the sequence's end
        tl.store(l_ptr + ml_offs, l_i, mask=row_ok)
    else:
        tl.store(out_ptr + o_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _attend_tiles(
    acc, l_i, m_i,  # the online-softmax state of q's rows: weighted sum of V, running sum, running max
    q, q_pos, qk_scale,  # [rows, HEAD_DIM_P] queries, their positions (read if CAUSAL), scale * log2(e)
    start, end, window,  # the keys to fold in: positions start .. end - 1; a sliding window (if WINDOWED)
    table_ptr, stride_tn,  # the sequence's block table
    k_cols, stride_kb, stride_ks,  # K of this KV head ([1, HEAD_DIM_P] pointers at slot 0), block, slot
    v_cols, stride_vb, stride_vs,  # V, the same
    dim_ok, k_scale, v_scale,  # [HEAD_DIM_P] False past head_dim; an fp8 cache's scales (if SCALED)
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,  # tokens per cache block; keys per loop step
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr,  # as the kernels' own
    CAUSAL: tl.constexpr,  # row r sees keys up to q_pos[r] (the varlen kernel); else every key (decode)
    WINDOWED: tl.constexpr,  # (CAUSAL) and only keys after q_pos[r] - window: from the first row's on
):
    # the inner loop both kernels share, whatever their grid: one program's rows (a GQA group of one token
    # for decode; BLOCK_Q tokens x the group for varlen) fold the keys in, a tile of TILE at a time
    if DOT_FP32:
        q = q.to(tl.float32)
    # no row sees a key before the first row's window: the walk starts there. A conditional expression on
    # a constexpr picks one branch when the kernel compiles; an `if` block could not turn `start` from a
    # constant 0 into an int32 (the compiler refuses a variable whose type a branch changes)
    start = tl.maximum(start, tl.min(q_pos, 0) - window + 1) if WINDOWED else start
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)  # [TILE] key positions in the sequence
        valid = pos < end  # masks the ragged last tile (and everything past seq_len)
        k, v = _kv_tile(table_ptr, stride_tn, k_cols, stride_kb, stride_ks, v_cols, stride_vb, stride_vs,
                        pos, valid, dim_ok, BLOCK_SIZE)  # [TILE, HEAD_DIM_P] each
        if SCALED:  # fp8 -> fp32, times the scale, in registers; then q's dtype for the dots
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [rows, TILE], base-2 logits
        seen = valid[None, :]  # [1, TILE]
        if CAUSAL:
            seen = seen & (pos[None, :] <= q_pos[:, None])  # [rows, TILE]
        if WINDOWED:
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every row sees a key of the first tile...
        m_sub = m_new  # the max subtracted below
        if WINDOWED:  # ...unless its window starts in a later tile: m stays -inf till then, subtracted as 0
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)  # how much the old state shrinks (0 on the first tile)
        p = tl.exp2(s - m_sub[:, None])  # [rows, TILE], 0 at masked keys
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _kv_tile(table_ptr, stride_tn, k_cols, stride_kb, stride_ks, v_cols, stride_vb, stride_vs, pos, valid,
             dim_ok, BLOCK_SIZE: tl.constexpr):
    # the table walk: position pos lives in block table[pos // BLOCK_SIZE], at slot pos % BLOCK_SIZE
    block = tl.load(table_ptr + (pos // BLOCK_SIZE) * stride_tn, mask=valid, other=0).to(tl.int64)  # [TILE]
    slot = pos % BLOCK_SIZE  # (block ids in int64: offsets into a multi-GiB pool overflow int32)
    mask = valid[:, None] & dim_ok[None, :]  # a masked load reads nothing: unused slots are never touched
    k = tl.load(k_cols + (block * stride_kb + slot * stride_ks)[:, None], mask=mask, other=0.0)
    v = tl.load(v_cols + (block * stride_vb + slot * stride_vs)[:, None], mask=mask, other=0.0)
    return k, v


@triton.jit
def _merge_splits_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr,  # partial acc [B, H, S, D], partial m, l [B, H, S], out [B, H, D]
    num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,  # num_splits rounded up to a power of two
):
    # one program per (sequence, query head): combine the splits' partial softmax states
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P)
    dims = tl.arange(0, HEAD_DIM_P)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM
    ml_offs = (seq * tl.num_programs(1) + head) * num_splits + splits
    m = tl.load(m_ptr + ml_offs, mask=split_ok, other=float("-inf"))  # [SPLITS_P]
    lsum = tl.load(l_ptr + ml_offs, mask=split_ok, other=0.0)  # [SPLITS_P]
    w = tl.exp2(m - tl.max(m, 0))  # each split's weight, 0 if empty (max finite: split 0 holds token 0)
    p_offs = seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :] * stride_pd
    acc = tl.load(part_ptr + p_offs, mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # [SPLITS_P, D_P]
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * lsum, 0)  # [HEAD_DIM_P]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def kernel_config(head_dim: int, group: int) -> dict[str, int]:
    """Compile-time sizes: padded tile shapes, and ``TILE`` tokens per loop step (a K tile of 8 KiB in
    fp16 at head_dim 128; at least 16, the reduction dimension of ``p @ v`` on tensor cores)."""
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    tile = 32
    if head_dim_p > 128:
        tile = 16
    return {"GROUP": group, "GROUP_P": triton.next_power_of_2(group), "HEAD_DIM": head_dim,
            "HEAD_DIM_P": head_dim_p, "TILE": tile}


def choose_num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int, *,
                      min_tokens_per_split: int = 256, max_splits: int = MAX_SPLITS) -> int:
    """Partitions of each sequence's context (split-K / flash-decoding): enough for ``batch * kv_heads *
    splits`` programs to cover about two waves of SMs, no split under ``min_tokens_per_split`` tokens
    (shorter ones cost more to merge than they save), at most ``max_splits``."""
    batch = as_int("batch", batch, minimum=1)
    kv_heads = as_int("kv_heads", kv_heads, minimum=1)
    max_context = as_int("max_context", max_context, minimum=1)
    sm_count = as_int("sm_count", sm_count, minimum=1)
    wanted = math.ceil(2 * sm_count / (batch * kv_heads))
    return max(1, min(wanted, max_context // min_tokens_per_split, max_splits))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``, else 1 (the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_options(q: torch.Tensor, k_cache: torch.Tensor, dot_fp32: bool | None) -> dict[str, object]:
    """The compile-time options both kernels take from their inputs: ``BLOCK_SIZE``; ``SCALED`` for an fp8
    cache; ``DOT_FP32`` (upcast dot operands; default: only in the interpreter); ``PRECISION`` of ``tl.dot``
    ("ieee" for fp32 inputs: no TF32 rounding)."""
    options = {"BLOCK_SIZE": k_cache.shape[1], "SCALED": k_cache.dtype != q.dtype, "DOT_FP32": interpreting(),
               "PRECISION": "tf32"}
    if dot_fp32 is not None:
        options["DOT_FP32"] = dot_fp32
    if q.dtype == torch.float32:
        options["PRECISION"] = "ieee"
    return options


def scale_vector(scale: float | torch.Tensor, kv_heads: int, device: torch.device) -> torch.Tensor:
    """A checked fp8 scale as the kernels load it, float32 ``[kv_heads]`` (a float: a fill on the device,
    not a copy from the host)."""
    if isinstance(scale, torch.Tensor):
        return scale
    return torch.full((kv_heads,), scale, device=device)


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float | None, num_splits: int, *,
                  dot_fp32: bool | None = None, k_scale: float | torch.Tensor = 1.0,
                  v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Launch the kernel(s) on checked inputs, without a host synchronisation (a benchmark can capture it
    in a CUDA graph). ``scale``: the softmax scale (``None``: ``head_dim ** -0.5``); ``dot_fp32``: see
    ``launch_options``; the fp8 scales: as ``check_scales`` returns them."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    cfg = kernel_config(head_dim, q_heads // kv_heads)
    if scale is None:
        scale = head_dim**-0.5
    # splits divide the tables' capacity, not the lengths (reading seq_lens would synchronise with the
    # host): a split that starts past its sequence's end finds no tokens and writes an empty state
    per_split = triton.cdiv(block_tables.shape[1] * block_size, num_splits * cfg["TILE"]) * cfg["TILE"]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                # [batch, q_heads, D]
    dst = out[:, :, None]  # without split-K the kernel writes `out` and ignores m, l
    m = out
    lsum = out
    if num_splits > 1:
        dst = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
    k_scales = scale_vector(k_scale, kv_heads, q.device)                       # float32 [kv_heads]
    v_scales = scale_vector(v_scale, kv_heads, q.device)
    with interpreter_lock():
        _paged_decode_kernel[(batch, kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens.contiguous(), k_scales, v_scales, dst, m, lsum,
            scale * LOG2E, *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
            *dst.stride(), per_split, SPLIT=num_splits > 1, **launch_options(q, k_cache, dot_fp32), **cfg,
            num_warps=4)
        if num_splits > 1:
            _merge_splits_kernel[(batch, q_heads)](
                dst, m, lsum, out, num_splits, *dst.stride(), *out.stride(), HEAD_DIM=head_dim,
                HEAD_DIM_P=cfg["HEAD_DIM_P"], SPLITS_P=triton.next_power_of_2(num_splits), num_warps=4)
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None, *,
                           num_splits: int | None = None, k_scale: float | torch.Tensor = 1.0,
                           v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``paged_attention`` with K/V read straight from the paged pool by the fused kernel, every argument
    checked first (no backward pass: inputs that require grad are refused while autograd records);
    ``num_splits``: partitions of the context (split-K; ``None``: ``choose_num_splits``)."""
    check_mode()
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    scale = softmax_scale(q.shape[-1], scale)
    num_splits = check_triton(q, k_cache, v_cache, num_splits, compiled=not interpreting())
    if num_splits is None:
        max_context = block_tables.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], max_context, sm_count(q.device))
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, k_scale=k_scale,
                         v_scale=v_scale)
