"""Attention through block tables: the vectorized paged path, the per-token reference, the float64 oracle
and SDPA on contiguous K/V all agree, whatever sits in the slots that hold no token; bad input gets a
``ValueError`` naming the argument; inputs are never written; memory stays bounded by ``chunk_bytes``.

Tolerances: ``pagedlib.kernels.attention.TOLERANCES`` (the article's absolute ones plus about one ulp).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import decode_args, filled_cache

from pagedlib.core.cache import PagedKVCache
from pagedlib.kernels import attention
from pagedlib.kernels.attention import (
    TOLERANCES,
    check_paged_inputs,
    contiguous_attention,
    default_chunk_bytes,
    kv_bytes,
    paged_attention,
    paged_attention_oracle,
    paged_prefill_attention,
    plan_chunks,
    reference_paged_attention,
)


def close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` (``dtype``) equals ``want`` (any dtype, e.g. the float64 oracle) at ``dtype``'s tolerance."""
    torch.testing.assert_close(out.double(), want.double(), **TOLERANCES[dtype])


def sdpa_per_sequence(cache: PagedKVCache, layer: int, q: torch.Tensor) -> torch.Tensor:
    """SDPA on each sequence's contiguous K/V (``cache.gather``): ``[batch, q_heads, head_dim]``."""
    out = []
    for s in range(q.shape[0]):
        k, v = cache.gather(s)                                   # [num_layers, n, kv_heads, D]
        kl, vl = k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None]  # [1, kv_heads, n, D]
        out.append(contiguous_attention(q[s][None, :, None], kl, vl)[0, :, 0])
    return torch.stack(out)


# Each case: dtype, q_heads, kv_heads, head_dim, block_size, sequence lengths. Together they cover the
# GQA ratios 1, 2, 4, 8 and MQA, head dims 64, 80, 96, 128, 256, block sizes 1, 4, 16, 32, lengths 1 and
# exact multiples of the block size, mixed batches and every dtype.
CASES = [
    (torch.float32, 4, 4, 64, 4, [1, 4, 7, 13]),           # MHA (ratio 1), mixed, length 1 and 4 = 1 block
    (torch.float32, 8, 4, 80, 16, [16, 33, 5]),            # ratio 2, head_dim 80, exact multiple 16
    (torch.float32, 8, 2, 96, 1, [1, 9, 3]),               # ratio 4, block size 1
    (torch.float32, 8, 1, 128, 32, [64, 1, 40]),           # MQA, block 32, exact multiple 64
    (torch.float32, 16, 2, 256, 16, [17, 32]),             # ratio 8, head_dim 256
    (torch.float32, 32, 8, 128, 16, [50, 50, 50]),         # the benchmark's heads, equal lengths (no mask)
    (torch.float16, 8, 2, 128, 16, [1, 16, 31, 48]),
    (torch.float16, 8, 8, 80, 4, [12, 3]),
    (torch.float16, 8, 1, 96, 32, [32, 70]),
    (torch.bfloat16, 8, 1, 64, 4, [5, 8, 1]),
    (torch.bfloat16, 16, 2, 256, 16, [16, 20]),
    (torch.bfloat16, 8, 4, 128, 1, [2, 7]),
]


