"""Triton plumbing around the kernels of ``pagedlib.kernels.triton_decode`` (notebook 05, tests, benchmarks).

- **Interpreter mode.** Without CUDA, ``pagedlib`` sets ``TRITON_INTERPRET=1`` before triton's first
  import, and the kernels run through Triton's interpreter (numpy on the CPU). ``interpreting`` says
  whether they do, ``check_mode`` refuses the setups that cannot work, and ``interpreter_lock``
  serialises interpreted launches: the interpreter keeps global state while it runs a kernel, so two
  threads launching at once fail (``InterpreterError``) or corrupt each other.
- **Compiling for a GPU without one.** ``compile_for_gpu`` builds the decode (or merge) kernel for an
  NVIDIA target (``sm_80``, ``sm_90``) in a subprocess, returning its PTX; ``ptx_instructions`` and
  ``ptx_excerpt`` read that PTX the way notebook 05 shows it.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from typing import Any

import triton

# compiling for a GPU without one

_TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _decode_source(dtype: str, head_dim: int, block_size: int, group: int, split: bool) -> Any:
    """An ``ASTSource`` for the decode kernel: argument types as a real launch would specialise them
    (pointers and strides divisible by 16, unit strides along head_dim folded to constants)."""
    from triton.compiler import ASTSource

    from pagedlib.kernels.triton_decode import _paged_decode_kernel as fn
    from pagedlib.kernels.triton_decode import kernel_config

    ty = _TRITON_TYPES[dtype]
    pointers = {"q_ptr": ty, "k_ptr": ty, "v_ptr": ty, "table_ptr": "i32", "lens_ptr": "i32",
                "out_ptr": "fp32" if split else ty, "m_ptr": "fp32", "l_ptr": "fp32"}
    unit = {"stride_qd", "stride_kd", "stride_vd", "stride_tn", "stride_od"}
    signature = {n: "*" + pointers[n] if n in pointers else "fp32" if n == "qk_scale" else "i32"
                 for n in fn.arg_names}
    constexprs: dict[str, Any] = {**kernel_config(head_dim, group), "BLOCK_SIZE": block_size, "SPLIT": split,
                                  "DOT_FP32": False, "PRECISION": "ieee" if dtype == "float32" else "tf32",
                                  **dict.fromkeys(unit, 1)}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    aligned = [n for n in fn.arg_names if n.endswith("_ptr")
               or (n.startswith("stride_") and n not in unit and n != "stride_tb")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return ASTSource(fn, signature, constexprs, attrs)


def _merge_source(head_dim: int, num_splits: int, out_dtype: str = "float32") -> Any:
    """An ``ASTSource`` for the merge kernel (fp32 partials in, ``out_dtype`` output, as ``q``'s)."""
    from triton.compiler import ASTSource

    from pagedlib.kernels.triton_decode import _merge_splits_kernel as fn
    from pagedlib.kernels.triton_decode import kernel_config

    unit = {"stride_pd", "stride_od"}
    head_dim_p = kernel_config(head_dim, 1)["HEAD_DIM_P"]
    constexprs: dict[str, Any] = {"HEAD_DIM": head_dim, "HEAD_DIM_P": head_dim_p,
                                  "SPLITS_P": triton.next_power_of_2(num_splits), **dict.fromkeys(unit, 1)}
    signature = {n: "*fp32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    signature["out_ptr"] = "*" + _TRITON_TYPES[out_dtype]
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n.endswith("_ptr")}
    return ASTSource(fn, signature, constexprs, attrs)


def _compile_here(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compile in this (compiled-mode) process; see ``compile_for_gpu_many``."""
    from triton.backends.compiler import GPUTarget

    results = []
    for spec in specs:
        if spec.get("kernel", "decode") == "merge":
            src = _merge_source(spec["head_dim"], spec["num_splits"], spec.get("dtype", "float32"))
        else:
            src = _decode_source(spec["dtype"], spec["head_dim"], spec["block_size"], spec["group"],
                                 spec["split"])
        t0 = time.perf_counter()
        compiled = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32), options={"num_warps": 4})
        results.append({**spec, "ptx": compiled.asm["ptx"], "seconds": time.perf_counter() - t0,
                        "shared_bytes": compiled.metadata.shared})
    return results


def compile_for_gpu_many(specs: list[dict[str, Any]], timeout: float = 600) -> list[dict[str, Any]]:
    """Compile several configurations in one subprocess with ``TRITON_INTERPRET=0`` (a process in
    interpreter mode cannot compile reliably).

    Each spec is a dict: ``arch`` (80, 90, ...), and either the decode kernel's ``dtype`` (``"float16"``,
    ``"bfloat16"``, ``"float32"``), ``head_dim``, ``block_size``, ``group``, ``split``, or
    ``kernel="merge"`` with ``head_dim``, ``num_splits`` and optionally ``dtype`` (of the output).
    Returns the specs, each with ``ptx`` (text), ``seconds`` and ``shared_bytes`` added.
    """
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = ("import json, sys, torch\n"  # torch before triton, or tl.cdiv fails in some setups
            "from pagedlib.teach import ptx as t\n"
            "json.dump(t._compile_here(json.load(sys.stdin)), sys.stdout)\n")
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(specs), env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the kernel for a GPU target failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def compile_for_gpu(arch: int = 90, *, dtype: str = "float16", head_dim: int = 128, block_size: int = 16,
                    group: int = 4, split: bool = False) -> dict[str, Any]:
    """Compile the decode kernel for ``sm_<arch>`` without a GPU: one spec of ``compile_for_gpu_many``."""
    spec = {"arch": arch, "dtype": dtype, "head_dim": head_dim, "block_size": block_size, "group": group,
            "split": split}
    return compile_for_gpu_many([spec])[0]


def ptx_instructions(ptx: str) -> list[str]:
    """The instructions of ``ptx``, one per entry, without directives, labels, comments or braces.

    Count these, not lines: PTX also carries debug information about the checkout (DWARF sections spell
    the source file's absolute path one ``.b8`` byte per line), so its line count changes with the folder
    the repo was cloned into.
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
    thread, zero-filled where the mask is off); elsewhere it is a plain ``ld.global``. Triton writes
    ``.loc`` directives that map each PTX instruction to a source line, so the load is found by the line
    number of ``k = tl.load(`` in the kernel's source, not by guessing.
    """
    from pagedlib.kernels.triton_decode import _paged_decode_kernel

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
