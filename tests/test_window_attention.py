"""Sliding-window attention through every varlen path (notebook 15): the torch path, the Triton kernel
(interpreter on a CPU) and the fused C kernel equal the float64 oracle for windows that are and are not a
multiple of the block size, a window of 1 and one longer than the sequence, decodes and prompt chunks
mixed, GQA, fp8; the oracle equals an explicit softmax over each query's window. Every slot no query's
window reaches is NaN and the table entries of blocks wholly before the windows are ``NULL_BLOCK``: the
outputs stay finite and equal the oracle on the clean cache. ``Step`` keeps one plan per window.

Shapes stay tiny: the interpreter executes every Triton op with numpy, one program at a time."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import varlen_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedlib  # noqa: F401  (sets TRITON_INTERPRET=1 before triton's first import when there is no CUDA)
from pagedlib.calibration import kv_scale
from pagedlib.core.fp8 import FP8_DTYPES, quantize
from pagedlib.core.groups import NULL_BLOCK
from pagedlib.kernels.attention import REL_ERROR_LIMITS, TOLERANCES, rel_error, sliding_window_attention
from pagedlib.kernels.cpu_varlen import attend_cpu, cpu_kernel_available, paged_attention_varlen_cpu
from pagedlib.kernels.varlen import (
    PAD_LIMIT,
    Step,
    paged_attention_varlen,
    paged_attention_varlen_oracle,
    plan_varlen,
)

# after pagedlib, which picks Triton's mode before triton's first import
pytest.importorskip("triton", reason="Triton publishes Linux wheels only; the kernel tests need it")
from pagedlib.kernels.triton_varlen import paged_attention_varlen_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
IMPLS = {"torch": paged_attention_varlen, "triton": paged_attention_varlen_triton,
         "cpu": paged_attention_varlen_cpu}
IMPL_IDS = [pytest.param(i, marks=pytest.mark.skipif(i == "cpu" and torch.cuda.is_available(),
                                                     reason="the CPU kernel's tensors live on the CPU"))
            for i in IMPLS]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernel():
    """The C kernel built once (it compiles at first use); the tests need it here."""
    available, why = cpu_kernel_available()
    assert available or torch.cuda.is_available(), why


def first_keys(lens: list[int], new: list[int], window: int) -> list[int]:
    """Each sequence's first key a new token sees: its first new token's window start."""
    return [max(0, n - m - window + 1) for n, m in zip(lens, new)]


def poisoned(args: tuple, window: int, null: str = "all") -> tuple:
    """``args`` with every slot of the pools that no new token's window reaches NaN (blocks wholly before
    the windows and the slots before a window in its first block; fp8: a NaN byte), and the table entries
    of blocks wholly before a sequence's windows ``NULL_BLOCK`` (``null``: "all", "some" (every other one),
    or "none"). ``args`` itself is left as it was: the clean cache."""
    q, k, v, tables, lens, qsl = args
    block_size = k.shape[1]
    lens_, new = lens.tolist(), qsl.diff().tolist()
    seen = torch.zeros(k.shape[:2], dtype=torch.bool, device=k.device)       # [num_blocks, block_size]
    nulled = tables.clone()
    for b, first in enumerate(first_keys(lens_, new, window)):
        for p in range(first, lens_[b]):
            seen[tables[b, p // block_size], p % block_size] = True
        for j in range(first // block_size):
            if null == "all" or (null == "some" and j % 2 == 0):
                nulled[b, j] = NULL_BLOCK
    k, v = k.clone(), v.clone()
    for x in (k, v):
        if x.dtype in FP8_DTYPES:
            x.view(torch.uint8)[~seen] = 0x7F                                  # NaN in e4m3 and e5m2
        else:
            x[~seen] = float("nan")
    assert bool(k.float().isnan()[~seen].all()) and not bool(k.float()[seen].isnan().any())
    return q, k, v, nulled, lens, qsl


def brute_force(q, k, v, tables, lens, qsl, window: int | None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
    """Query row by row and head by head: the keys ``p - window < t <= p`` read one by one through the
    table, ``softmax`` written out with ``math.exp`` in float64."""
    q_heads, head_dim = q.shape[1:]
    block_size, kv_heads = k.shape[1:3]
    group = q_heads // kv_heads
    ks = torch.as_tensor(k_scale, dtype=torch.float64).expand(kv_heads)
    vs = torch.as_tensor(v_scale, dtype=torch.float64).expand(kv_heads)
    out = torch.empty(q.shape, dtype=torch.float64)
    starts = qsl.tolist()
    for b, n in enumerate(lens.tolist()):
        m = starts[b + 1] - starts[b]
        for i in range(m):
            p = n - m + i
            keys = [t for t in range(n) if t <= p and (window is None or t > p - window)]
            for h in range(q_heads):
                kv = h // group
                rows = [(tables[b, t // block_size].item(), t % block_size) for t in keys]
                kk = [k[blk, slot, kv].double().cpu() * ks[kv] for blk, slot in rows]
                vv = [v[blk, slot, kv].double().cpu() * vs[kv] for blk, slot in rows]
                logits = [float(q[starts[b] + i, h].double().cpu() @ x) / math.sqrt(head_dim) for x in kk]
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                out[starts[b] + i, h] = sum(w * x for w, x in zip(weights, vv)) / sum(weights)
    return out


def check_window(out: torch.Tensor, clean: tuple, window: int | None, **scales) -> None:
    """``out`` of ``q``'s shape and dtype, finite, and equal to the oracle on the ``clean`` arguments."""
    q = clean[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from a slot outside every window reached the output"
    ref = paged_attention_varlen_oracle(*clean, window=window, **scales)
    assert rel_error(out, ref) < REL_ERROR_LIMITS[q.dtype]
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[q.dtype])