def case_id(c: tuple) -> str:
    dtype, qh, kvh, d, bs, lens = c
    return f"{str(dtype)[6:]}-q{qh}kv{kvh}-d{d}-bs{bs}-len{'_'.join(map(str, lens))}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_paged_matches_oracle_sdpa_and_reference(case: tuple) -> None:
    dtype, q_heads, kv_heads, head_dim, block_size, lens = case
    cache = filled_cache(lens, block_size, kv_heads, head_dim, dtype)
    outs = []
    for layer in range(2):
        args = decode_args(cache, q_heads, layer=layer, seed=layer)
        q = args[0]
        out = paged_attention(*args)
        assert out.shape == q.shape and out.dtype == dtype
        oracle = paged_attention_oracle(*args)
        assert oracle.dtype == torch.float64
        close(out, oracle, dtype)
        close(out, sdpa_per_sequence(cache, layer, q), dtype)
        close(paged_attention(*args, chunk_bytes=math.inf), oracle, dtype)  # the whole batch in one chunk
        outs.append(out)
    queries = torch.stack([decode_args(cache, q_heads, layer=la, seed=la)[0] for la in range(2)])
    for s in range(len(lens)):  # the per-token reference does every layer of one sequence at once
        ref = reference_paged_attention(cache, s, queries[:, s, None])  # [num_layers, 1, q_heads, D]
        close(ref[:, 0], torch.stack(outs)[:, s], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unused_slots_and_padding_cannot_change_the_result(dtype: torch.dtype) -> None:
    lens, outs = [3, 9, 1, 16], []
    for fill in (0.0, float("nan"), float("inf"), -float("inf")):
        q, k_cache, v_cache, tables, lens_t = decode_args(filled_cache(lens, 4, 2, 64, dtype, fill=fill), 4,
                                                          width=6)  # wider than needed: more -1 padding
        # entries past a sequence's last block are never read, even when they are not valid ids
        junk = torch.where(tables < 0, torch.tensor(10**6, dtype=torch.int32), tables)
        for t in (tables, junk):
            for chunk_bytes in (0, math.inf):  # one sequence per chunk (no mask), then one masked chunk
                outs.append(paged_attention(q, k_cache, v_cache, t, lens_t, chunk_bytes=chunk_bytes))
    assert torch.isfinite(outs[0]).all()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


def test_chunking_does_not_change_the_result() -> None:
    args = decode_args(filled_cache([5, 40, 17, 64, 1, 33], 16, 2, 64), 8)
    whole = paged_attention(*args, chunk_bytes=math.inf)
    for chunk_bytes in (0, 1, 40 * 1024, 100 * 1024, np.float64(1e5)):  # one sequence per chunk, then more
        out = paged_attention(*args, chunk_bytes=chunk_bytes)
        torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-6)


def test_custom_scale() -> None:
    args = decode_args(filled_cache([7, 20], 4, 2, 64), 4)
    out = paged_attention(*args, scale=0.3)
    close(out, paged_attention_oracle(*args, scale=0.3), torch.float32)
    assert not torch.allclose(out, paged_attention(*args), atol=1e-3)
    torch.testing.assert_close(paged_attention(*args, scale=np.float32(0.3)), out)


def test_article_trace() -> None:
    """Block size 4, the sequence's blocks are [5, 2] after 7 tokens and [5, 2, 9] after 9."""
    torch.manual_seed(0)
    cache = PagedKVCache(12, 1, 4, 2, 64, free_order=[5, 2, 9], fill=float("nan"))
    cache.add_sequence(0)
    for n in range(9):
        k, v = torch.randn(2, 1, 2, 64)
        cache.append_token(0, k, v)
        if n == 6:
            assert cache.tables[0] == [5, 2]
    assert cache.tables[0] == [5, 2, 9] and cache.seq_lens[0] == 9
    q = torch.randn(1, 1, 8, 64)
    ref = reference_paged_attention(cache, 0, q)                 # [1, 1, 8, 64]
    k, v = cache.gather(0)                                       # [1, 9, 2, 64]
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              enable_gqa=True).transpose(1, 2)
    close(ref, expected, torch.float32)


@pytest.mark.parametrize("dtype,block_size,n", [(torch.float32, 4, 13), (torch.float16, 16, 32),
                                                (torch.bfloat16, 1, 9), (torch.float32, 32, 1)])
