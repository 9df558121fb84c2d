"""Attention for a flat batch of query tokens (decodes, whole prompts, chunks of prompts after cached
tokens, mixed): the torch path and the Triton kernel (interpreter on a CPU) equal the float64 oracle and
SDPA with a causal mask; decode-only batches equal the decode paths; bad input is refused.

Shapes stay tiny: the interpreter executes every Triton op with numpy, one program at a time.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import check, varlen_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedlib  # noqa: F401  (sets TRITON_INTERPRET=1 before triton's first import when there is no CUDA)
from pagedlib.calibration import kv_scale
from pagedlib.core.fp8 import FP8_DTYPES, dequantize, quantize
from pagedlib.kernels.attention import REL_ERROR_LIMITS, TOLERANCES, paged_attention, rel_error
from pagedlib.kernels.cpu_varlen import paged_attention_varlen_cpu
from pagedlib.kernels.varlen import (
    attend_varlen,
    paged_attention_varlen,
    paged_attention_varlen_oracle,
    plan_varlen,
)

# after pagedlib, which picks Triton's mode before triton's first import
pytest.importorskip("triton", reason="Triton publishes Linux wheels only; the kernel tests need it")
from pagedlib.kernels.triton_decode import paged_attention_triton
from pagedlib.kernels.triton_varlen import paged_attention_varlen_triton

IMPLS = {"torch": paged_attention_varlen, "triton": paged_attention_varlen_triton,
         "cpu": paged_attention_varlen_cpu}
# the fused CPU kernel takes CPU tensors only (test_cpu_attention.py has its own tests, Triton or not)
IMPL_IDS = [pytest.param(i, marks=pytest.mark.skipif(i == "cpu" and torch.cuda.is_available(),
                                                     reason="the CPU kernel's tensors live on the CPU"))
            for i in IMPLS]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@st.composite
def batches(draw, max_seqs: int = 4, max_cached: int = 40, max_new: int = 24, head_dims=(16, 32, 80)):
    n = draw(st.integers(1, max_seqs))
    return {"cached": draw(st.lists(st.integers(0, max_cached), min_size=n, max_size=n)),
            "new": draw(st.lists(st.one_of(st.just(1), st.integers(1, max_new)), min_size=n, max_size=n)),
            "block_size": draw(st.sampled_from([1, 2, 4, 8, 16, 32])), "kv_heads": draw(st.integers(1, 2)),
            "group": draw(st.sampled_from([1, 2, 3, 4])), "head_dim": draw(st.sampled_from(head_dims)),
            "dtype": draw(st.sampled_from(DTYPES)), "share": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_torch_path_equals_the_oracle_and_sdpa_on_mixed_batches(case):
    cache, args = varlen_case(**case)
    check(paged_attention_varlen(*args), cache, args)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(max_seqs=3, max_cached=24, max_new=12, head_dims=(16, 80)))
def test_triton_kernel_equals_the_oracle_and_sdpa_on_mixed_batches(case):
    cache, args = varlen_case(**case)
    check(paged_attention_varlen_triton(*args), cache, args)


# (cached, new) per sequence at block size 4: chunks that start and end on block boundaries and mid-block
BOUNDARY = [([0], [8]), ([4], [4]), ([4], [3]), ([5], [3]), ([6], [5]), ([3], [1]), ([0], [1]),
            ([0, 8, 3, 7], [1, 4, 9, 1]), ([12, 0], [1, 13]), ([2, 2], [2, 6])]


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("cached,new", BOUNDARY)
def test_chunks_on_and_off_block_boundaries(impl, cached, new):
    cache, args = varlen_case(cached, new, block_size=4)
    check(IMPLS[impl](*args), cache, args)


@pytest.mark.parametrize("impl", IMPL_IDS)
def test_prefix_cached_sequences_read_the_shared_blocks(impl):
    cache, args = varlen_case([8, 0, 3], [4, 5, 1], block_size=4, share=True)
    tables = args[3]
    assert tables[1, 0] == tables[0, 0] == tables[2, 0] and tables[1, 1] == tables[0, 1]  # shared prefix
    check(IMPLS[impl](*args), cache, args)


@pytest.mark.parametrize("impl", IMPL_IDS)
def test_rows_follow_query_start_loc_whatever_the_order_of_decodes_and_chunks(impl):
    cache, args = varlen_case([9, 4, 0, 20], [6, 1, 3, 1], block_size=4)
    check(IMPLS[impl](*args), cache, args)


# dtype, head_dim, block_size, group, cached lengths: decode-only batches (one new token per sequence)
DECODE = [(torch.float32, 32, 8, 4, [0, 16, 44, 3]), (torch.float16, 64, 1, 1, [5, 0]),
          (torch.bfloat16, 80, 16, 3, [31, 2]), (torch.float16, 256, 128, 2, [130, 7])]


@pytest.mark.parametrize("dtype,head_dim,block_size,group,cached", DECODE)
def test_decode_only_batches_equal_the_decode_paths(dtype, head_dim, block_size, group, cached):
    cache, args = varlen_case(cached, [1] * len(cached), block_size=block_size, group=group,
                              head_dim=head_dim, dtype=dtype)
    dargs = args[:5]
    torch.testing.assert_close(paged_attention_varlen(*args), paged_attention(*dargs), **TOLERANCES[dtype])
    out = paged_attention_varlen_triton(*args)
    torch.testing.assert_close(out, paged_attention_triton(*dargs, num_splits=1), **TOLERANCES[dtype])
    check(out, cache, args)


def _bad_inputs():
    """(what, change to the arguments, a fragment of the error) for each refused input."""
    def with_(i, value):
        return lambda a: (*a[:i], value(a) if callable(value) else value, *a[i + 1:])

    i32 = torch.int32
    return [
        ("q 2-D", with_(0, lambda a: a[0][0]), "q must be a tensor of shape [T >= 1, q_heads, head_dim]"),
        ("q empty", with_(0, lambda a: a[0][:0]), "q must be a tensor of shape [T >= 1"),
        ("q list", with_(0, [[1.0]]), "q must be a tensor of shape"),
        ("qsl int64", with_(5, lambda a: a[5].long()), "query_start_loc must be an int32 tensor"),
        ("qsl list", with_(5, [0, 1, 2]), "query_start_loc must be an int32 tensor of shape [batch + 1]"),
        ("qsl one entry", with_(5, lambda a: a[5][:1]), "query_start_loc must be an int32 tensor"),
        ("qsl from 1", with_(5, lambda a: a[5] + 1), "query_start_loc must rise from 0"),
        ("qsl short of T", with_(5, lambda a: torch.tensor([0, 1, 2], dtype=i32)), "to T = 7 (q's rows)"),
        ("qsl flat", with_(5, lambda a: torch.tensor([0, 0, 7], dtype=i32)), "by at least 1 per sequence"),
        ("seq_lens short", with_(4, lambda a: a[4][:1]), "seq_lens must hold one length per sequence"),
        ("more new than stored", with_(4, lambda a: torch.tensor([5, 2], dtype=i32)),
         "sequence 1 has 3 new tokens in q but seq_lens[1] = 2"),
        ("seq_lens int64", with_(4, lambda a: a[4].long()), "seq_lens must be an int32 tensor"),
        ("bad block id", with_(3, lambda a: a[3].masked_fill(a[3] >= 0, 999)), "is not a block id"),
        ("k dtype", with_(1, lambda a: a[1].double()), "k_cache must have q's dtype"),
        ("v dtype", with_(2, lambda a: a[2].half()), "v_cache must have q's dtype torch.float32, got "
                                                     "torch.float16"),  # only an fp8 cache may differ
        ("v shape", with_(2, lambda a: a[2][:, :2]), "v_cache must have k_cache's shape"),
        ("heads", with_(0, lambda a: a[0][:, :3]), "q_heads (3) must be a multiple of the cache's kv_heads"),
    ]


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("what,change,message", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_bad_input_is_refused_with_a_message_naming_it(impl, what, change, message):
    _, args = varlen_case([1, 0], [4, 3], block_size=4)
    with pytest.raises(ValueError) as err:
        IMPLS[impl](*change(args))
    assert message in str(err.value)
    with pytest.raises(ValueError, match="scale must be None or a finite number"):
        IMPLS[impl](*args, scale=float("nan"))


def test_the_kernel_refuses_what_it_cannot_run():
    _, args = varlen_case([3], [2], block_size=3)
    paged_attention_varlen(*args)  # the torch path takes any block size
    with pytest.raises(ValueError, match="block_size must be a power of two from 1 to 128, got 3"):
        paged_attention_varlen_triton(*args)
    _, args = varlen_case([3], [2], block_size=4)
    q = args[0].clone().requires_grad_()
    with pytest.raises(ValueError, match="must not require grad: the Triton kernel has no backward pass"):
        paged_attention_varlen_triton(q, *args[1:])
    with torch.no_grad():
        assert torch.isfinite(paged_attention_varlen_triton(q, *args[1:])).all()


def test_attention_benchmark_times_mixed_steps(tmp_path):
    import json

    from pagedlib.bench.__main__ import main

    path = tmp_path / "attention.json"
    argv = ["attention", "--batch", "3", "--context", "24", "--q-heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--block-size", "4", "--chunks", "5,24", "--no-sweeps", "--repeats", "2",
            "--json", str(path)]
    assert main(argv) == 0
    mixed = json.loads(path.read_text())["mixed"]
    fused = ("pagedlib-fused",) if DEVICE == "cpu" else ()           # the fused CPU kernel: on a CPU
    assert [(r["impl"], r["chunk"]) for r in mixed] == [(i, c) for c in (5, 24) for i in
                                                         ("varlen", "split", *fused, "contiguous")]
    tables = json.loads(path.read_text())
    assert set(fused) <= {r["impl"] for r in tables["decode"]} & {r["impl"] for r in tables["prefill"]}
    for r in mixed:  # GB/s: every cached token once; speedup: contiguous time / time, at the same chunk
        base = next(b for b in mixed if b["impl"] == "contiguous" and b["chunk"] == r["chunk"])
        assert r["speedup vs SDPA (x faster)"] == pytest.approx(base["ms"] / r["ms"])
        assert r["GB/s"] == pytest.approx(2 * 3 * 24 * 2 * 16 * 4 / (r["ms"] / 1e3) / 1e9)


def test_attention_benchmark_refuses_a_chunk_longer_than_the_context(capsys):
    from pagedlib.bench.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["attention", "--context", "64", "--chunks", "8,65"])
    assert exit_info.value.code == 2
    assert "each chunk must be <= --context (64), got 65" in capsys.readouterr().err


def test_gpu_benchmark_varlen_parts_on_tiny_cpu_tensors():
    """The unified kernel's correctness phase and prefill table, with a stand-in timer."""
    from pagedlib.bench import gpu

    checks = gpu.varlen_correctness(DEVICE, [(torch.float16, 64, 4, 2, [(9, 1), (0, 6), (5, 7)]),
                                             (torch.bfloat16, 80, 8, 1, [(3, 1)])])
    assert len(checks) == 2 and all(c["ok"] for c in checks), checks

    def cpu_timer(calls, inner, repeats, graph=True):
        assert all(torch.isfinite(c()).all() for c in calls)
        return (2e-3 if graph else 1e-3), "cpu stand-in"

    shape = gpu.Shape(batch=2, context=12, q_heads=4, kv_heads=2, head_dim=16, block_size=4)
    pool = gpu.Pool(0.0002, shape, device=DEVICE)
    rows = gpu.prefill_rows(shape, pool, torch.Generator(device=DEVICE).manual_seed(0), timer=cpu_timer)
    assert [r["method"] for r in rows] == list(gpu.PREFILL_METHODS)
    by = {r["method"]: r for r in rows}
    assert by["triton varlen"]["tokens/s"] == pytest.approx(24 / 2e-3)
    assert by["torch varlen"][gpu.SPEEDUP] == pytest.approx(2.0)  # eager 1 ms vs graph 2 ms
    md = gpu.markdown_report([], {"device_name": "x"}, 1.0, checks, rows)
    assert "## Prefill" in md and md.count("\n| 2 | 12 |") == len(gpu.PREFILL_METHODS)


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("layout", ["heads outside slots", "padded head_dim"])
def test_caches_of_any_strides_give_the_same_result(impl, layout):
    """Both read pools of any strides: a memory layout with heads outside slots, a padded head_dim."""
    cache, args = varlen_case([6, 0, 9], [1, 5, 3], block_size=4, head_dim=16)
    q, k_cache, v_cache, *rest = args

    def relayout(x: torch.Tensor) -> torch.Tensor:
        if layout == "heads outside slots":                    # [num_blocks, kv_heads, block_size, D] memory
            return x.transpose(1, 2).contiguous().transpose(1, 2)
        wide = torch.full((*x.shape[:3], 17), float("nan"), dtype=x.dtype, device=x.device)
        wide[..., :16] = x
        return wide[..., :16]                                   # strides 17k

    moved = (q, relayout(k_cache), relayout(v_cache), *rest)
    assert moved[1].stride() != k_cache.stride()
    out = IMPLS[impl](*moved)
    torch.testing.assert_close(out, IMPLS[impl](*args), **TOLERANCES[q.dtype])
    check(out, cache, args)


