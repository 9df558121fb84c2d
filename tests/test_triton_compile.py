"""The kernels compile for real NVIDIA targets (sm_80, sm_90) on a machine without a GPU.

The interpreter accepts code the GPU compiler rejects (dot shapes, some type mixes), so CI compiles the
kernels to PTX as well. All configurations compile in one subprocess (``compile_for_gpu_many``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import pagedlib  # noqa: F401  (first: it picks Triton's mode before triton's first import)

pytest.importorskip("triton", reason="Triton publishes Linux wheels only; the kernel tests need it")

from pagedlib.teach.ptx import compile_for_gpu_many, ptx_excerpt, ptx_instructions

# (dtype, head_dim, block_size, group, split): every dtype, the real head dims, block sizes 1..128
DECODE = [
    ("float16", 128, 16, 4, False),
    ("bfloat16", 128, 16, 4, True),
    ("float32", 128, 16, 4, False),
    ("float16", 64, 1, 1, True),
    ("bfloat16", 80, 2, 8, False),
    ("float16", 96, 4, 2, False),
    ("float32", 112, 8, 16, True),
    ("bfloat16", 256, 32, 4, False),
    ("float16", 256, 64, 1, True),
    ("float16", 80, 128, 5, False),
]
ARCHS = (80, 90)
# merge kernel: (head_dim, num_splits, output dtype = q's dtype); real launches store fp16/bf16
MERGE = ((128, 33, "float16"), (80, 2, "bfloat16"), (96, 5, "float32"))


@pytest.fixture(scope="module")
def compiled() -> dict[tuple, dict]:
    specs = [{"arch": a, "dtype": d, "head_dim": hd, "block_size": bs, "group": g, "split": s}
             for a in ARCHS for d, hd, bs, g, s in DECODE]
    specs += [{"arch": a, "kernel": "merge", "head_dim": hd, "num_splits": n, "dtype": d}
              for a in ARCHS for hd, n, d in MERGE]
    results = compile_for_gpu_many(specs)
    return {tuple(sorted((k, v) for k, v in r.items() if k in spec)): r for r, spec in zip(results, specs)}


def _get(compiled: dict, **spec) -> dict:
    return compiled[tuple(sorted(spec.items()))]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,head_dim,block_size,group,split", DECODE)
def test_decode_kernel_compiles(compiled, arch, dtype, head_dim, block_size, group, split):
    r = _get(compiled, arch=arch, dtype=dtype, head_dim=head_dim, block_size=block_size, group=group,
             split=split)
    ptx = r["ptx"]
    assert f".target sm_{arch}" in ptx
    assert ".entry _paged_decode_kernel" in ptx
    if dtype == "float32":  # exact fp32 products (input_precision="ieee"): no TF32 tensor-core rounding
        assert "mma." not in ptx
    else:  # fp16/bf16 dots run on tensor cores, accumulating in fp32 (Hopper's wgmma for 64-row tiles)
        t = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32" in ptx or \
            re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{t}\.{t}", ptx)
    # K/V tiles move in 16-byte pieces per thread (vectorised along head_dim), however big the block
    async_16b = re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", ptx)
    assert async_16b or "ld.global.v4" in ptx


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_kernel_compiles(compiled, arch):
    for head_dim, splits, dtype in MERGE:
        spec = {"arch": arch, "kernel": "merge", "head_dim": head_dim, "num_splits": splits, "dtype": dtype}
        ptx = _get(compiled, **spec)["ptx"]
        assert f".target sm_{arch}" in ptx and ".entry _merge_splits_kernel" in ptx
        store = {"float16": "st.global.b16", "bfloat16": "st.global.b16", "float32": "st.global.b32"}[dtype]
        assert store in ptx, f"the {dtype} output store is missing"


def test_ptx_excerpt_shows_the_k_tile_load(compiled):
    r = _get(compiled, arch=90, dtype="float16", head_dim=128, block_size=16, group=4, split=False)
    excerpt = ptx_excerpt(r["ptx"])
    assert "cp.async" in excerpt or "ld.global" in excerpt


def test_what_notebook_05_prints_does_not_depend_on_the_checkout(compiled, tmp_path):
    """A clone in another folder, compiled with an empty Triton cache, gives the same instructions and the
    same excerpt (the PTX line count differs: its debug sections spell the source path byte by byte)."""
    here = _get(compiled, arch=90, dtype="float16", head_dim=128, block_size=16, group=4, split=False)
    clone = tmp_path / "a-checkout-in-a-folder-with-a-much-longer-name"
    shutil.copytree(Path(__file__).resolve().parents[1] / "pagedlib", clone / "pagedlib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import json, torch\n"
            "from pagedlib.teach.ptx import compile_for_gpu\n"
            "print(json.dumps(compile_for_gpu(90, dtype='float16', head_dim=128, block_size=16, group=4)))\n")
    env = {**os.environ, "PYTHONPATH": str(clone), "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    there = json.loads(proc.stdout)
    assert f'"{clone}/pagedlib/kernels/triton_decode.py"' in there["ptx"]  # compiled from the clone's source
    assert ptx_instructions(there["ptx"]) == ptx_instructions(here["ptx"])
    assert ptx_excerpt(there["ptx"]) == ptx_excerpt(here["ptx"])


# the unified varlen kernel (notebook 09): (dtype, head_dim, block_size, group, decode step?)
VARLEN = [
    ("float16", 128, 16, 4, False),
    ("bfloat16", 128, 16, 4, True),
    ("float32", 64, 128, 1, False),
    ("bfloat16", 80, 1, 8, False),
    ("float16", 96, 8, 5, True),
    ("float16", 256, 32, 2, False),
    ("bfloat16", 112, 64, 16, False),
]
# compiled as a real launch specialises it: pointers and strides divisible by 16, unit strides constant
_VARLEN_COMPILE = r"""
import json, sys, time, torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedlib.kernels.triton_varlen import _varlen_kernel, varlen_config

