"""The fused Triton decode kernel equals the float64 oracle and ``paged_attention`` (CPU interpreter, or
compiled on a GPU when one is present); it rejects what ``paged_attention`` rejects, with the same message.

Shapes stay tiny: the interpreter executes every Triton op with numpy, one program at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from helpers import decode_args, filled_cache

import pagedlib  # noqa: F401  (sets TRITON_INTERPRET=1 before triton's first import when there is no CUDA)

# after pagedlib, which picks Triton's mode before triton's first import
pytest.importorskip("triton", reason="Triton publishes Linux wheels only; the kernel tests need it")
from pagedlib.kernels.attention import (
    REL_ERROR_LIMITS,
    TOLERANCES,
    paged_attention,
    paged_attention_oracle,
    rel_error,
)
from pagedlib.kernels.triton_decode import (
    MAX_SPLITS,
    choose_num_splits,
    launch_decode,
    paged_attention_triton,
)
from pagedlib.kernels.triton_mode import interpreting

# the kernel runs where its inputs live: CUDA tensors (compiled) when there is a GPU, else the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(lens: list[int], *, kv_heads: int, group: int, head_dim: int, block_size: int,
              dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``paged_attention``'s arguments for layer 1 of a 2-layer cache (strided views) on ``DEVICE``, NaN
    in every slot that holds no token."""
    cache = filled_cache(lens, block_size, kv_heads, head_dim, dtype, seed=seed, device=DEVICE)
    return decode_args(cache, kv_heads * group, seed=seed + 1)


def check(out: torch.Tensor, args: tuple, scale: float | None = None) -> None:
    """``out`` is within the kernel limits of the float64 oracle and close to ``paged_attention``."""
    q = args[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from an unused slot leaked into the result"
    assert rel_error(out, paged_attention_oracle(*args, scale=scale)) < REL_ERROR_LIMITS[q.dtype]
    torch.testing.assert_close(out, paged_attention(*args, scale=scale), **TOLERANCES[q.dtype])


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
def test_matches_the_float64_oracle(params):
    dtype, head_dim, block_size, group, kv_heads, lens, splits = params
    args = make_case(lens, kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                     dtype=dtype)
    check(paged_attention_triton(*args, num_splits=splits), args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [2, 3, 7])
def test_split_k_agrees_with_no_split(dtype, splits):
    # 7 splits of a 20-token sequence leave splits with no tokens at all: the merge must ignore them
    args = make_case([70, 20, 1], kv_heads=2, group=2, head_dim=64, block_size=8, dtype=dtype, seed=splits)
    parts = paged_attention_triton(*args, num_splits=splits)
    torch.testing.assert_close(parts, paged_attention_triton(*args, num_splits=1), **TOLERANCES[dtype])
    check(parts, args)


@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_arithmetic_for_fp16_through_the_interpreter(splits):
    # On a GPU the dot operands stay fp16 (the probabilities p are rounded to fp16 before p @ v); the
    # interpreter upcasts them by default. Run the GPU's variant here too: it must still meet the limit.
    if torch.cuda.is_available():
        pytest.skip("the compiled kernel runs these numerics on a GPU")
    args = make_case([70, 20, 1], kv_heads=2, group=4, head_dim=80, block_size=8, dtype=torch.float16)
    check(launch_decode(*args, None, splits, dot_fp32=False), args)


def test_custom_scale():
    args = make_case([20, 9], kv_heads=2, group=2, head_dim=64, block_size=8)
    out = paged_attention_triton(*args, scale=0.3)
    check(out, args, scale=0.3)
    assert rel_error(out, paged_attention_oracle(*args)) > 1e-3, "the scale argument was ignored"


def test_strided_query_tables_and_lengths():
    # every argument may be a view: q a slice of a bigger tensor, tables wider than needed (extra -1
    # columns) and taken from a 3-D tensor, lengths a column of a 2-D one
    q, k, v, tables, lens = make_case([13, 30], kv_heads=2, group=2, head_dim=64, block_size=8,
                                      dtype=torch.float16)
    q_big = torch.zeros(2, 4, 2, 64, dtype=q.dtype, device=DEVICE)
    q_big[:, :, 1] = q
    wide = torch.cat([tables, torch.full((2, 5), -1, dtype=torch.int32, device=DEVICE)], dim=1)
    tables3d = torch.stack([wide, torch.full_like(wide, -1)], dim=2)     # [batch, blocks, 2]
    lens2d = torch.stack([lens, torch.zeros_like(lens)], dim=1)          # [batch, 2]
    strided = (q_big[:, :, 1], k, v, tables3d[:, :, 0], lens2d[:, 0])
    assert not any(t.is_contiguous() for t in strided)
    for splits in (1, 3):
        check(paged_attention_triton(*strided, num_splits=splits), strided)


def test_never_writes_its_inputs():
    args = make_case([13, 30], kv_heads=2, group=2, head_dim=64, block_size=8)
    before = [t.clone() for t in args]
    for splits in (1, 3):
        paged_attention_triton(*args, num_splits=splits)
    for old, new in zip(before, args):
        torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)