# (cached, new) at block size 4: decodes and chunks mixed, varied counts; chunks mid-block; a long decode
MIXED = ([0, 9, 20, 3, 14, 30], [7, 1, 6, 1, 12, 1])
WINDOWS = [1, 2, 3, 4, 5, 8, 12, 13, 50, 1000]  # multiples of the block size 4 and not; longer than any


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("window", WINDOWS)
def test_every_path_equals_the_oracle_and_ignores_nan_outside_the_windows(impl, window):
    _, clean = varlen_case(*MIXED, block_size=4)
    args = poisoned(clean, window)
    if window <= 13:  # the case has blocks wholly before some window: given back, their entries NULL
        assert (args[3] == NULL_BLOCK).sum() > (clean[3] == NULL_BLOCK).sum()
    check_window(IMPLS[impl](*args, window=window), clean, window)


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,kv_heads", [(1, 2), (3, 1), (4, 2)])
def test_dtypes_and_gqa_groups_with_some_blocks_given_back(impl, dtype, group, kv_heads):
    _, clean = varlen_case([13, 0, 6], [1, 9, 5], block_size=4, group=group, kv_heads=kv_heads, dtype=dtype,
                           seed=3)
    args = poisoned(clean, 6, null="some")
    check_window(IMPLS[impl](*args, window=6), clean, 6)


@pytest.mark.parametrize("impl", IMPL_IDS)
def test_shared_prefix_blocks_and_long_chunks_that_span_several_programs(impl):
    """A prefix-cache hit (blocks shared by forks) and chunks longer than a Triton query block: a program's
    walk starts at its own first row's window, rows after it see later keys only. With one query head per
    KV head a Triton program holds 64 tokens, twice its tile of keys: its last rows see no key of its first
    tile (a window of 1 or 7)."""
    _, clean = varlen_case([8, 5, 0], [3, 70, 23], block_size=8, share=True, kv_heads=1, group=1, seed=5)
    for window in (1, 7, 16, 21):
        args = poisoned(clean, window)
        check_window(IMPLS[impl](*args, window=window), clean, window)


@pytest.mark.parametrize("impl", IMPL_IDS)
def test_no_window_is_full_causal_attention(impl):
    _, args = varlen_case(*MIXED, block_size=4)
    out = IMPLS[impl](*args, window=None)
    assert torch.equal(out, IMPLS[impl](*args))
    torch.testing.assert_close(paged_attention_varlen_oracle(*args, window=None),
                               paged_attention_varlen_oracle(*args, window=10**6), rtol=0, atol=0)