fn, out = _varlen_kernel, []
unit = {"stride_qd", "stride_kd", "stride_vd", "stride_tn", "stride_od"}
for spec in json.load(sys.stdin):
    ty = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[spec["dtype"]]
    ints = {"table_ptr", "lens_ptr", "qsl_ptr"}
    sig = {n: ("*i32" if n in ints else "*" + ty) if n.endswith("_ptr") else "fp32" if n == "qk_scale"
           else "i32" for n in fn.arg_names}
    consts = {**varlen_config(spec["head_dim"], spec["group"], spec["decode"]), **dict.fromkeys(unit, 1),
              "BLOCK_SIZE": spec["block_size"], "DOT_FP32": False,
              "PRECISION": "ieee" if spec["dtype"] == "float32" else "tf32"}
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if n.endswith("_ptr") or (n.startswith("stride_") and n not in unit and n != "stride_tb")}
    t0 = time.perf_counter()
    c = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", spec["arch"], 32),
                       options={"num_warps": 4})
    out.append({**spec, "ptx": c.asm["ptx"], "seconds": time.perf_counter() - t0})
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled_varlen() -> dict[tuple, str]:
    specs = [{"arch": a, "dtype": d, "head_dim": hd, "block_size": bs, "group": g, "decode": dec}
             for a in ARCHS for d, hd, bs, g, dec in VARLEN]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", _VARLEN_COMPILE], input=json.dumps(specs), cwd=root, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {(r["arch"], r["dtype"], r["head_dim"], r["block_size"], r["group"], r["decode"]): r["ptx"]
            for r in json.loads(proc.stdout)}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype,head_dim,block_size,group,decode", VARLEN)
def test_varlen_kernel_compiles(compiled_varlen, arch, dtype, head_dim, block_size, group, decode):
    ptx = compiled_varlen[(arch, dtype, head_dim, block_size, group, decode)]
    assert f".target sm_{arch}" in ptx and ".entry _varlen_kernel" in ptx
    if dtype == "float32":  # exact fp32 products: no TF32 tensor-core rounding
        assert "mma." not in ptx
    else:  # fp16/bf16 dots run on tensor cores, accumulating in fp32 (Hopper's wgmma for 64-row tiles)
        t = {"float16": "f16", "bfloat16": "bf16"}[dtype]
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32" in ptx or \
            re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{t}\.{t}", ptx)