def test_threads_may_call_it_at_once():
    # the interpreter keeps global state while it runs a kernel: unserialised, two threads fail
    jobs = [make_case([9, 12], kv_heads=2, group=2, head_dim=16, block_size=4, seed=s) for s in range(4)]
    want = [paged_attention_triton(*a, num_splits=2) for a in jobs]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(4):
                torch.testing.assert_close(paged_attention_triton(*jobs[i], num_splits=2), want[i])
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def _bad_inputs(args: tuple) -> dict[str, tuple]:
    """Arguments ``paged_attention`` rejects, each broken in one way."""
    q, k, v, tables, lens = args
    too_long, bad_entry = lens.clone(), tables.clone()
    too_long[1] = 10_000
    bad_entry[0, 0] = k.shape[0]
    return {
        "q is 2-D": (q[0], k, v, tables, lens),
        "q has a token axis": (q[:, None], k, v, tables, lens),
        "q has two tokens of one sequence": (q[:1].expand(2, -1, -1), k, v, tables[:1], lens[:1]),
        "q_heads not a multiple of kv_heads": (q[:, :3], k, v, tables, lens),
        "k_cache of another dtype": (q, k.half(), v, tables, lens),
        "block size 0": (q, k[:, :0], v[:, :0], tables, lens),
        "int64 block table": (q, k, v, tables.long(), lens),
        "length 0": (q, k, v, tables, torch.zeros_like(lens)),
        "length beyond the table": (q, k, v, tables, too_long),
        "table entry out of range": (q, k, v, bad_entry, lens),
    }


def test_rejects_what_paged_attention_rejects_with_the_same_message():
    args = make_case([5, 3], kv_heads=2, group=2, head_dim=64, block_size=4)
    for what, bad in _bad_inputs(args).items():
        with pytest.raises(ValueError) as expected:
            paged_attention(*bad)
        with pytest.raises(ValueError) as got:
            paged_attention_triton(*bad)
        assert str(got.value) == str(expected.value), what
    with pytest.raises(ValueError, match="scale must be None or a finite number > 0, got 'x'"):
        paged_attention_triton(*args, scale="x")


def test_kernel_limits_raise_clear_errors():
    args = make_case([5, 3], kv_heads=2, group=2, head_dim=64, block_size=4)
    for bad in (0, MAX_SPLITS + 1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="num_splits must be"):
            paged_attention_triton(*args, num_splits=bad)
    check(paged_attention_triton(*args, num_splits=np.int64(2)), args)
    with pytest.raises(ValueError, match="head_dim must be at most 256"):
        paged_attention_triton(*make_case([3], kv_heads=1, group=1, head_dim=320, block_size=4))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        paged_attention_triton(*make_case([5], kv_heads=1, group=1, head_dim=64, block_size=3))
    q, k, v, tables, lens = args
    with pytest.raises(ValueError, match="q must have a dtype in"):
        paged_attention_triton(q.double(), k.double(), v.double(), tables, lens)


def test_refuses_inputs_that_require_grad_while_autograd_records():
    q, k, v, tables, lens = make_case([5, 3], kv_heads=2, group=2, head_dim=64, block_size=4)
    for grad_q, grad_k in ((True, False), (False, True)):
        with pytest.raises(ValueError, match="no backward pass"):
            paged_attention_triton(q.clone().requires_grad_(grad_q), k.clone().requires_grad_(grad_k), v,
                                   tables, lens)
    with torch.no_grad():
        out = paged_attention_triton(q.clone().requires_grad_(True), k, v, tables, lens)
    check(out, (q, k, v, tables, lens))


# --- the split heuristic -------------------------------------------------------------------------


def test_no_split_when_the_batch_already_fills_the_gpu():
    assert choose_num_splits(batch=64, kv_heads=8, max_context=32768, sm_count=132) == 1
    assert choose_num_splits(batch=256, kv_heads=8, max_context=4096, sm_count=132) == 1