@pytest.mark.parametrize("window", [None, 1, 3, 4, 7, 100])
def test_the_oracle_equals_an_explicit_softmax_over_each_window(window):
    _, args = varlen_case([0, 9, 6, 3], [5, 1, 7, 1], block_size=4, group=3, kv_heads=1, seed=7)
    torch.testing.assert_close(paged_attention_varlen_oracle(*args, window=window),
                               brute_force(*args, window).to(DEVICE), rtol=1e-12, atol=1e-12)


def test_the_oracle_never_reads_blocks_given_back():
    _, clean = varlen_case([20, 9], [3, 1], block_size=4, seed=2)
    args = poisoned(clean, 5)
    assert (args[3] == NULL_BLOCK).any()
    ref = paged_attention_varlen_oracle(*args, window=5)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(ref, brute_force(*clean, 5).to(DEVICE), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [1, 4, 6, 100])
def test_decode_steps_equal_the_decode_only_window_path(window):
    """``sliding_window_attention`` (notebook 04's decode-only window) as a second torch reference."""
    _, args = varlen_case([0, 16, 43, 3], [1, 1, 1, 1], block_size=8, group=4, seed=9)
    ref = sliding_window_attention(*args[:5], window)
    for impl in IMPLS:
        if impl == "cpu" and DEVICE != "cpu":
            continue
        torch.testing.assert_close(IMPLS[impl](*poisoned(args, window), window=window), ref,
                                   **TOLERANCES[torch.float32])


@st.composite
def window_batches(draw, max_seqs: int = 4, max_cached: int = 40, max_new: int = 24, head_dims=(16, 32, 80)):
    n = draw(st.integers(1, max_seqs))
    return {"cached": draw(st.lists(st.integers(0, max_cached), min_size=n, max_size=n)),
            "new": draw(st.lists(st.one_of(st.just(1), st.integers(1, max_new)), min_size=n, max_size=n)),
            "block_size": draw(st.sampled_from([1, 2, 4, 8, 16])), "kv_heads": draw(st.integers(1, 2)),
            "group": draw(st.sampled_from([1, 2, 3, 4])), "head_dim": draw(st.sampled_from(head_dims)),
            "dtype": draw(st.sampled_from(DTYPES)), "share": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window_batches(), st.integers(1, 70), st.sampled_from(["all", "some", "none"]))
def test_torch_and_cpu_paths_on_random_steps_and_windows(case, window, null):
    _, clean = varlen_case(**case)
    args = poisoned(clean, window, null)
    check_window(paged_attention_varlen(*args, window=window), clean, window)
    if DEVICE == "cpu":
        check_window(paged_attention_varlen_cpu(*args, window=window), clean, window)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window_batches(max_seqs=3, max_cached=24, max_new=12, head_dims=(16,)), st.integers(1, 30))
def test_triton_kernel_on_random_steps_and_windows(case, window):
    _, clean = varlen_case(**case)
    check_window(paged_attention_varlen_triton(*poisoned(clean, window), window=window), clean, window)


def fp8_window_case(fmt: torch.dtype, window: int) -> tuple[tuple, tuple, dict]:
    """A mixed step with its pools quantized to ``fmt`` (per-head scales from the data): the clean
    arguments, the poisoned ones, the scales."""
    _, (q, k, v, *rest) = varlen_case([5, 17, 0, 11], [1, 6, 7, 1], block_size=4, seed=4)
    k, v = k * 0.25, v * 0.25                                # about vLLM's test range, as test_fp8.py
    scales = {"k_scale": kv_scale(k.nan_to_num(0.0), fmt, True),
              "v_scale": kv_scale(v.nan_to_num(0.0), fmt, True)}
    clean = (q, quantize(k, scales["k_scale"], fmt), quantize(v, scales["v_scale"], fmt), *rest)
    return clean, poisoned(clean, window), scales