def test_prefill_is_causal_attention_over_the_prompt(dtype: torch.dtype, block_size: int, n: int) -> None:
    cache = filled_cache([n, 6], block_size, 2, 80, dtype)      # sequence 1 sits beside it in the pool
    k_cache, v_cache = cache.layer(1)
    table = cache.block_table([0], width=cache.num_blocks)[0]  # padded with -1
    q = torch.randn(n, 8, 80, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, table, n)  # [n, q_heads, D]
    k, v = cache.gather(0)
    expected = contiguous_attention(q.transpose(0, 1)[None], k[1].transpose(0, 1)[None],
                                    v[1].transpose(0, 1)[None], causal=True)[0].transpose(0, 1)
    close(out, expected, dtype)
    # query i is the decode step of a sequence of length i + 1: the float64 oracle, row by row
    oracle = paged_attention_oracle(q, k_cache, v_cache, table[None].expand(n, -1).contiguous(),
                                    torch.arange(1, n + 1, dtype=torch.int32))
    close(out, oracle, dtype)
    # a chunk of the prompt (its last queries, after earlier tokens) gives the same rows
    tail = max(1, n // 3)
    close(paged_prefill_attention(q[-tail:], k_cache, v_cache, table, np.int64(n)), out[-tail:], dtype)


def test_gradients_flow_through_paged_attention_as_through_sdpa() -> None:
    cache = filled_cache([6, 11], 4, 2, 16, num_layers=1)
    q, k_cache, v_cache, tables, lens = decode_args(cache, 4, layer=0)
    q.requires_grad_(True)
    paged_attention(q, k_cache, v_cache, tables, lens).square().sum().backward()
    q2 = q.detach().clone().requires_grad_(True)
    sdpa_per_sequence(cache, 0, q2).square().sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=1e-5)
    assert not cache.k.requires_grad and cache.k.grad is None


# --- memory: every chunk's copy is bounded, on every device -----------------------------------------


def test_default_chunks_are_bounded_on_every_device() -> None:
    # 32 sequences, one of 4,096 tokens: padding every sequence to the longest would copy 32x 4,096 tokens
    lens = [4096] + [16] * 31
    bytes_per_token = 2 * 8 * 128 * 2                  # K and V, 8 KV heads, head_dim 128, fp16
    longest = 4096 * bytes_per_token
    for device in ("cpu", "cuda", "mps"):
        budget = default_chunk_bytes(torch.device(device))
        assert budget < math.inf
        chunks = plan_chunks(lens, 16, bytes_per_token, budget)
        assert [i for c in chunks for i in c] == list(range(32))       # every sequence once, in order
        for c in chunks:
            copy = len(c) * max(math.ceil(lens[i] / 16) * 16 for i in c) * bytes_per_token
            assert copy <= max(budget, longest)


def test_an_unbounded_budget_never_pads_more_than_the_sequences_hold() -> None:
    # chunk_bytes=inf once padded 31 sequences of 16 tokens to the longest (4,096): 512 MiB of copies for
    # 18 MiB of K/V. Now a chunk's copy is at most twice the blocks its own sequences hold.
    lens, per_token = [4096] + [16] * 31, 2 * 8 * 128 * 2
    for budget in (math.inf, 64 * 2**20):
        chunks = plan_chunks(lens, 16, per_token, budget)
        assert [i for c in chunks for i in c] == list(range(32))
        for c in chunks:
            assert len(c) * max(lens[i] for i in c) <= 2 * sum(lens[i] for i in c)
        assert sum(len(c) * max(lens[i] for i in c) for c in chunks) <= 2 * sum(lens)
    assert len(plan_chunks([1024] * 16, 16, per_token, math.inf)) == 1    # equal lengths: one chunk


def test_a_plan_covers_every_sequence_once() -> None:
    assert plan_chunks([], 16, 1024, 0) == []
    for budget in (0, 5000, math.inf):
        chunks = plan_chunks([1, 40, 7, 16, 3], 16, 8, budget)
        assert [i for c in chunks for i in c] == [0, 1, 2, 3, 4] and all(len(c) >= 1 for c in chunks)
    assert len(plan_chunks([1, 40, 7, 16, 3], 16, 8, 0)) == 5
    assert len(plan_chunks([5] * 5, 16, 8, math.inf)) == 1


def test_no_gathered_copy_exceeds_the_budget(monkeypatch) -> None:
    """A hook on the gather records every copy paged_attention makes, with the GPU default budget."""
    sizes = []
    gather = attention._gather

    def recording(cache, ids, n_tokens):
        out = gather(cache, ids, n_tokens)
        sizes.append(ids.numel() * cache[0].numel() * cache.element_size())
        return out

    monkeypatch.setattr(attention, "_gather", recording)
    monkeypatch.setattr(attention, "GPU_CHUNK_BYTES", 64 * 1024)
    lens = [300] + [4] * 40 + [90] * 20
    args = decode_args(filled_cache(lens, 4, 2, 64, num_layers=1), 4, layer=0)
    out = paged_attention(*args, chunk_bytes=default_chunk_bytes(torch.device("cuda")))
    per_token = 2 * 2 * 64 * 4                                     # K and V, 2 KV heads, fp32
    assert max(sizes) <= max(64 * 1024 / 2, 300 * per_token / 2)  # each pool's copy: half of K+V
    assert len(sizes) < 2 * len(lens)                               # and not one chunk per sequence
    torch.testing.assert_close(out, paged_attention(*args, chunk_bytes=math.inf))


