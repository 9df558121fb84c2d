"""The fused Triton decode kernel equals the float64 reference and ``paged_attention`` (CPU interpreter).

Shapes stay tiny: the interpreter executes every Triton op with numpy, one program at a time.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

import pagedlib  # noqa: F401  (sets TRITON_INTERPRET=1 before triton's first import when there is no CUDA)

# after pagedlib, which picks Triton's mode before triton's first import
pytest.importorskip("triton", reason="Triton publishes Linux wheels only; the kernel tests need it")
from pagedlib.attention import paged_attention
from pagedlib.cache import PagedKVCache
from pagedlib.triton_attention import (
    MAX_SPLITS,
    choose_num_splits,
    interpreting,
    paged_attention_triton,
)

# the kernel runs where its inputs live: CUDA tensors (compiled) when there is a GPU, else the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# relative-norm limits of a kernel's output against the float64 reference (DESIGN.md)
REL_LIMIT = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# elementwise limits between two outputs of the same dtype: DESIGN.md's atol, torch's default rtol (about
# one rounding of the output: two correct paths may round a value to neighbouring bf16/fp16 numbers)
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}
RTOL = {torch.float32: 1.3e-6, torch.float16: 1e-3, torch.bfloat16: 1.6e-2}


@dataclass
class Case:
    """One decode step: pools filled with NaN except the slots that hold tokens."""

    q: torch.Tensor  # [batch, q_heads, head_dim]
    k: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] (a strided per-layer view)
    v: torch.Tensor
    tables: torch.Tensor  # int32 [batch, max_blocks], -1 padded
    lens: torch.Tensor  # int32 [batch]


def make_case(lens: list[int], *, kv_heads: int, group: int, head_dim: int, block_size: int,
              dtype: torch.dtype, num_layers: int = 2, layer: int = 1, spare_blocks: int = 3,
              seed: int = 0) -> Case:
    """Random K/V for ``lens`` tokens in shuffled blocks of a multi-layer pool; everything else is NaN
    (free blocks, unwritten tails, other layers, the -1 padding of the tables)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(counts) + spare_blocks
    shape = (num_blocks, num_layers, block_size, kv_heads, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=dtype)
    v_pool = torch.full(shape, float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(lens), max(counts)), -1, dtype=torch.int32)
    for b, (n, c) in enumerate(zip(lens, counts)):
        blocks = [ids.pop() for _ in range(c)]
        tables[b, :c] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        blk = torch.tensor(blocks)[pos // block_size]
        k_pool[blk, layer, pos % block_size] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v_pool[blk, layer, pos % block_size] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    k_pool, v_pool, q, tables, lens_t = (t.to(DEVICE) for t in (k_pool, v_pool, q, tables, lens_t))
    return Case(q, k_pool[:, layer], v_pool[:, layer], tables, lens_t)


def reference_f64(c: Case, scale: float | None = None) -> torch.Tensor:
    """Gather each sequence's tokens one by one through its table; softmax in float64.

    Returns ``[batch, q_heads, head_dim]`` float64."""
    batch, q_heads, head_dim = c.q.shape
    block_size, kv_heads = c.k.shape[1], c.k.shape[2]
    group = q_heads // kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float64, device=c.q.device)
    for b in range(batch):
        pos = torch.arange(int(c.lens[b]), device=c.q.device)
        blk = c.tables[b, pos // block_size].long()
        k = c.k[blk, pos % block_size].double().repeat_interleave(group, dim=1)  # [len, q_heads, D]
        v = c.v[blk, pos % block_size].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", c.q[b].double(), k) * scale  # [q_heads, len]
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def run(c: Case, **kw) -> torch.Tensor:
    return paged_attention_triton(c.q, c.k, c.v, c.tables, c.lens, **kw)


def test_runs_in_the_interpreter_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the compiled kernel runs instead of the interpreter")
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert interpreting()


# dtype, head_dim, block_size, group (q_heads per kv head), kv_heads, lengths, num_splits
CASES = [
    (torch.float32, 64, 16, 1, 2, [1, 16, 45], None),  # MHA, length 1, an exact block multiple
    (torch.float16, 128, 8, 4, 2, [24, 1, 37], 2),
    (torch.bfloat16, 80, 32, 2, 2, [64, 33], 1),  # head_dim 80: masked to 128
    (torch.float32, 96, 1, 8, 1, [7, 20], 3),  # block size 1, MQA, head_dim 96
    (torch.float16, 256, 16, 2, 2, [32, 50], 1),
    (torch.bfloat16, 128, 16, 8, 1, [48, 5], 4),
    (torch.float32, 80, 8, 3, 2, [17, 40], None),  # a group of 3 is padded to 4 rows
    (torch.float16, 64, 1, 1, 3, [1, 3, 33], 2),
    (torch.bfloat16, 256, 8, 4, 1, [16, 31], 2),
    (torch.float32, 128, 32, 5, 1, [100], 5),
    (torch.float16, 96, 32, 16, 1, [40, 2], 1),
    (torch.bfloat16, 64, 1, 2, 2, [9, 1], None),
]


def _case_id(p: tuple) -> str:
    dtype, d, bs, g, kvh, lens, s = p
    return f"{str(dtype)[6:]}-d{d}-bs{bs}-g{g}x{kvh}-len{'_'.join(map(str, lens))}-s{s}"


@pytest.mark.parametrize("params", CASES, ids=[_case_id(p) for p in CASES])
def test_matches_float64_reference(params):
    dtype, head_dim, block_size, group, kv_heads, lens, splits = params
    c = make_case(lens, kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype)
    out = run(c, num_splits=splits)
    assert out.shape == c.q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "NaN from an unused slot leaked into the result"
    assert rel_err(out, reference_f64(c)) < REL_LIMIT[dtype]
    expected = paged_attention(c.q, c.k, c.v, c.tables, c.lens)
    torch.testing.assert_close(out, expected, atol=ATOL[dtype], rtol=RTOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_agrees_with_no_split(dtype, splits):
    # 7 splits of a 20-token sequence leave splits with no tokens at all: the merge must ignore them
    c = make_case([70, 20, 1], kv_heads=2, group=2, head_dim=64, block_size=8, dtype=dtype, seed=splits)
    whole = run(c, num_splits=1)
    parts = run(c, num_splits=splits)
    torch.testing.assert_close(parts, whole, atol=ATOL[dtype], rtol=RTOL[dtype])
    assert rel_err(parts, reference_f64(c)) < REL_LIMIT[dtype]


@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_arithmetic_for_fp16_through_the_interpreter(splits):
    # On a GPU the dot operands stay fp16 (the probabilities p are rounded to fp16 before p @ v); the
    # interpreter upcasts them by default. Run the GPU's variant here too: it must still meet the limit.
    if torch.cuda.is_available():
        pytest.skip("the compiled kernel runs these numerics on a GPU")
    from pagedlib.triton_attention import _launch

    c = make_case([70, 20, 1], kv_heads=2, group=4, head_dim=80, block_size=8, dtype=torch.float16)
    out = _launch(c.q, c.k, c.v, c.tables, c.lens, None, splits, dot_fp32=False)
    assert rel_err(out, reference_f64(c)) < REL_LIMIT[torch.float16]
    half = torch.float16
    torch.testing.assert_close(out, run(c, num_splits=splits), atol=ATOL[half], rtol=RTOL[half])


def test_custom_scale():
    c = make_case([20, 9], kv_heads=2, group=2, head_dim=64, block_size=8, dtype=torch.float32)
    out = run(c, scale=0.3)
    assert rel_err(out, reference_f64(c, scale=0.3)) < 1e-5
    assert rel_err(out, reference_f64(c)) > 1e-3, "the scale argument was ignored"


def test_reads_the_strided_layer_views_of_paged_kv_cache():
    cache = PagedKVCache(24, num_layers=3, block_size=4, kv_heads=2, head_dim=64, free_order=[7, 3, 20, 11],
                         device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    for seq, n in (("a", 9), ("b", 4), ("c", 1)):
        cache.add_sequence(seq)
        k = torch.randn(3, n, 2, 64, generator=gen).to(DEVICE)  # [num_layers, n, kv_heads, head_dim]
        v = torch.randn(3, n, 2, 64, generator=gen).to(DEVICE)
        cache.append_tokens(seq, k, v)
    cache.fill_unused(float("nan"))
    seqs = ["a", "b", "c"]
    tables, lens = cache.block_table(seqs), cache.seq_lens_tensor(seqs)
    q = torch.randn(3, 4, 64, generator=gen).to(DEVICE)
    for layer in range(3):
        k_l, v_l = cache.layer(layer)
        assert not k_l.is_contiguous()
        out = paged_attention_triton(q, k_l, v_l, tables, lens)
        assert rel_err(out, reference_f64(Case(q, k_l, v_l, tables, lens))) < 1e-5


def test_strided_query_and_wide_tables():
    # q as a non-contiguous view and block tables wider than needed (extra -1 columns)
    c = make_case([13, 30], kv_heads=2, group=2, head_dim=64, block_size=8, dtype=torch.float16)
    q_big = torch.zeros(2, 4, 2, 64, dtype=torch.float16, device=DEVICE)
    q_big[:, :, 1] = c.q
    wide = torch.cat([c.tables, torch.full((2, 5), -1, dtype=torch.int32, device=DEVICE)], dim=1)
    out = paged_attention_triton(q_big[:, :, 1], c.k, c.v, wide, c.lens, num_splits=3)
    assert rel_err(out, reference_f64(c)) < REL_LIMIT[torch.float16]


def test_strided_seq_lens_and_block_tables():
    # every argument may be a view: lengths and tables taken as columns/rows of bigger int32 tensors
    c = make_case([5, 7], kv_heads=1, group=2, head_dim=64, block_size=4, dtype=torch.float32)
    lens2d = torch.stack([c.lens, torch.zeros_like(c.lens)], dim=1)          # [batch, 2]
    tables3d = torch.stack([c.tables, torch.full_like(c.tables, -1)], dim=2)  # [batch, blocks, 2]
    assert not lens2d[:, 0].is_contiguous() and not tables3d[:, :, 0].is_contiguous()
    for splits in (1, 2):
        out = paged_attention_triton(c.q, c.k, c.v, tables3d[:, :, 0], lens2d[:, 0], num_splits=splits)
        assert rel_err(out, reference_f64(c)) < 1e-5


def _bad_inputs(c: Case) -> dict[str, tuple]:
    """Arguments ``paged_attention`` rejects, each broken in one way."""
    args = (c.q, c.k, c.v, c.tables, c.lens)
    too_long = c.lens.clone()
    too_long[1] = 10_000
    bad_entry = c.tables.clone()
    bad_entry[0, 0] = c.k.shape[0]
    return {
        "q is 2-D": (c.q[0], *args[1:]),
        "q_heads not a multiple of kv_heads": (c.q[:, :3], *args[1:]),
        "k_cache of another dtype": (c.q, c.k.half(), *args[2:]),
        "int64 block table": (*args[:3], c.tables.long(), c.lens),
        "length 0": (*args[:4], torch.zeros_like(c.lens)),
        "length beyond the table": (*args[:4], too_long),
        "table entry out of range": (*args[:3], bad_entry, c.lens),
    }


def test_rejects_what_paged_attention_rejects_with_the_same_message():
    c = make_case([5, 3], kv_heads=2, group=2, head_dim=64, block_size=4, dtype=torch.float32)
    for what, args in _bad_inputs(c).items():
        with pytest.raises(ValueError) as expected:
            paged_attention(*args)
        with pytest.raises(ValueError) as got:
            paged_attention_triton(*args)
        assert str(got.value) == str(expected.value), what


def test_kernel_limits_raise_clear_errors():
    c = make_case([5, 3], kv_heads=2, group=2, head_dim=64, block_size=4, dtype=torch.float32)
    for bad in (0, MAX_SPLITS + 1, 2.0):
        with pytest.raises(ValueError, match="num_splits"):
            run(c, num_splits=bad)
    big = make_case([3], kv_heads=1, group=1, head_dim=320, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        run(big)
    odd = make_case([5], kv_heads=1, group=1, head_dim=64, block_size=3, dtype=torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        run(odd)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(c.q.double(), c.k.double(), c.v.double(), c.tables, c.lens)


# --- the split heuristic -------------------------------------------------------------------------


def test_no_split_when_the_batch_already_fills_the_gpu():
    assert choose_num_splits(batch=64, kv_heads=8, max_context=32768, sm_count=132) == 1
    assert choose_num_splits(batch=256, kv_heads=8, max_context=4096, sm_count=132) == 1


def test_long_context_small_batch_fills_about_two_waves():
    n = choose_num_splits(batch=1, kv_heads=8, max_context=32768, sm_count=132)
    assert 2 * 132 <= 8 * n < 2 * 132 + 8, n  # the fewest splits that cover two waves
    assert choose_num_splits(batch=1, kv_heads=1, max_context=1 << 20, sm_count=132) == MAX_SPLITS


def test_splits_stay_long_enough():
    for ctx in (1, 100, 255, 256, 511, 512, 2048):
        n = choose_num_splits(batch=1, kv_heads=1, max_context=ctx, sm_count=132)
        assert n == max(1, ctx // 256)


# --- the one setup that cannot work -------------------------------------------------------------


@pytest.mark.parametrize("setup", ["import torch._dynamo first", "TRITON_INTERPRET=0"])
def test_refuses_compiled_mode_without_cuda(setup):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    first = "import torch._dynamo\n" if setup.startswith("import") else ""
    code = (first + "import torch, pagedlib\n"
            "from pagedlib.triton_attention import paged_attention_triton as f\n"
            "q = torch.zeros(1, 1, 16); k = torch.zeros(1, 1, 1, 16)\n"
            "t = torch.zeros(1, 1, dtype=torch.int32); n = torch.ones(1, dtype=torch.int32)\n"
            "try:\n    f(q, k, k, t, n)\nexcept RuntimeError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if setup == "TRITON_INTERPRET=0":
        env["TRITON_INTERPRET"] = "0"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    msg = proc.stdout
    assert "imported in compiled mode" in msg and "no CUDA device" in msg, msg + proc.stderr
    assert "Import pagedlib before" in msg and "TRITON_INTERPRET=1" in msg


# --- the GPU benchmark's CPU-safe parts ----------------------------------------------------------


def test_gpu_benchmark_refuses_to_run_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    proc = subprocess.run([sys.executable, "-m", "pagedlib.bench", "gpu"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr
    assert proc.stdout == ""


def test_gpu_benchmark_grid_and_replay_plan():
    from pagedlib.bench import gpu

    grid = gpu.shapes()
    want = {(b, c) for b in (1, 8, 64, 256) for c in (512, 4096, 32768)}
    assert {(s.batch, s.context) for s in grid} == want
    big = next(s for s in grid if (s.batch, s.context) == (256, 32768))
    assert big.kv_bytes == 2 * 256 * 32768 * 8 * 128 * 2 == 32 * 2**30
    l2 = 50 * 2**20
    for s in grid:
        inner, sets = gpu.replay_plan(s.kv_bytes, l2)
        assert 1 <= sets <= inner
        # a replay's working set is beyond L2, unless every call of the replay already has its own inputs
        assert sets * s.kv_bytes >= 3 * l2 or sets == inner


def test_gpu_benchmark_pipeline_on_tiny_cpu_tensors(tmp_path):
    """run_shape -> finish_rows -> targets -> JSON + markdown on tiny tensors, with a stand-in timer."""
    import argparse
    import datetime as dt
    import json

    from pagedlib.bench import gpu

    def cpu_timer(calls, inner, repeats, graph=True):
        outs = [c() for c in calls]
        assert all(torch.isfinite(o).all() for o in outs)
        return 1e-3 * len(calls), "cpu stand-in"

    shape = gpu.Shape(batch=2, context=24, q_heads=4, kv_heads=2, head_dim=16, block_size=4,
                      dtype=torch.float32)
    pool = gpu.Pool(0.0002, shape, device=DEVICE)
    args = argparse.Namespace(repeats=1, gather_budget_gib=1.0, flex="none")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    rows = gpu.run_shape(shape, pool, 2**16, args, gen, timer=cpu_timer)
    assert [r["method"] for r in rows] == list(gpu.METHODS)
    rows = gpu.finish_rows(rows, copy_gbps=100.0)
    sdpa = next(r for r in rows if r["method"] == "sdpa contiguous")
    assert sdpa["x SDPA"] == 1.0
    for r in rows:
        if "seconds" in r:
            assert r["GB/s"] == pytest.approx(shape.kv_bytes / r["seconds"] / 1e9)
            assert r["% copy BW"] == pytest.approx(r["GB/s"])  # copy bandwidth 100 GB/s
        else:
            assert r["note"], "a row without a time must say why"
    env = {"device_name": "NVIDIA Test GPU", "driver": "1.0", "torch": torch.__version__, "triton": "x",
           "date": dt.date(2026, 1, 2).isoformat()}
    checks = [{"case": "tiny", "splits": 1, "rel_err": 1e-6, "limit": 1e-5, "ok": True}]
    md = gpu.markdown_report(rows, env, 100.0, checks, gpu.check_targets(rows))
    json_path, md_path = gpu.write_results(tmp_path, {"environment": env, "rows": rows}, md)
    assert json_path.name == "gpu-nvidia-test-gpu-2026-01-02.json" and md_path.suffix == ".md"
    assert json.loads(json_path.read_text())["rows"][0]["method"] == "triton"
    assert md.count("\n| 2 | 24 |") == len(gpu.METHODS)


def test_gpu_benchmark_targets():
    from pagedlib.bench import gpu

    def row(method, b, c, s, pct, x):
        return {"method": method, "batch": b, "context": c, "seconds": s, "GB/s": 1.0, "% copy BW": pct,
                "x SDPA": x}

    rows = [row("triton", 8, 4096, 1e-4, 75.0, 0.95), row("triton", 1, 32768, 9e-4, 20.0, 0.5),
            row("triton split-K", 1, 32768, 2e-4, 60.0, 1.0), row("triton", 64, 512, 1e-4, 10.0, 0.1)]
    got = {t["target"]: t["ok"] for t in gpu.check_targets(rows)}
    assert got == {"triton b8 ctx4096 >= 70% copy BW": True, "triton b8 ctx4096 >= 0.9x SDPA": True,
                   "split-K >= 3x faster than no-split at b1 ctx32768": True}


def test_gpu_benchmark_correctness_phase():
    from pagedlib.bench import gpu

    cases = [(torch.float16, 64, 4, 2, [1, 9, 30]), (torch.bfloat16, 80, 8, 1, [17])]
    checks = gpu.correctness(DEVICE, cases)
    assert len(checks) == 2 * 3 and all(c["ok"] for c in checks), checks
