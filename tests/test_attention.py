"""Attention through block tables: the vectorized paged path, the per-token reference, the float64 oracle
and SDPA on contiguous K/V all agree, whatever sits in the slots that hold no token.

Tolerances: the article's absolute ones (fp32 1e-5, fp16 1e-3, bf16 5e-3) with a relative term of about
one unit in the last place (PyTorch's defaults): for bf16 outputs above 1, one ulp (0.0078) is already
more than 5e-3, so no implementation could meet an absolute bound alone.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedlib.attention import (
    check_paged_inputs,
    contiguous_attention,
    kv_bytes,
    paged_attention,
    paged_attention_oracle,
    paged_prefill_attention,
    reference_paged_attention,
)
from pagedlib.cache import PagedKVCache

TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 5e-3, "rtol": 1.6e-2},
}
NUM_LAYERS = 2


def make_cache(lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               fill: float = float("nan"), seed: int = 0) -> PagedKVCache:
    """A cache holding sequences 0..len(lens)-1, blocks handed out in a random order, spare free blocks,
    and ``fill`` (NaN by default) in every slot that holds no token."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = PagedKVCache(num_blocks, NUM_LAYERS, block_size, kv_heads, head_dim, dtype=dtype,
                         free_order=order, fill=fill)
    for s, n in enumerate(lens):
        cache.add_sequence(s)
        k, v = torch.randn(2, NUM_LAYERS, n, kv_heads, head_dim, generator=g).to(dtype)
        cache.append_tokens(s, k, v)
    return cache


