"""Compile the Triton kernels for an NVIDIA GPU without one, and read the PTX (notebook 05, tests). A process
whose Triton is in interpreter mode cannot compile, so ``compile_for_gpu_many`` compiles in a child process:
``python -m pagedlib.teach.ptx`` with ``TRITON_INTERPRET=0``, started and guarded by ``pagedlib.child`` (the
specs one JSON job, the compiled kernels its answer)."""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch  # noqa: F401 - before triton, or tl.cdiv fails in some setups (the child imports this first)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedlib.child import ChildError, run_child, serve
from pagedlib.kernels import triton_decode

CHILD_MODULE = "pagedlib.teach.ptx"   # the compiling process (``python -m``): this file

_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8e4nv",
                 "float8_e5m2": "fp8e5"}


def _decode_source(spec: dict[str, Any]) -> ASTSource:
    """The decode kernel typed as a real launch specialises it (pointers and strides divisible by 16, unit
    strides along head_dim folded to constants)."""
    dtype, head_dim, split = spec["dtype"], spec["head_dim"], spec["split"]
    fn, ty, kv = triton_decode._paged_decode_kernel, _TRITON_TYPES[dtype], spec.get("kv_dtype", dtype)
    pointers = {"q_ptr": ty, "k_ptr": _TRITON_TYPES[kv], "v_ptr": _TRITON_TYPES[kv], "table_ptr": "i32",
                "lens_ptr": "i32", "k_scale_ptr": "fp32", "v_scale_ptr": "fp32",
                "out_ptr": "fp32" if split else ty, "m_ptr": "fp32", "l_ptr": "fp32"}
    unit = {"stride_qd", "stride_kd", "stride_vd", "stride_tn", "stride_od"}
    signature = {n: "*" + pointers[n] if n in pointers else "fp32" if n == "qk_scale" else "i32"
                 for n in fn.arg_names}
    constexprs: dict[str, Any] = {**triton_decode.kernel_config(head_dim, spec["group"]),
                                  "BLOCK_SIZE": spec["block_size"], "SPLIT": split, "SCALED": kv != dtype,
                                  "DOT_FP32": False, "PRECISION": "ieee" if dtype == "float32" else "tf32",
                                  **dict.fromkeys(unit, 1)}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or (n.startswith("stride_") and n not in unit and n != "stride_tb")}
    return ASTSource(fn, signature, constexprs, attrs)


def _merge_source(spec: dict[str, Any]) -> ASTSource:
    """The merge kernel: fp32 partials in, an output of ``spec["dtype"]`` (``q``'s; default float32)."""
    fn, unit = triton_decode._merge_splits_kernel, {"stride_pd", "stride_od"}
    head_dim, splits_p = spec["head_dim"], triton.next_power_of_2(spec["num_splits"])
    constexprs: dict[str, Any] = {"HEAD_DIM": head_dim, "SPLITS_P": splits_p,
                                  "HEAD_DIM_P": triton_decode.kernel_config(head_dim, 1)["HEAD_DIM_P"],
                                  **dict.fromkeys(unit, 1)}
    signature = {n: "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    signature["out_ptr"] = "*" + _TRITON_TYPES[spec.get("dtype", "float32")]
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n.endswith("_ptr")}
    return ASTSource(fn, signature, constexprs, attrs)


def _compile_here(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compile in this (compiled-mode) process; see ``compile_for_gpu_many``."""
    results = []
    for spec in specs:
        src = (_merge_source if spec.get("kernel") == "merge" else _decode_source)(spec)
        t0 = time.perf_counter()
        compiled = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32), options={"num_warps": 4})
        results.append({**spec, "ptx": compiled.asm["ptx"], "seconds": time.perf_counter() - t0,
                        "shared_bytes": compiled.metadata.shared})
    return results


def compile_for_gpu_many(specs: list[dict[str, Any]], timeout: float = 600) -> list[dict[str, Any]]:
    """Compile several specs in one ``TRITON_INTERPRET=0`` subprocess; returns them with ``ptx``, ``seconds``,
    ``shared_bytes``. A spec: ``arch`` (80, 90, ...) and the decode kernel's ``dtype``, ``head_dim``,
    ``block_size``, ``group``, ``split`` (optionally the cache's ``kv_dtype``), or ``kernel="merge"`` with
    ``head_dim``, ``num_splits`` and optionally the output's ``dtype``. ``RuntimeError`` with the child's
    error and stderr if compiling fails, ``TimeoutError`` (the child stopped) after ``timeout`` seconds."""
    try:
        return run_child(CHILD_MODULE, specs, timeout, env={"TRITON_INTERPRET": "0"})
    except ChildError as error:
        raise RuntimeError(f"compiling the kernel for a GPU target failed: {error}") from None


def compile_for_gpu(arch: int = 90, *, dtype: str = "float16", head_dim: int = 128, block_size: int = 16,
                    group: int = 4, split: bool = False) -> dict[str, Any]:
    """Compile the decode kernel for ``sm_<arch>`` without a GPU: one spec of ``compile_for_gpu_many``."""
    return compile_for_gpu_many([{"arch": arch, "dtype": dtype, "head_dim": head_dim,
                                  "block_size": block_size, "group": group, "split": split}])[0]


def ptx_instructions(ptx: str) -> list[str]:
    """The instructions of ``ptx`` without directives, labels, comments or braces. Count these, not lines:
    PTX's debug sections spell the source file's path one byte per line, so lines depend on the checkout."""
    code = (line.split("//", 1)[0].strip() for line in ptx.splitlines())
    return [c for c in code if c and not c.startswith((".", "$", "{", "}")) and not c.endswith(":")]


def ptx_excerpt(ptx: str, context: int = 6) -> str:
    """The lines of ``ptx`` around the first global load of a K tile (``cp.async`` on sm_80 and later, else
    ``ld.global``), found through the ``.loc`` directives that point at ``k = tl.load(`` in ``_kv_tile``."""
    src, first = inspect.getsourcelines(triton_decode._kv_tile.fn)
    line_no = first + next(i for i, line in enumerate(src) if line.strip().startswith("k = tl.load("))
    lines, here = ptx.splitlines(), False
    for i, line in enumerate(lines):
        if line.strip().startswith(".loc"):
            fields = line.split()
            here = len(fields) > 2 and fields[2].isdigit() and int(fields[2]) == line_no
        elif here and ("ld.global" in line or "cp.async" in line and ".global" in line):
            return "\n".join(x.rstrip() for x in lines[max(0, i - context):i + context + 1])
    raise ValueError("no global load of the K tile found in this PTX")


if __name__ == "__main__":
    serve(_compile_here)