@pytest.mark.parametrize("impl", IMPL_IDS)
@pytest.mark.parametrize("fmt", FP8_DTYPES, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("window", [1, 5, 8])
def test_fp8_caches_with_a_window(impl, fmt, window):
    """test_fp8.py's tolerance (vLLM's atol=1e-2) against the float64 oracle on the clean fp8 cache."""
    clean, args, scales = fp8_window_case(fmt, window)
    out = IMPLS[impl](*args, **scales, window=window)
    ref = paged_attention_varlen_oracle(*clean, **scales, window=window)
    assert torch.isfinite(out).all() and rel_error(out, ref) < REL_ERROR_LIMITS[torch.float32]
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-5)
    torch.testing.assert_close(ref, brute_force(*clean, window, **scales).to(DEVICE), rtol=1e-12, atol=1e-12)


def _step(args: tuple, attention: str) -> Step:
    """A ``Step`` of ``args``' tables, lengths and rows (its token fields unused by ``attend``)."""
    empty = torch.empty(0, dtype=torch.long)
    return Step(tokens=empty, positions=empty, blocks=empty, offsets=empty, query_start_loc=args[5],
                block_tables=args[3], seq_lens=args[4], attention=attention)


def test_a_step_keeps_one_plan_per_window_and_its_layers_share_them():
    """Layers of different windows in turn through one ``Step``: each window planned once, at its first
    layer; every layer equals ``paged_attention_varlen`` with its window."""
    _, clean = varlen_case(*MIXED, block_size=4)
    args = poisoned(clean, 5, null="none")  # NaN outside window 5's reach; 9 and None reach further
    step = _step(clean, "torch")
    outs = {}
    for window in (5, None, 9, 5, None, 9):
        out = step.attend(*clean[:3], 1.0, 1.0, window=window)
        if window in outs:
            assert torch.equal(out, outs[window])
        outs[window] = out
        assert set(step.plans) == set(outs)
        torch.testing.assert_close(out, paged_attention_varlen(*clean, window=window), rtol=0, atol=0)
    plans = dict(step.plans)
    step.attend(*clean[:3], 1.0, 1.0, window=9)
    assert all(step.plans[w] is plans[w] for w in plans)                      # kept, not made again
    assert max(p.n for p in plans[5]) < max(p.n for p in plans[9]) < max(p.n for p in plans[None])
    narrow = _step(args, "torch").attend(*args[:3], 1.0, 1.0, window=5)      # its copies skip the NaN
    check_window(narrow, clean, 5)


