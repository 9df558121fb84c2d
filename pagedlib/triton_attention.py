"""A fused Triton paged-attention decode kernel (notebook 05).

``paged_attention_triton`` takes exactly the arguments of ``pagedlib.attention.paged_attention`` and
returns the same result, but never builds a contiguous copy of the keys and values: each program walks
its sequence's block table itself and streams K/V straight out of the paged pool.

Design, in one paragraph per piece:

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

On a machine without CUDA the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, set by
``pagedlib`` before triton is first imported). ``compile_for_gpu`` compiles them for an NVIDIA target
without a GPU (in a subprocess), which is how tests and notebook 05 check the GPU code path on a CPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # exp(x) == exp2(x * log2(e))
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 128
MAX_SPLITS = 64
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
# Host side: mode checks, configuration, the split heuristic, validation, launch
# ---------------------------------------------------------------------------------------------------


def interpreting() -> bool:
    """True when the kernels run through Triton's interpreter (numpy on the CPU)."""
    return all(_interpreter_modes())


def _interpreter_modes() -> tuple[bool, bool]:
    """(triton's own library functions are interpreted, this module's kernels are interpreted).

    Triton's library (``tl.sum``, ``tl.max``, ...) takes its mode when triton is first imported; a kernel
    takes it when it is decorated. The two differ when triton was imported before ``pagedlib`` set
    ``TRITON_INTERPRET=1``, and such a mix fails inside the interpreter with an obscure message."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction), isinstance(_paged_decode_kernel, InterpretedFunction)


def _check_mode() -> None:
    """Refuse the setups that cannot work, with a message that says how to fix them."""
    library, kernels = _interpreter_modes()
    if library == kernels and (library or torch.cuda.is_available()):
        return
    raise RuntimeError(
        "paged_attention_triton: triton was imported in compiled mode"
        + (" before pagedlib could select its interpreter" if kernels else "")
        + (", and there is no CUDA device" if not torch.cuda.is_available() else "")
        + ". Triton fixes its mode when it is first imported, and importing torch._dynamo or torch.compile "
        "imports it. Import pagedlib before those, or set TRITON_INTERPRET=1 in the environment before "
        "starting Python."
    )


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
    programs = batch * kv_heads
    wanted = math.ceil(2 * sm_count / max(programs, 1))
    longest = max(1, max_context // min_tokens_per_split)
    return max(1, min(wanted, longest, max_splits))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: splitting only adds work


def _validate(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, num_splits: int | None) -> None:
    """The checks ``paged_attention`` makes (shared helper), plus the kernel's own limits."""
    from pagedlib.attention import check_paged_inputs

    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    if q.dtype not in SUPPORTED_DTYPES:
        names = [str(d) for d in SUPPORTED_DTYPES]
        raise ValueError(f"q must have a dtype in {names} for the Triton kernel, got {q.dtype}")
    head_dim, block_size = q.shape[-1], k_cache.shape[1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q's head_dim must be at most {MAX_HEAD_DIM} for the Triton kernel, got {head_dim}")
    if block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(f"k_cache's block_size must be a power of two from 1 to {MAX_BLOCK_SIZE}, "
                         f"got {block_size}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int from 1 to {MAX_SPLITS}, got {num_splits!r}")
    if not interpreting() and q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor for the compiled kernel, got device {q.device}")


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
    """One decode step of attention, reading K/V straight from the paged pool.

    Args:
        q: ``[batch, q_heads, head_dim]``, one new query token per sequence.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` (strided views allowed).
        block_tables: int32 ``[batch, max_blocks]``, physical block ids, padded with -1.
        seq_lens: int32 ``[batch]``, tokens per sequence, each >= 1.
        scale: softmax scale, default ``head_dim ** -0.5``.
        num_splits: partitions of the context (split-K); ``None`` lets ``choose_num_splits`` decide.

    Returns:
        ``[batch, q_heads, head_dim]``, dtype of ``q``.
    """
    _check_mode()
    _validate(q, k_cache, v_cache, block_tables, seq_lens, num_splits)
    if num_splits is None:
        max_context = block_tables.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(q.shape[0], k_cache.shape[2], max_context, _sm_count(q.device))
    return _launch(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            seq_lens: torch.Tensor, scale: float | None, num_splits: int, *,
            dot_fp32: bool | None = None) -> torch.Tensor:
    """Launch the kernel(s) on already validated inputs: no host synchronisation, so it can be captured
    in a CUDA graph (the GPU benchmark times it that way).

    ``dot_fp32`` overrides the upcast of dot operands (default: only in the interpreter); a test runs
    the GPU's fp16 arithmetic through the interpreter with ``dot_fp32=False``."""
    batch, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    cfg = kernel_config(head_dim, q_heads // kv_heads)
    scale = head_dim**-0.5 if scale is None else float(scale)
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
    _paged_decode_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, dst, m, lsum,
        scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *dst_strides,
        tokens_per_split,
        BLOCK_SIZE=block_size, SPLIT=split, DOT_FP32=dot_fp32, PRECISION=precision, **cfg,
        num_warps=4,
    )
    if split:
        _merge_splits_kernel[(batch, q_heads)](
            partial, m, lsum, out, num_splits, *partial.stride(), *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_P=cfg["HEAD_DIM_P"], SPLITS_P=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------------
# Compiling for a GPU without one (tests, notebook 05's PTX excerpt)
# ---------------------------------------------------------------------------------------------------

_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _decode_kernel_source(dtype: str, head_dim: int, block_size: int, group: int, split: bool) -> Any:
    """An ``ASTSource`` for the decode kernel: argument types as a real launch would specialise them
    (pointers and strides divisible by 16, unit strides along head_dim folded to constants)."""
    from triton.compiler import ASTSource

    fn = _paged_decode_kernel
    ty = _TRITON_TYPES[dtype]
    pointers = {"q_ptr": ty, "k_ptr": ty, "v_ptr": ty, "table_ptr": "i32", "lens_ptr": "i32",
                "out_ptr": "fp32" if split else ty, "m_ptr": "fp32", "l_ptr": "fp32"}
    unit = {"stride_qd", "stride_kd", "stride_vd", "stride_tn", "stride_od"}
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        if name in pointers:
            signature[name] = "*" + pointers[name]
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    constexprs: dict[str, Any] = {**kernel_config(head_dim, group), "BLOCK_SIZE": block_size, "SPLIT": split,
                                  "DOT_FP32": False, "PRECISION": "ieee" if dtype == "float32" else "tf32"}
    constexprs.update({name: 1 for name in unit})
    for name in constexprs:
        signature[name] = "constexpr"
    aligned = [n for n in fn.arg_names if n.endswith("_ptr") or (n.startswith("stride_") and n not in unit)]
    aligned = [n for n in aligned if n not in ("stride_tb",)]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return ASTSource(fn, signature, constexprs, attrs)


def _merge_kernel_source(head_dim: int, num_splits: int, out_dtype: str = "float32") -> Any:
    """An ``ASTSource`` for the merge kernel (fp32 partials in, ``out_dtype`` output, as ``q``'s)."""
    from triton.compiler import ASTSource

    fn = _merge_splits_kernel
    unit = {"stride_pd", "stride_od"}
    head_dim_p = max(16, triton.next_power_of_2(head_dim))
    constexprs: dict[str, Any] = {"HEAD_DIM": head_dim, "HEAD_DIM_P": head_dim_p,
                                  "SPLITS_P": triton.next_power_of_2(num_splits), **{n: 1 for n in unit}}
    signature = {n: "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    signature["out_ptr"] = "*" + _TRITON_TYPES[out_dtype]
    signature.update({n: "constexpr" for n in constexprs})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n.endswith("_ptr")}
    return ASTSource(fn, signature, constexprs, attrs)


def _compile_specs_here(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compile in this (compiled-mode) process; see ``compile_for_gpu``."""
    from triton.backends.compiler import GPUTarget

    results = []
    for spec in specs:
        if spec.get("kernel", "decode") == "merge":
            src = _merge_kernel_source(spec["head_dim"], spec["num_splits"], spec.get("dtype", "float32"))
        else:
            src = _decode_kernel_source(spec["dtype"], spec["head_dim"], spec["block_size"], spec["group"],
                                        spec["split"])
        t0 = time.perf_counter()
        compiled = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32), options={"num_warps": 4})
        results.append({**spec, "ptx": compiled.asm["ptx"], "seconds": time.perf_counter() - t0,
                        "shared_bytes": compiled.metadata.shared})
    return results


def compile_for_gpu_many(specs: list[dict[str, Any]], timeout: float = 600) -> list[dict[str, Any]]:
    """Compile several configurations in one subprocess (see ``compile_for_gpu``).

    Each spec is a dict: ``arch`` (80, 90, ...), and either the decode kernel's ``dtype`` (``"float16"``,
    ``"bfloat16"``, ``"float32"``), ``head_dim``, ``block_size``, ``group``, ``split``, or
    ``kernel="merge"`` with ``head_dim``, ``num_splits`` and optionally ``dtype`` (of the output).
    """
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = ("import json, sys, torch\n"  # torch before triton, or tl.cdiv fails in some setups
            "from pagedlib import triton_attention as t\n"
            "json.dump(t._compile_specs_here(json.load(sys.stdin)), sys.stdout)\n")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(specs), env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the kernel for a GPU target failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def compile_for_gpu(arch: int = 90, *, dtype: str = "float16", head_dim: int = 128, block_size: int = 16,
                    group: int = 4, split: bool = False) -> dict[str, Any]:
    """Compile the decode kernel for ``sm_<arch>`` without a GPU and return its PTX.

    Runs in a subprocess with ``TRITON_INTERPRET=0`` (a process in interpreter mode cannot compile
    reliably). Returns a dict with the inputs plus ``ptx`` (text), ``seconds`` and ``shared_bytes``.
    """
    spec = {"arch": arch, "dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group,
            "split": split}
    return compile_for_gpu_many([spec])[0]


def ptx_instructions(ptx: str) -> list[str]:
    """The instructions of ``ptx``, one per entry, without directives, labels, comments or braces.

    Count these, not lines: a PTX file also carries debug information that is a fact about the checkout,
    not the kernel. Its DWARF sections spell the source file's absolute path one ``.b8`` byte per line,
    and its ``.loc`` directives carry the kernel's line numbers, so the line count changes with the
    folder the repo was cloned into (and Triton's cache, keyed by the kernel's source text alone, can
    hand back PTX compiled from another checkout).
    """
    out = []
    for line in ptx.splitlines():
        code = line.split("//", 1)[0].strip()
        if code and not code.startswith((".", "$", "{", "}")) and not code.endswith(":"):
            out.append(code)
    return out


def ptx_excerpt(ptx: str, context: int = 6) -> str:
    """The lines of ``ptx`` around the first global load of the K tile.

    On sm_80 and later the pipelined loop loads K/V with ``cp.async`` (global -> shared, 16 bytes per
    thread, zero-filled where the mask is off); elsewhere it is a plain ``ld.global``.

    Triton writes ``.loc`` directives that map each PTX instruction to a source line, so the load is
    found by the line number of ``k = tl.load(`` in the kernel's source, not by guessing.
    """
    import inspect

    src_lines, first = inspect.getsourcelines(_paged_decode_kernel.fn)
    k_line = first + next(i for i, line in enumerate(src_lines) if line.strip().startswith("k = tl.load("))
    lines = ptx.splitlines()
    in_k_load = False
    for i, line in enumerate(lines):
        if line.strip().startswith(".loc"):
            fields = line.split()
            in_k_load = len(fields) > 2 and fields[2].isdigit() and int(fields[2]) == k_line
        elif in_k_load and ("ld.global" in line or "cp.async" in line and ".global" in line):
            lo, hi = max(0, i - context), min(len(lines), i + context + 1)
            return "\n".join(line.rstrip() for line in lines[lo:hi])
    raise ValueError("no global load of the K tile found in this PTX")