def queries(batch: int, q_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """``[num_layers, batch, q_heads, head_dim]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_LAYERS, batch, q_heads, head_dim, generator=g).to(dtype)


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
    cache = make_cache(lens, block_size, kv_heads, head_dim, dtype)
    q = queries(len(lens), q_heads, head_dim, dtype)
    seqs = list(range(len(lens)))
    tables, seq_lens = cache.block_table(seqs), cache.seq_lens_tensor(seqs)
    outs = []
    for layer in range(NUM_LAYERS):
        k_cache, v_cache = cache.layer(layer)                    # strided views of the 5-D pools
        out = paged_attention(q[layer], k_cache, v_cache, tables, seq_lens)
        assert out.shape == q[layer].shape and out.dtype == dtype
        assert torch.isfinite(out).all()
        oracle = paged_attention_oracle(q[layer], k_cache, v_cache, tables, seq_lens)
        torch.testing.assert_close(out, oracle, **TOL[dtype])
        torch.testing.assert_close(out, sdpa_per_sequence(cache, layer, q[layer]), **TOL[dtype])
        # the whole batch in one masked run (the GPU default) gives the same result
        whole = paged_attention(q[layer], k_cache, v_cache, tables, seq_lens, chunk_bytes=math.inf)
        torch.testing.assert_close(whole, oracle, **TOL[dtype])
        outs.append(out)
    for s in seqs:  # the per-token reference does every layer of one sequence at once
        ref = reference_paged_attention(cache, s, q[:, s, None])  # [num_layers, 1, q_heads, D]
        torch.testing.assert_close(ref[:, 0], torch.stack(outs)[:, s], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unused_slots_and_padding_cannot_change_the_result(dtype: torch.dtype) -> None:
    lens, block_size = [3, 9, 1, 16], 4
    outs = []
    for fill in (0.0, float("nan"), float("inf"), -float("inf")):
        cache = make_cache(lens, block_size, 2, 64, dtype, fill=fill)
        tables = cache.block_table(range(len(lens)), width=6)   # wider than needed: more -1 padding
        k_cache, v_cache = cache.layer(1)
        q = queries(len(lens), 4, 64, dtype)[1]
        lens_t = cache.seq_lens_tensor(range(len(lens)))
        # entries past a sequence's last block are never read, even when they are not valid ids
        junk = torch.where(tables < 0, torch.tensor(10**6, dtype=torch.int32), tables)
        for t in (tables, junk):
            outs.append(paged_attention(q, k_cache, v_cache, t, lens_t))  # one sequence per run (CPU)
            outs.append(paged_attention(q, k_cache, v_cache, t, lens_t, chunk_bytes=math.inf))  # masked
    assert torch.isfinite(outs[0]).all()
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=1e-6)


def test_chunking_does_not_change_the_result() -> None:
    lens = [5, 40, 17, 64, 1, 33]
    cache = make_cache(lens, 16, 2, 64, torch.float32)
    q = queries(len(lens), 8, 64, torch.float32)[0]
    args = (q, *cache.layer(0), cache.block_table(range(6)), cache.seq_lens_tensor(range(6)))
    whole = paged_attention(*args, chunk_bytes=math.inf)
    for chunk_bytes in (1, 40 * 1024, 100 * 1024):              # one sequence per run, then a few
        torch.testing.assert_close(paged_attention(*args, chunk_bytes=chunk_bytes), whole,
                                   atol=1e-6, rtol=1e-6)


def test_custom_scale() -> None:
    cache = make_cache([7, 20], 4, 2, 64, torch.float32)
    q = queries(2, 4, 64, torch.float32)[0]
    args = (q, *cache.layer(0), cache.block_table([0, 1]), cache.seq_lens_tensor([0, 1]))
    out = paged_attention(*args, scale=0.3)
    torch.testing.assert_close(out, paged_attention_oracle(*args, scale=0.3), **TOL[torch.float32])
    assert not torch.allclose(out, paged_attention(*args), atol=1e-3)


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
    torch.testing.assert_close(ref, expected, **TOL[torch.float32])


@pytest.mark.parametrize("dtype,block_size,n", [(torch.float32, 4, 13), (torch.float16, 16, 32),
                                                (torch.bfloat16, 1, 9), (torch.float32, 32, 1)])
def test_prefill_is_causal_attention_over_the_prompt(dtype: torch.dtype, block_size: int, n: int) -> None:
    cache = make_cache([n, 6], block_size, 2, 80, dtype)         # sequence 1 sits beside it in the pool
    k_cache, v_cache = cache.layer(1)
    table = cache.block_table([0], width=cache.num_blocks)[0]  # padded with -1
    q = torch.randn(n, 8, 80, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = paged_prefill_attention(q, k_cache, v_cache, table, n)  # [n, q_heads, D]
    k, v = cache.gather(0)
    expected = contiguous_attention(q.transpose(0, 1)[None], k[1].transpose(0, 1)[None],
                                    v[1].transpose(0, 1)[None], causal=True)[0].transpose(0, 1)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    # query i is the decode step of a sequence of length i + 1: the float64 oracle, row by row
    oracle = paged_attention_oracle(q, k_cache, v_cache, table[None].expand(n, -1).contiguous(),
                                    torch.arange(1, n + 1, dtype=torch.int32))
    torch.testing.assert_close(out, oracle, **TOL[dtype])
    # a chunk of the prompt (its last queries, after earlier tokens) gives the same rows
    tail = max(1, n // 3)
    chunk = paged_prefill_attention(q[-tail:], k_cache, v_cache, table, n)
    torch.testing.assert_close(chunk, out[-tail:], **TOL[dtype])


# --- validation -------------------------------------------------------------------------------------


def valid_args() -> dict:
    cache = make_cache([5, 12], 4, 2, 64, torch.float32)
    k_cache, v_cache = cache.layer(0)
    return {"q": torch.randn(2, 4, 64), "k_cache": k_cache, "v_cache": v_cache,
            "block_tables": cache.block_table([0, 1]), "seq_lens": cache.seq_lens_tensor([0, 1])}


def test_check_paged_inputs_returns_the_geometry() -> None:
    assert check_paged_inputs(**valid_args()) == (2, 4, 2, 64, 4)


BAD = [
    ("q", lambda a: a["q"][0], "q must have shape"),
    ("q", lambda a: a["q"][:, :, :32], "head_dim"),
    ("q", lambda a: a["q"][:, :3], "multiple of"),
    ("q", lambda a: a["q"].to(torch.int64), "dtype"),
    ("q", lambda a: a["q"].double(), "k_cache must have q's dtype"),
    ("q", lambda a: a["q"][:0], "batch"),
    ("q", lambda a: a["q"].to("meta"), "on q's device"),
    ("k_cache", lambda a: a["k_cache"][0], "k_cache must have shape"),
    ("v_cache", lambda a: a["v_cache"][:, :2], "v_cache must have k_cache's shape"),
    ("v_cache", lambda a: a["v_cache"].half(), "v_cache must have q's dtype"),
    ("block_tables", lambda a: a["block_tables"].long(), "block_tables must be an int32"),
    ("block_tables", lambda a: a["block_tables"][:1], "block_tables must be an int32"),
    ("block_tables", lambda a: a["block_tables"].tolist(), "block_tables must be a torch.Tensor"),
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


def test_unused_table_entries_are_not_validated() -> None:
    args = valid_args()
    expected = paged_attention(**args)
    args["block_tables"] = torch.cat([args["block_tables"], torch.full((2, 2), 77, dtype=torch.int32)], 1)
    check_paged_inputs(**args)  # entries 77 sit past both sequences' last blocks
    assert torch.equal(paged_attention(**args), expected)


def test_reference_and_prefill_reject_bad_shapes() -> None:
    cache = make_cache([5], 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="num_layers=2, 1, q_heads"):
        reference_paged_attention(cache, 0, torch.randn(2, 2, 4, 64))
    with pytest.raises(ValueError, match="multiple of"):
        reference_paged_attention(cache, 0, torch.randn(2, 1, 3, 64))
    with pytest.raises(KeyError):
        reference_paged_attention(cache, 7, torch.randn(2, 1, 4, 64))
    table = cache.block_table([0])[0]
    with pytest.raises(ValueError, match="seq_len must be an int >= n = 5"):
        paged_prefill_attention(torch.randn(5, 4, 64), *cache.layer(0), table, 4)
    with pytest.raises(ValueError, match="block_table must be a 1-D"):
        paged_prefill_attention(torch.randn(5, 4, 64), *cache.layer(0), table[None], 5)


def test_kv_bytes_is_the_bytes_of_k_and_v_read() -> None:
    assert kv_bytes([3, 5], kv_heads=2, head_dim=4, dtype=torch.float16) == 2 * 8 * 2 * 4 * 2
    assert kv_bytes(torch.tensor([1024] * 16), 8, 128, torch.float32) == 2 * 16 * 1024 * 8 * 128 * 4


def test_benchmark_command_writes_json(tmp_path) -> None:
    import json

    from pagedlib.bench.__main__ import main

    path = tmp_path / "attention.json"
    argv = ["attention", "--quick", "--batch", "2", "--context", "24", "--q-heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--block-sizes", "1", "8", "--contexts", "8", "24", "--repeats", "2",
            "--json", str(path)]
    assert main(argv) == 0
    result = json.loads(path.read_text())
    assert result["environment"]["torch"] == torch.__version__
    assert result["config"]["head_dim"] == 16
    impls = {(r["phase"], r["impl"]) for r in result["decode"] + result["prefill"]}
    assert impls == {("decode", "reference"), ("decode", "paged"), ("decode", "paged-whole-batch"),
                     ("decode", "contiguous"), ("prefill", "paged"), ("prefill", "contiguous")}
    assert [r["block_size"] for r in result["block_size_sweep"]] == [1, 1, 8, 8]
    assert [r["context"] for r in result["context_sweep"]] == [8, 8, 24, 24]
    assert all(r["ms"] > 0 and r["GB/s"] > 0 for r in result["decode"])
