"""A fused Triton paged-attention decode kernel (notebook 05).

``paged_attention_triton`` takes exactly the arguments of ``pagedlib.kernels.attention.paged_attention`` and
returns the same result, but never builds a contiguous copy of the keys and values: each program walks
its sequence's block table itself and streams K/V straight out of the paged pool.

The file reads top to bottom: the decode kernel, the merge kernel, the launch configuration
(``kernel_config``, ``choose_num_splits``), the launcher ``launch_decode`` and the checked wrapper
``paged_attention_triton``. Design, in one paragraph per piece:

- **Grid.** One program per (sequence, KV head, split). The program handles every query head of its GQA
  group at once (a ``[GROUP_P, HEAD_DIM_P]`` tile of queries), so each K/V element is read from memory
  exactly once, however many query heads share it.
- **Table walk.** The context is processed in tiles of ``TILE`` tokens. For every token of a tile the
  kernel looks up its physical block in the block table (``pos // BLOCK_SIZE``) and its slot inside that
  block (``pos % BLOCK_SIZE``); this handles block sizes smaller and larger than the tile alike.
- **Masking.** Every load is masked at the sequence length (and at ``head_dim`` when it is not a power of
  two), so whatever sits in unused slots, NaN included, never reaches the result.
- **Online softmax.** A running max ``m``, running sum ``l`` and unnormalised output ``acc`` are kept in
  fp32 and rescaled as each tile arrives; the exponentials are base 2 with ``log2(e)`` folded into the
  scale.
- **Split-K.** For long contexts and few (sequence, KV head) pairs, the context is cut into ``num_splits``
  partitions that run as separate programs; each writes its partial ``(m, l, acc)`` and a second kernel
  merges them with a log-sum-exp weighting.

On a machine without CUDA the kernels run through Triton's interpreter; ``pagedlib.kernels.triton_mode`` holds
that switch and the tooling that compiles the kernels for a GPU target without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedlib.checks import as_int
from pagedlib.kernels.attention import check_paged_inputs, softmax_scale
from pagedlib.kernels.triton_mode import check_mode, interpreter_lock, interpreting

__all__ = ["MAX_BLOCK_SIZE", "MAX_HEAD_DIM", "MAX_SPLITS", "choose_num_splits", "kernel_config",
           "launch_decode", "paged_attention_triton", "sm_count"]

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e))
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 128
MAX_SPLITS = 64


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr,  # inputs
    out_ptr, m_ptr, l_ptr,  # output [B, H, D], or partial acc [B, H, S, D] and partial m, l [B, H, S]
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_ob, stride_oh, stride_os, stride_od,
    tokens_per_split,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_P: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,  # tokens processed per loop step (>= 16: the K dimension of the second dot)
    SPLIT: tl.constexpr,  # write partial (m, l, acc) for the merge kernel instead of the final output
    DOT_FP32: tl.constexpr,  # upcast dot operands to fp32 (the interpreter multiplies bf16 bits wrongly)
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" for fp32 inputs (no TF32 rounding)
):
    # --- grid: which sequence, which KV head (= which GQA group of query heads), which split -----------
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    # --- the GQA group: query heads kv_head*GROUP ... kv_head*GROUP + GROUP-1, all in one tile --------
    rows = tl.arange(0, GROUP_P)
    dims = tl.arange(0, HEAD_DIM_P)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q_offs = seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [GROUP_P, HEAD_DIM_P]
    if DOT_FP32:
        q = q.to(tl.float32)

    # --- online-softmax state, fp32 -------------------------------------------------------------------
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([GROUP_P], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)  # running sum of exp2(score - m_i) * v

    # --- table walk: TILE tokens per step, each token finds its block and slot --------------------------
    offs = tl.arange(0, TILE)
    for tile_start in range(start, end, TILE):
        pos = tile_start + offs  # [TILE] logical positions in the sequence
        valid = pos < end  # masks the ragged last tile (and everything past seq_len)
        block = tl.load(table_ptr + seq * stride_tb + (pos // BLOCK_SIZE) * stride_tn, mask=valid, other=0)
        slot = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_ok[None, :]
        base = block.to(tl.int64)[:, None]  # int64: offsets into a multi-GiB pool overflow int32
        k_rows = base * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh  # [TILE, 1]
        v_rows = base * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        k = tl.load(k_ptr + k_rows + dims[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [TILE, HEAD_DIM_P]
        v = tl.load(v_ptr + v_rows + dims[None, :] * stride_vd, mask=kv_mask, other=0.0)  # [TILE, HEAD_DIM_P]
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [GROUP_P, TILE], base-2 logits
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds at least one valid token
        alpha = tl.exp2(m_i - m_new)  # how much the old state shrinks (0 on the first tile)
        p = tl.exp2(s - m_new[:, None])  # [GROUP_P, TILE], 0 at masked tokens
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # --- write: the final output, or this split's partial state for the merge kernel -------------------
    o_offs = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :] * stride_od
    o_mask = row_ok[:, None] & dim_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + o_offs, acc, mask=o_mask)
        ml_offs = (seq * (tl.num_programs(1) * GROUP) + heads) * tl.num_programs(2) + split
        tl.store(m_ptr + ml_offs, m_i, mask=row_ok)  # -inf for a split past the sequence's end
        tl.store(l_ptr + ml_offs, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_splits_kernel(
    part_ptr, m_ptr, l_ptr, out_ptr,  # partial acc [B, H, S, D], partial m, l [B, H, S], out [B, H, D]
    num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
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
    m_max = tl.max(m, 0)  # finite: split 0 always holds token 0
    w = tl.exp2(m - m_max)  # each split's weight; 0 for empty splits
    p_offs = seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :] * stride_pd
    acc = tl.load(part_ptr + p_offs, mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # [SPLITS_P, D_P]
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * lsum, 0)  # [HEAD_DIM_P]
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


# ---------------------------------------------------------------------------------------------------
# launch configuration


def kernel_config(head_dim: int, group: int) -> dict[str, int]:
    """Compile-time sizes for one call: padded tile shapes and the tokens per loop step.

    ``TILE`` tokens per step keeps a K tile at 8 KiB (fp16, head_dim 128); it must be >= 16 because it is
    the reduction dimension of ``p @ v`` on tensor cores.
    """
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    return {
        "GROUP": group,
        "GROUP_P": triton.next_power_of_2(group),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_P": head_dim_p,
        "TILE": 32 if head_dim_p <= 128 else 16,
    }


def choose_num_splits(batch: int, kv_heads: int, max_context: int, sm_count: int, *,
                      min_tokens_per_split: int = 256, max_splits: int = MAX_SPLITS) -> int:
    """How many partitions to cut each sequence's context into (split-K / flash-decoding).

    Without splitting there are ``batch * kv_heads`` programs; when that is far below the number of
    SMs most of the GPU idles. Split until about two waves of programs cover the SMs, but keep every
    split at least ``min_tokens_per_split`` tokens long (shorter ones cost more to merge than they save)
    and at most ``max_splits``.
    """
    batch, kv_heads, max_context, sm_count = (as_int(name, value, minimum=1) for name, value in (
        ("batch", batch), ("kv_heads", kv_heads), ("max_context", max_context), ("sm_count", sm_count)))
    programs = batch * kv_heads
    wanted = math.ceil(2 * sm_count / programs)
    longest = max(1, max_context // min_tokens_per_split)
    return max(1, min(wanted, longest, max_splits))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 1 elsewhere (the interpreter runs programs one
    after another, so splitting only adds work)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


# ---------------------------------------------------------------------------------------------------
# the launcher and the checked wrapper


def launch_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float | None, num_splits: int, *,
                  dot_fp32: bool | None = None) -> torch.Tensor:
    """Launch the kernel(s) on already validated inputs (``paged_attention_triton`` checks them).

    No host synchronisation, so a GPU benchmark can capture it in a CUDA graph. ``dot_fp32`` overrides
    the upcast of dot operands (default: only in the interpreter); a test runs the GPU's fp16 arithmetic
    through the interpreter with ``dot_fp32=False``. Interpreted launches hold ``interpreter_lock``.
    """
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    cfg = kernel_config(head_dim, q_heads // kv_heads)
    # splits divide the tables' capacity, not the actual lengths (reading seq_lens would synchronise with
    # the host): a split that starts past its sequence's end finds no tokens and writes an empty state
    max_context = block_tables.shape[1] * block_size
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), cfg["TILE"]) * cfg["TILE"]
    dot_fp32 = interpreting() if dot_fp32 is None else dot_fp32
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    seq_lens = seq_lens.contiguous()  # the kernel reads lens_ptr + seq: a strided view would misread
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    split = num_splits > 1
    if split:
        partial = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        dst, dst_strides = partial, partial.stride()
    else:
        m = lsum = out  # unused when SPLIT is off
        dst, dst_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2))
    with interpreter_lock():
        _paged_decode_kernel[(batch, kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, seq_lens, dst, m, lsum,
            softmax_scale(head_dim, scale) * LOG2E,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *dst_strides,
            tokens_per_split,
            BLOCK_SIZE=block_size, SPLIT=split, DOT_FP32=dot_fp32, PRECISION=precision, **cfg, num_warps=4,
        )
        if split:
            _merge_splits_kernel[(batch, q_heads)](
                partial, m, lsum, out, num_splits, *partial.stride(), *out.stride(),
                HEAD_DIM=head_dim, HEAD_DIM_P=cfg["HEAD_DIM_P"], SPLITS_P=triton.next_power_of_2(num_splits),
                num_warps=4,
            )
    return out


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One decode step of attention, reading K/V straight from the paged pool: ``paged_attention``'s
    arguments and result (``q`` ``[batch, q_heads, head_dim]`` in, the same shape and dtype out), plus
    ``num_splits``, the partitions of the context (split-K; ``None`` lets ``choose_num_splits`` decide).

    Every argument is checked (as by ``paged_attention``, plus the kernel's limits) before anything is
    launched; inputs are only read. The kernel has no backward pass, so inputs that require grad are
    refused while autograd is recording. Threads may call it at once: compiled launches are independent,
    and interpreted ones (no CUDA) are serialised by a lock. No thread may write the cache meanwhile.
    """
    check_mode()
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    scale = softmax_scale(head_dim, scale)
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be at most {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
    if block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"k_cache's block_size must be a power of two from 1 to {MAX_BLOCK_SIZE}, "
                         f"got {block_size}")
    if num_splits is not None:
        num_splits = as_int("num_splits", num_splits, minimum=1, maximum=MAX_SPLITS)
    if not interpreting() and q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor for the compiled kernel, got device {q.device}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise ValueError("q, k_cache and v_cache must not require grad: the Triton kernel has no backward "
                         "pass (call it under torch.no_grad(), or pass detached tensors)")
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], max_context, sm_count(q.device))
    return launch_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