# --- contracts: inputs are read only; threads ------------------------------------------------------


def test_no_function_writes_its_inputs() -> None:
    cache = filled_cache([5, 12], 4, 2, 16)
    args = decode_args(cache, 4)
    before = [t.clone() for t in args] + [cache.k.clone(), cache.v.clone()]
    paged_attention(*args)
    paged_attention(*args, chunk_bytes=math.inf)
    paged_attention_oracle(*args)
    paged_prefill_attention(torch.randn(5, 4, 16), *args[1:3], args[3][0], 5)
    reference_paged_attention(cache, 1, torch.randn(2, 1, 4, 16))
    for old, new in zip(before, [*args, cache.k, cache.v]):
        torch.testing.assert_close(new, old, rtol=0, atol=0, equal_nan=True)


def test_threads_may_call_paged_attention_at_once() -> None:
    jobs = [decode_args(filled_cache([9, 30, 2], 4, 2, 32, seed=s), 4, seed=s) for s in range(4)]
    want = [paged_attention(*a) for a in jobs]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}
    work = lambda i: got[i].extend(paged_attention(*jobs[i]) for _ in range(20))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert len(got[i]) == 20 and all(torch.equal(o, want[i]) for o in got[i])


# --- validation -------------------------------------------------------------------------------------


def valid_args() -> dict:
    q, k_cache, v_cache, tables, lens = decode_args(filled_cache([5, 12], 4, 2, 64), 4, layer=0)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "seq_lens": lens}


def test_check_paged_inputs_returns_the_geometry() -> None:
    assert check_paged_inputs(**valid_args()) == (2, 4, 2, 64, 4)