@pytest.mark.parametrize("attention", ["triton", "cpu"])
def test_a_step_passes_its_window_to_the_fused_kernels(attention):
    if attention == "cpu" and DEVICE != "cpu":
        pytest.skip("the CPU kernel's tensors live on the CPU")
    _, clean = varlen_case(*MIXED, block_size=4)
    args = poisoned(clean, 7)  # outside window 7's reach, so outside window 4's too
    step = _step(args, attention)
    for window in (4, 7):
        check_window(step.attend(*args[:3], 1.0, 1.0, window=window), clean, window)
    assert step.plans == {}
    full = _step(clean, attention).attend(*clean[:3], 1.0, 1.0)
    torch.testing.assert_close(full, paged_attention_varlen(*clean), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("fn", [*IMPLS.values(), paged_attention_varlen_oracle], ids=[*IMPLS, "oracle"])
@pytest.mark.parametrize("bad,message", [
    (0, "window must be >= 1, got 0"), (-3, "window must be >= 1, got -3"),
    (2.5, "window must be an int, got 2.5"), (True, "window must be an int, got a bool"),
    ("4", "window must be an int, got '4'")])
def test_a_bad_window_is_refused_by_name(fn, bad, message):
    if fn is paged_attention_varlen_cpu and DEVICE != "cpu":
        pytest.skip("the CPU kernel's tensors live on the CPU")
    _, args = varlen_case([3, 0], [1, 4], block_size=4)
    with pytest.raises(ValueError, match=message):
        fn(*args, window=bad)
    with pytest.raises(ValueError, match=message):
        _step(args, "torch").attend(*args[:3], 1.0, 1.0, window=bad)


@pytest.mark.parametrize("fn", [*IMPLS.values(), paged_attention_varlen_oracle], ids=[*IMPLS, "oracle"])
def test_null_blocks_only_where_every_window_has_left(fn):
    """-1 passes only before the first new token's window, and only with a window; -2 or an id past the
    pool never passes. Sequence 0 holds 20 tokens (blocks 0-4 at block size 4), its 2 new tokens at
    positions 18 and 19; with window 7 the first sees positions 12.. (block 3 on)."""
    if fn is paged_attention_varlen_cpu and DEVICE != "cpu":
        pytest.skip("the CPU kernel's tensors live on the CPU")
    _, args = varlen_case([18, 2], [2, 1], block_size=4)
    q, k, v, tables, lens, qsl = args

    def with_entry(j: int, value: int) -> tuple:
        t = tables.clone()
        t[0, :j] = NULL_BLOCK
        t[0, j] = value
        return q, k, v, t, lens, qsl

    fn(*with_entry(2, NULL_BLOCK), window=7)                                  # blocks 0-2: all given back
    refused = [(with_entry(3, NULL_BLOCK), 7, r"block_tables\[0, 3\] = -1 is not a block id .* with window "
                                              r"7, only blocks wholly before position 12"),
               (with_entry(0, NULL_BLOCK), None, r"block_tables\[0, 0\] = -1 is not a block id"),
               (with_entry(1, -2), 7, r"block_tables\[0, 1\] = -2 is not a block id"),
               (with_entry(1, k.shape[0]), 7, rf"block_tables\[0, 1\] = {k.shape[0]} is not a block id")]
    for bad, window, message in refused:
        with pytest.raises(ValueError, match=message):
            fn(*bad, window=window)


def test_the_unchecked_cpu_path_never_reads_a_null_block_a_window_needs():
    """``attend_cpu`` (the engine's path, no checks) walks from the first block a window reaches: -1 before
    it is never fetched; -1 where a key is needed is refused by the kernel itself."""
    if DEVICE != "cpu":
        pytest.skip("the CPU kernel's tensors live on the CPU")
    _, clean = varlen_case([18, 2], [2, 1], block_size=4)
    q, k, v, tables, lens, qsl = poisoned(clean, 7)
    check_window(attend_cpu(q, k, v, tables, lens, qsl, 16**-0.5, window=7), clean, 7)
    with pytest.raises(ValueError, match="block_tables names a block outside the pool"):
        attend_cpu(q, k, v, tables, lens, qsl, 16**-0.5, window=8)            # 8 reaches position 11


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), min_size=1, max_size=16),
       st.sampled_from([1, 4, 16]), st.integers(1, 120))
def test_a_windowed_plan_copies_from_the_first_block_a_window_reaches(seqs, block_size, window):
    """``plan_varlen`` with a window: every row in one piece, no NULL entry ever copied, each sequence's
    copy starting at its first reached block, the padding bound of the plain plan on those spans."""
    lens, new = [c + n for c, n in seqs], [n for _, n in seqs]
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    firsts = [f // block_size for f in first_keys(lens, new, window)]
    width = max(-(-n // block_size) for n in lens)
    tables = torch.tensor([[NULL_BLOCK if j < f else b * width + j if j < -(-n // block_size) else -1
                            for j in range(width)] for b, (n, f) in enumerate(zip(lens, firsts))],
                          dtype=torch.int32)
    spans = [n - f * block_size for n, f in zip(lens, firsts)]
    owner = [b for b, m in enumerate(new) for _ in range(m)]
    seen = []
    for p in plan_varlen(tables, lens, starts, block_size, 1, window):
        rows = list(range(starts[-1]))[p.rows] if isinstance(p.rows, slice) else p.rows.tolist()
        members = list(dict.fromkeys(owner[r] for r in rows))
        copied = p.blocks.view(p.seqs, -1).tolist()
        assert (p.blocks >= 0).all() and p.n == max(spans[b] for b in members)
        for b, blocks in zip(members, copied):                      # its own blocks from firsts[b], then 0s
            held = -(-spans[b] // block_size)
            assert blocks == tables[b, firsts[b]:firsts[b] + held].tolist() + [0] * (len(blocks) - held)
        assert p.seqs == 1 or len(p.blocks) <= PAD_LIMIT * sum(-(-spans[b] // block_size) for b in members)
        seen += rows
    assert sorted(seen) == list(range(starts[-1]))