def test_long_context_small_batch_fills_about_two_waves():
    n = choose_num_splits(batch=1, kv_heads=8, max_context=32768, sm_count=132)
    assert 2 * 132 <= 8 * n < 2 * 132 + 8, n  # the fewest splits that cover two waves
    assert choose_num_splits(batch=1, kv_heads=1, max_context=1 << 20, sm_count=132) == MAX_SPLITS


def test_the_split_heuristic_names_a_bad_argument():
    assert choose_num_splits(np.int64(1), 8, 32768, np.int32(132)) == choose_num_splits(1, 8, 32768, 132)
    for kw, name in (({"batch": True}, "batch"), ({"kv_heads": 0}, "kv_heads"),
                     ({"sm_count": 1.5}, "sm_count")):
        args = {"batch": 1, "kv_heads": 8, "max_context": 4096, "sm_count": 132, **kw}
        with pytest.raises(ValueError, match=f"{name} must be"):
            choose_num_splits(**args)


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
            "from pagedlib.kernels.triton_decode import paged_attention_triton as f\n"
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


def test_gpu_benchmark_replay_plan_leaves_l2():
    from pagedlib.bench import gpu

    l2 = 50 * 2**20
    for batch in (1, 8, 64, 256):
        for context in (512, 4096, 32768):
            nbytes = gpu.Shape(batch, context).kv_bytes
            inner, sets = gpu.replay_plan(nbytes, l2)
            assert 1 <= sets <= inner
            # a replay's working set is beyond L2, unless every call of it already has its own inputs
            assert sets * nbytes >= 3 * l2 or sets == inner
    assert gpu.Shape(256, 32768).kv_bytes == 2 * 256 * 32768 * 8 * 128 * 2


def test_gpu_benchmark_pipeline_on_tiny_cpu_tensors(tmp_path):
    """run_shape -> finish_rows -> JSON + markdown on tiny tensors, with a stand-in timer."""
    import json

    from pagedlib.bench import gpu

    def cpu_timer(calls, inner, repeats, graph=True):
        outs = [c() for c in calls]
        assert all(torch.isfinite(o).all() for o in outs)
        return (4e-3 if graph else 1e-3), "cpu stand-in"

    shape = gpu.Shape(batch=2, context=24, q_heads=4, kv_heads=2, head_dim=16, block_size=4)  # fp16: flash
    pool = gpu.Pool(0.0002, shape, device=DEVICE)
    rows = gpu.run_shape(shape, pool, 2**16, torch.Generator(device=DEVICE).manual_seed(0), repeats=1,
                         timer=cpu_timer)
    assert [r["method"] for r in rows] == list(gpu.METHODS)
    assert "triton rel. diff" in rows[-1]["note"] and float(rows[-1]["note"].split()[-1]) < 2e-3
    rows = gpu.finish_rows(rows, copy_gbps=100.0)
    by = {r["method"]: r for r in rows}
    assert by["sdpa contiguous"][gpu.SPEEDUP] == 1.0
    assert by["torch gather"][gpu.SPEEDUP] == pytest.approx(4.0)  # eager 1 ms vs graph 4 ms
    for r in rows:
        if "seconds" in r:
            assert r["GB/s"] == pytest.approx(shape.kv_bytes / r["seconds"] / 1e9)
            assert r["% copy BW"] == pytest.approx(r["GB/s"])  # copy bandwidth 100 GB/s
        else:
            assert r["note"], "a row without a time must say why"
    env = {"device_name": "NVIDIA Test GPU", "torch": torch.__version__, "triton": "x", "date": "2026-01-02"}
    checks = [{"case": "tiny", "splits": 1, "rel_err": 1e-6, "limit": 1e-5, "ok": True}]
    md = gpu.markdown_report(rows, env, 100.0, checks)
    json_path, md_path = gpu.write_results(tmp_path, {"environment": env, "rows": rows}, md)
    assert json_path.name == "gpu-nvidia-test-gpu-2026-01-02.json" and md_path.read_text() == md
    assert json.loads(json_path.read_text())["rows"][0]["method"] == "triton"
    assert md.count("\n| 2 | 24 |") == len(gpu.METHODS)


def test_gpu_benchmark_correctness_phase():
    from pagedlib.bench import gpu

    cases = [(torch.float16, 64, 4, 2, [1, 9, 30]), (torch.bfloat16, 80, 8, 1, [17])]
    checks = gpu.correctness(DEVICE, cases)
    assert len(checks) == 2 * 3 and all(c["ok"] for c in checks), checks