def test_a_step_cut_into_one_call_per_sequence_gives_the_same_result(monkeypatch):
    from pagedlib.kernels import varlen

    cache, args = varlen_case([9, 4, 0, 20, 3], [6, 1, 3, 1, 1], block_size=4)
    whole = paged_attention_varlen(*args)
    monkeypatch.setattr(varlen, "CHUNK_BYTES", 0)  # every padded copy over budget: one sequence per call
    out = paged_attention_varlen(*args)
    torch.testing.assert_close(out, whole, **TOLERANCES[out.dtype])
    check(out, cache, args)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=24),
       st.sampled_from([1, 4, 16]))
def test_a_step_plan_covers_every_row_once_and_bounds_the_padding(seqs, block_size):
    """``plan_varlen``: every row of q in exactly one piece, decodes never with chunks, a piece's rows its
    sequences' in turn, and a piece of several sequences copies at most ``PAD_LIMIT`` times their blocks."""
    from pagedlib.kernels.varlen import PAD_LIMIT

    lens, starts = [c + n for c, n in seqs], [0, *itertools.accumulate(n for _, n in seqs)]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.tensor([[b * width + j if j < -(-n // block_size) else -1 for j in range(width)]
                           for b, n in enumerate(lens)], dtype=torch.int32)
    owner = [b for b, (_, n) in enumerate(seqs) for _ in range(n)]               # each row's sequence
    plan, seen = plan_varlen(tables, lens, starts, block_size, 1), []
    for p in plan:
        rows = list(range(starts[-1]))[p.rows] if isinstance(p.rows, slice) else p.rows.tolist()
        members = list(dict.fromkeys(owner[r] for r in rows))
        assert rows == [r for b in members for r in range(starts[b], starts[b + 1])]
        assert len({starts[b + 1] - starts[b] == 1 for b in members}) == 1 and p.seqs == len(members)
        own = sum(-(-lens[b] // block_size) for b in members)
        assert len(p.blocks) == p.seqs * -(-p.n // block_size) and p.n == max(lens[b] for b in members)
        assert p.seqs == 1 or len(p.blocks) <= PAD_LIMIT * own
        seen += rows
    assert sorted(seen) == list(range(starts[-1]))


@pytest.mark.parametrize("group,block_q", [(16, 4), (8, 8)])
def test_chunks_longer_than_a_query_block_span_several_programs(group, block_q):
    from pagedlib.kernels.triton_varlen import varlen_config

    assert varlen_config(16, group, decode=False)["BLOCK_Q"] == block_q
    cache, args = varlen_case([5, 0, 9, 2], [13, 1, 2 * block_q, 9], block_size=4, kv_heads=1, group=group)
    check(paged_attention_varlen_triton(*args), cache, args)


# an fp8 cache (notebook 10): decodes, a chunk that starts mid-block (9 cached at block size 4), a prompt
FP8_CASE = {"cached": [5, 9, 0, 3], "new": [1, 6, 7, 1], "block_size": 4}


def fp8_case(fmt: torch.dtype, per_head: bool, qdtype: torch.dtype) -> tuple[tuple, dict, tuple]:
    """``FP8_CASE``'s varlen arguments with the pools quantized to ``fmt`` (NaN slots stay NaN) and ``q`` in
    ``qdtype``, the scales (set from the data), and the same arguments with the pools dequantized into
    float32. K/V in about vLLM's test range (+-head_dim**-0.5, which its atol=1e-2 assumes), K's second
    head 4 times larger (an outlier head)."""
    _, (q, k, v, *rest) = varlen_case(**FP8_CASE)
    k = k * torch.tensor([0.25, 1.0], device=k.device)[:, None]               # [num_blocks, bs, H=2, D=16]
    v = v * 0.25
    scales = {"k_scale": kv_scale(k.nan_to_num(0.0), fmt, per_head),
              "v_scale": kv_scale(v.nan_to_num(0.0), fmt, per_head)}
    k8, v8 = quantize(k, scales["k_scale"], fmt), quantize(v, scales["v_scale"], fmt)
    q = q.to(qdtype)
    plain = (q.float(), dequantize(k8, scales["k_scale"]), dequantize(v8, scales["v_scale"]), *rest)
    return (q, k8, v8, *rest), scales, plain


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("fmt", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-tensor", "per-head"])
@pytest.mark.parametrize("qdtype", DTYPES)
def test_fp8_cache_matches_the_oracle_on_the_dequantized_cache(impl, fmt, per_head, qdtype):
    """test_fp8.py's tolerances: vLLM's atol=1e-2 against the float64 oracle; and, as for the prefill path
    (both dequantize into q's dtype, then compute as for any cache), the same call on pools dequantized
    into q's dtype within its tolerance."""
    args, scales, plain = fp8_case(fmt, per_head, qdtype)
    out = IMPLS[impl](*args, **scales)
    ref = paged_attention_varlen_oracle(*args, **scales)
    # the oracle multiplies in float64, dequantize in float32: equal to float32's rounding
    torch.testing.assert_close(ref, paged_attention_varlen_oracle(*plain), **TOLERANCES[torch.float32])
    assert out.dtype == qdtype and torch.isfinite(out).all()
    assert rel_error(out, ref) < REL_ERROR_LIMITS[qdtype]
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-5)  # vLLM's fp8 tolerance
    q, k, v, *rest = plain
    same = IMPLS[impl](q.to(qdtype), k.to(qdtype), v.to(qdtype), *rest)
    torch.testing.assert_close(out, same, **TOLERANCES[qdtype])


def test_fp8_steps_cut_into_pieces_and_decode_steps_match_the_other_paths(monkeypatch):
    """``attend_varlen`` (the engine's per-layer call) with one piece per sequence, and a decode-only
    step against the fp8 decode paths."""
    from pagedlib.kernels import varlen

    args, scales, _ = fp8_case(FP8_DTYPES[0], True, torch.float16)
    whole = paged_attention_varlen(*args, **scales)
    monkeypatch.setattr(varlen, "CHUNK_BYTES", 0)
    lens, starts = args[4].tolist(), args[5].tolist()
    plan = plan_varlen(args[3], lens, starts, args[1].shape[1], 2 * 2 * 16 * 2)
    assert [p.seqs for p in plan] == [1] * len(lens)                   # one piece per sequence
    pieces = attend_varlen(*args[:3], plan, args[0].shape[2] ** -0.5, scales["k_scale"], scales["v_scale"])
    torch.testing.assert_close(pieces, whole, **TOLERANCES[torch.float16])
    decode = (args[0][[0, 13]], *args[1:3], args[3][[0, 3]], args[4][[0, 3]])  # the two decode tokens
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    for fn, dec in ((paged_attention_varlen, paged_attention), (paged_attention_varlen_triton,
                                                                paged_attention_triton)):
        torch.testing.assert_close(fn(*decode, qsl, **scales), dec(*decode, **scales),
                                   **TOLERANCES[torch.float16])


@pytest.mark.parametrize("fn", [*IMPLS.values(), paged_attention_varlen_oracle],
                         ids=[*IMPLS, "oracle"])
def test_bad_scales_are_refused_as_the_decode_paths_refuse_them(fn):
    args, scales, _ = fp8_case(FP8_DTYPES[1], False, torch.float16)
    before = [t.clone() for t in args]
    for bad in (0, -1.0, float("nan"), True, "1", torch.tensor([1.0, 0.0]), torch.ones(3)):
        with pytest.raises(ValueError, match="v_scale must be None, a finite number > 0 or a tensor of "
                                             "kv_heads=2"):
            fn(*args, k_scale=scales["k_scale"], v_scale=bad)
    _, plain_args = varlen_case(**FP8_CASE)
    with pytest.raises(ValueError, match="k_scale applies to a float8 cache only, got 0.5 for a "
                                         "torch.float32 cache"):
        fn(*plain_args, k_scale=0.5)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(args, before))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel's check needs a CUDA device")
def test_an_e4m3_cache_is_refused_below_compute_capability_8_9(monkeypatch):
    args, scales, _ = fp8_case(FP8_DTYPES[0], False, torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for fn in (paged_attention_varlen_triton, lambda *a, **s: paged_attention_triton(*a[:5], **s)):
        with pytest.raises(ValueError, match="a float8_e4m3fn cache needs compute capability 8.9"):
            fn(*args, **scales)