BAD = [
    ("q", lambda a: a["q"][0], "q must have shape"),
    ("q", lambda a: a["q"][:, None].expand(2, 3, 4, 64), r"q must have shape .* paged_prefill_attention"),
    ("q", lambda a: a["q"][:1], r"q must hold one query token per sequence, \[batch=2"),
    ("q", lambda a: a["q"].repeat(3, 1, 1), r"q must hold one query token per sequence, \[batch=2"),
    ("q", lambda a: a["q"][:, :, :32], "head_dim"),
    ("q", lambda a: a["q"][:, :3], "multiple of"),
    ("q", lambda a: a["q"].to(torch.int64), "dtype"),
    ("q", lambda a: a["q"].double(), "q must have a dtype in"),
    ("q", lambda a: a["q"][:0], "batch"),
    ("q", lambda a: a["q"].to("meta"), "on q's device"),
    ("q", lambda a: a["q"].numpy(), "q must be a dense torch.Tensor, got ndarray"),
    ("k_cache", lambda a: a["k_cache"][0], "k_cache must have shape"),
    ("k_cache", lambda a: a["k_cache"].to_sparse(), "k_cache must be a dense torch.Tensor"),
    ("k_cache", lambda a: a["k_cache"].half(), "k_cache must have q's dtype"),
    ("v_cache", lambda a: a["v_cache"][:, :2], "v_cache must have k_cache's shape"),
    ("v_cache", lambda a: a["v_cache"].half(), "v_cache must have q's dtype"),
    ("block_tables", lambda a: a["block_tables"].long(), "block_tables must be an int32"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables and seq_lens must describe the same"),
    ("block_tables", lambda a: a["block_tables"].tolist(), "block_tables must be a dense torch.Tensor"),
    ("seq_lens", lambda a: a["seq_lens"].long(), "seq_lens must be an int32"),
    ("seq_lens", lambda a: a["seq_lens"][None], "seq_lens must be an int32"),
    ("seq_lens", lambda a: torch.tensor([0, 12], dtype=torch.int32), r"seq_lens\[0\] = 0"),
    ("seq_lens", lambda a: torch.tensor([5, 13], dtype=torch.int32), r"seq_lens\[1\] = 13 .* capacity"),
    ("block_tables", lambda a: torch.tensor([[-1, -1, -1], [0, 1, 2]], dtype=torch.int32),
     r"block_tables\[0, 0\] = -1"),
    ("block_tables", lambda a: torch.tensor([[0, 1, -1], [2, 99, 3]], dtype=torch.int32),
     r"block_tables\[1, 1\] = 99 .*num_blocks=8.*positions 4..7"),
]


@pytest.mark.parametrize("name,mutate,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_raise_a_clear_value_error(name: str, mutate, message: str) -> None:
    args = valid_args()
    args[name] = mutate(args)
    with pytest.raises(ValueError, match=message):
        check_paged_inputs(**args)
    with pytest.raises(ValueError, match=message):
        paged_attention(**args)
    with pytest.raises(ValueError, match=message):
        paged_attention_oracle(**args)


@pytest.mark.parametrize("dim,what", [(1, "block_size"), (2, "kv_heads"), (3, "head_dim")])
def test_an_empty_cache_dimension_is_named(dim: int, what: str) -> None:
    args = valid_args()
    for name in ("k_cache", "v_cache"):
        args[name] = args[name].narrow(dim, 0, 0)
    if what == "head_dim":
        args["q"] = args["q"][..., :0]
    with pytest.raises(ValueError, match=rf"k_cache's {what} \(dim {dim}\) must be >= 1"):
        paged_attention(**args)


@pytest.mark.parametrize("scale", ["x", True, float("nan"), -1.0, 0, float("inf"), torch.tensor(0.1)])
def test_a_bad_scale_is_named(scale) -> None:
    args = valid_args()
    q, k_cache, v_cache, tables, lens = args.values()
    calls = [lambda: paged_attention(**args, scale=scale),
             lambda: paged_attention_oracle(**args, scale=scale),
             lambda: paged_prefill_attention(q[:1], k_cache, v_cache, tables[0], 5, scale=scale),
             lambda: contiguous_attention(q[:, :, None], q[:, :2, None], q[:, :2, None], scale=scale)]
    for call in calls:
        with pytest.raises(ValueError, match="scale must be None or a finite number > 0"):
            call()


@pytest.mark.parametrize("chunk_bytes", [-1, float("nan"), "64", True])
def test_a_bad_chunk_budget_is_named(chunk_bytes) -> None:
    with pytest.raises(ValueError, match="chunk_bytes must be None or a number >= 0"):
        paged_attention(**valid_args(), chunk_bytes=chunk_bytes)


def test_contiguous_attention_names_a_bad_argument() -> None:
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="v must be a torch.Tensor, got list"):
        contiguous_attention(q, k, [[0.0]])
    with pytest.raises(ValueError, match=r"q_heads \(3\) must be a multiple of kv_heads \(2\)"):
        contiguous_attention(q[:, :3], k, k)
    # a batch or head_dim that differs between q and k/v: torch's RuntimeError before, a ValueError now
    for qq, kk in ((q.expand(3, -1, -1, -1), k), (q, k[..., :8])):
        with pytest.raises(ValueError, match=r"one batch, one head_dim\); got \["):
            contiguous_attention(qq, kk, kk)


def test_unused_table_entries_are_not_validated() -> None:
    args = valid_args()
    expected = paged_attention(**args)
    args["block_tables"] = torch.cat([args["block_tables"], torch.full((2, 2), 77, dtype=torch.int32)], 1)
    check_paged_inputs(**args)  # entries 77 sit past both sequences' last blocks
    assert torch.equal(paged_attention(**args), expected)


def test_reference_and_prefill_reject_bad_input() -> None:
    cache = filled_cache([5], 4, 2, 64)
    with pytest.raises(ValueError, match="num_layers=2, 1, q_heads"):
        reference_paged_attention(cache, 0, torch.randn(2, 2, 4, 64))
    with pytest.raises(ValueError, match="multiple of"):
        reference_paged_attention(cache, 0, torch.randn(2, 1, 3, 64))
    with pytest.raises(KeyError):
        reference_paged_attention(cache, 7, torch.randn(2, 1, 4, 64))
    table, q = cache.block_table([0])[0], torch.randn(5, 4, 64)
    for seq_len, message in [(4, "seq_len must be >= n = 5"), (True, "seq_len must be an int, got a bool"),
                             (5.0, "seq_len must be an int")]:
        with pytest.raises(ValueError, match=message):
            paged_prefill_attention(q, *cache.layer(0), table, seq_len)
    with pytest.raises(ValueError, match=r"block_table must be a 1-D int32 tensor \[max_blocks\], got"):
        paged_prefill_attention(q, *cache.layer(0), table[None], 5)
    with pytest.raises(ValueError, match="block_table must be a 1-D int32"):
        paged_prefill_attention(q, *cache.layer(0), table.long(), 5)


def test_kv_bytes_is_the_bytes_of_k_and_v_read() -> None:
    assert kv_bytes([3, 5], kv_heads=2, head_dim=4, dtype=torch.float16) == 2 * 8 * 2 * 4 * 2
    assert kv_bytes(torch.tensor([1024] * 16), 8, 128, torch.float32) == 2 * 16 * 1024 * 8 * 128 * 4
    assert kv_bytes([np.int32(2**30)] * 4, np.int32(8), 128, torch.float16) == 2 * 2**32 * 8 * 128 * 2
    with pytest.raises(ValueError, match=r"seq_lens\[1\] must be >= 0"):
        kv_bytes([2, -3], 2, 4, torch.float16)


def test_benchmark_command_writes_json(tmp_path) -> None:
    import json

    from pagedlib.bench.__main__ import main

    path = tmp_path / "attention.json"
    argv = ["attention", "--batch", "2", "--context", "24", "--q-heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--block-sizes", "1,8", "--contexts", "8,24", "--repeats", "2",
            "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    assert result["environment"]["torch"] == torch.__version__ and result["config"]["head_dim"] == 16
    impls = {(r["phase"], r["impl"]) for r in result["decode"] + result["prefill"]}
    fused = set()  # the fused CPU kernel's rows: on a CPU (where the tests build it)
    if not torch.cuda.is_available():
        fused = {("decode", "pagedlib-fused"), ("prefill", "pagedlib-fused")}
    assert impls == {("decode", "reference"), ("decode", "paged"), ("decode", "paged-whole-batch"),
                     ("decode", "contiguous"), ("prefill", "paged"), ("prefill", "contiguous"), *fused}
    assert [r["block_size"] for r in result["block_size_sweep"]] == [1, 1, 8, 8]
    assert [r["context"] for r in result["context_sweep"]] == [8, 8, 24, 24]
    for r in result["decode"] + result["prefill"]:  # speedup: contiguous time / time, at the same point
        base = next(b for b in result[r["phase"]] if b["impl"] == "contiguous" and b["batch"] == r["batch"])
        assert r["speedup vs SDPA (x faster)"] == pytest.approx(base["ms"] / r["ms"])


@pytest.mark.parametrize("argv", [
    ["attention", "--block-size", "0"], ["attention", "--batch", "-2"], ["attention", "--head-dim", "x"],
    ["attention", "--block-sizes", "1,a"], ["attention", "--contexts", "0,8"],
    ["attention", "--repeats", "0"], ["attention", "--q-heads", "6", "--kv-heads", "4"],
    ["gpu", "--batches", "a,b"], ["gpu", "--contexts", "512,-1"], ["gpu", "--pool-gib", "0"],
    ["gpu", "--repeats", "0"], ["gpu", "--out-dir", "{file}/results"],
])
def test_benchmark_flags_are_usage_errors_before_any_work(argv, capsys, monkeypatch, tmp_path) -> None:
    from pagedlib.bench import attention as bench_attention
    from pagedlib.bench import gpu
    from pagedlib.bench.__main__ import main

    (tmp_path / "file").write_text("")                 # a file where the results folder should be
    argv = [a.format(file=tmp_path / "file") for a in argv]
    monkeypatch.setattr(bench_attention, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    monkeypatch.setattr(gpu, "benchmark", lambda *a, **k: pytest.fail("the benchmark ran"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past gpu's own CUDA check, if reached
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and argv[-2].lstrip("-").split("-")[0] in err, err
