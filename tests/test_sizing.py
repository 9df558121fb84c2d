"""The sizing API reproduces the article's and the vLLM paper's numbers exactly, and rejects bad input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlib.teach.sizing import (
    PRESETS,
    ModelSpec,
    block_table_entries,
    blocks_needed,
    contiguous_kv_bytes,
    contiguous_utilization,
    contiguous_wasted_slots,
    format_bytes,
    kv_bytes_per_token,
    max_sequences,
    mean_tail_waste,
    paged_kv_bytes,
    paged_utilization,
    paged_wasted_slots,
    synthetic_seq_len_chunks,
    synthetic_seq_lens,
)

MiB, GiB = 2**20, 2**30
ARTICLE = ModelSpec("article-gqa", num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32)


def test_article_per_sequence_reservation_is_512_mib():
    assert contiguous_kv_bytes(ARTICLE, max_tokens=4096) == 512 * MiB
    # the formula written out: 2 x layers x tokens x kv_heads x head_dim x bytes
    assert contiguous_kv_bytes(ARTICLE, 4096) == 2 * 32 * 4096 * 8 * 128 * 2


def test_article_256_sequences_reserve_128_gib():
    assert contiguous_kv_bytes(ARTICLE, max_tokens=4096, num_seqs=256) == 128 * GiB


def test_article_block_counts():
    assert blocks_needed(4096, 16) == 256
    assert blocks_needed(200, 16) == 13


def test_vllm_paper_opt_13b_is_800_kib_per_token():
    assert kv_bytes_per_token(PRESETS["opt-13b"]) == 800 * 1024


def test_presets_from_published_configs():
    expected = {  # name: (layers, kv_heads, head_dim, q_heads)
        "llama-2-7b": (32, 32, 128, 32),
        "llama-3-8b": (32, 8, 128, 32),
        "mistral-7b": (32, 8, 128, 32),
        "llama-3-70b": (80, 8, 128, 64),
        "qwen2.5-7b": (28, 4, 128, 28),
        "opt-13b": (40, 40, 128, 40),
    }
    for name, shape in expected.items():
        s = PRESETS[name]
        assert s.name == name
        assert (s.num_layers, s.num_kv_heads, s.head_dim, s.num_q_heads) == shape
    # the article's model is Llama-3-8B / Mistral-7B shaped
    assert kv_bytes_per_token(PRESETS["llama-3-8b"]) == kv_bytes_per_token(ARTICLE) == 128 * 1024


def test_model_spec_is_frozen_and_validated():
    with pytest.raises(AttributeError):
        ARTICLE.num_layers = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="num_q_heads"):
        ModelSpec("bad", 2, 3, 64, 4)
    with pytest.raises(ValueError, match="head_dim"):
        ModelSpec("bad", 2, 2, 0, 4)
    assert PRESETS["llama-3-70b"].group_size == 8


def test_paged_bytes_counts_whole_blocks():
    per_token = kv_bytes_per_token(ARTICLE)
    assert paged_kv_bytes(ARTICLE, [200], block_size=16) == 13 * 16 * per_token
    assert paged_kv_bytes(ARTICLE, [4096, 200, 0], 16) == (256 + 13) * 16 * per_token
    assert paged_kv_bytes(ARTICLE, [4096], 16) == contiguous_kv_bytes(ARTICLE, 4096)


def test_wasted_slots_and_utilization():
    assert paged_wasted_slots(200, 16) == 8
    assert paged_wasted_slots(208, 16) == 0
    assert contiguous_wasted_slots(200, 4096) == 3896
    assert block_table_entries([200, 4096], 16) == 13 + 256
    assert contiguous_utilization([1024, 3072], 4096) == 0.5
    assert paged_utilization([16, 8], 16) == 0.75
    with pytest.raises(ValueError, match="exceeds max_tokens"):
        contiguous_utilization([5000], 4096)


@settings(deadline=None)  # a loaded CI machine must not turn a slow example into a failure
@given(n=st.integers(0, 100_000), b=st.integers(1, 512))
def test_paged_waste_is_less_than_one_block(n, b):
    assert 0 <= paged_wasted_slots(n, b) < b
    assert blocks_needed(n, b) == math.ceil(n / b)


def test_max_sequences_paging_admits_more():
    lens = [200] * 1000
    budget = contiguous_kv_bytes(ARTICLE, 4096, num_seqs=4)
    assert max_sequences(ARTICLE, budget, lens, max_tokens=4096) == 4
    assert max_sequences(ARTICLE, budget, lens, block_size=16) == (4 * 256) // 13
    with pytest.raises(ValueError, match="exactly one"):
        max_sequences(ARTICLE, budget, lens)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: blocks_needed(-1, 16), "num_tokens"),
        (lambda: blocks_needed(10, 0), "block_size"),
        (lambda: blocks_needed(10.0, 16), "num_tokens"),
        (lambda: blocks_needed(True, 16), "num_tokens"),
        (lambda: contiguous_kv_bytes(ARTICLE, 0), "max_tokens"),
        (lambda: contiguous_kv_bytes(ARTICLE, 4096, num_seqs=-2), "num_seqs"),
        (lambda: kv_bytes_per_token(ARTICLE, dtype_bytes=0), "dtype_bytes"),
        (lambda: kv_bytes_per_token(ARTICLE, dtype_bytes=1.5), "dtype_bytes"),
        (lambda: paged_kv_bytes(ARTICLE, [10, -3], 16), r"seq_lens\[1\]"),
        (lambda: paged_kv_bytes(ARTICLE, [10], "16"), "block_size"),
        (lambda: synthetic_seq_lens(0), "num_seqs"),
        (lambda: paged_wasted_slots(-1, 4), "^seq_len must be >= 0, got -1$"),  # the caller's name
        (lambda: contiguous_wasted_slots(-1, 4), "^seq_len must be >= 0, got -1$"),
        (lambda: contiguous_wasted_slots(5, 4), r"^a sequence of 5 tokens exceeds max_tokens \(4\)$"),
    ],
)
def test_bad_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_synthetic_workload_is_seeded_and_bounded():
    a = synthetic_seq_lens(500, max_tokens=4096, seed=3)
    assert a == synthetic_seq_lens(500, max_tokens=4096, seed=3)
    assert a != synthetic_seq_lens(500, max_tokens=4096, seed=4)
    assert all(1 <= n <= 4096 for n in a)
    assert 200 < sorted(a)[250] < 400  # the median is near the requested 300


def test_format_bytes():
    assert format_bytes(512 * MiB) == "512 MiB"
    assert format_bytes(128 * GiB) == "128 GiB"
    assert format_bytes(800 * 1024) == "800 KiB"
    assert format_bytes(1536) == "1.5 KiB"


def test_max_sequences_takes_any_iterable_and_numpy_arrays():
    import numpy as np

    spec = PRESETS["llama-3-8b"]
    lens = [100, 2000, 50, 4096]
    budget = paged_kv_bytes(spec, lens[:3], 16)  # exactly the first three
    assert max_sequences(spec, budget, iter(lens), block_size=16) == 3
    assert max_sequences(spec, budget, np.array(lens), block_size=16) == 3
    assert max_sequences(spec, budget - 1, lens, block_size=16) == 2
    assert max_sequences(spec, 10**15, iter(lens), block_size=16) == 4
    with pytest.raises(ValueError, match="seq_lens"):
        max_sequences(spec, budget, np.array([5, -1]), block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        max_sequences(spec, budget, lens, block_size=0)
    with pytest.raises(ValueError, match="max_tokens"):
        max_sequences(spec, budget, lens, max_tokens=1000)


def test_scalar_arguments_are_checked_even_for_an_empty_batch():
    with pytest.raises(ValueError, match="block_size"):
        paged_utilization([], 0)
    with pytest.raises(ValueError, match="max_tokens"):
        contiguous_utilization([], 0)
    with pytest.raises(ValueError, match="block_size"):
        block_table_entries([], -5)


def test_format_bytes_never_switches_to_scientific_notation():
    assert format_bytes(1_048_000) == "1023 KiB"
    assert "e+" not in format_bytes(1000.5 * 2**20)


def test_format_bytes_picks_the_unit_after_rounding():
    assert format_bytes(1_048_575) == "1 MiB"  # 1023.999 KiB would print as "1024 KiB"
    assert format_bytes(1023.5) == "1 KiB"
    assert format_bytes(2**30 - 1) == "1 GiB"
    assert format_bytes(10**18) == "888 PiB"
    for bad in (float("nan"), float("inf"), "12", True, None):
        with pytest.raises(ValueError, match="n must be a finite number of bytes"):
            format_bytes(bad)


def test_numpy_integers_never_wrap_around():
    import numpy as np

    spec = ModelSpec("m", *map(np.int32, (80, 8, 128, 64)))
    assert type(spec.num_layers) is int
    assert contiguous_kv_bytes(spec, 4096, 256) == 343_597_383_680  # int32 arithmetic gave 0
    assert contiguous_kv_bytes(ARTICLE, np.int32(4096), np.int64(256)) == 128 * GiB
    assert kv_bytes_per_token(ARTICLE, np.int8(2)) == 128 * 1024


def test_max_sequences_is_exact_beyond_int64():
    per_token = kv_bytes_per_token(ARTICLE)
    huge = [2**60]  # 2**60 tokens x 128 KiB = 2**77 bytes: int64 wrapped this to a size that "fits"
    assert max_sequences(ARTICLE, 10**15, huge, block_size=16) == 0
    assert max_sequences(ARTICLE, 10**15, huge, max_tokens=2**60) == 0
    assert max_sequences(ARTICLE, 2**77, huge + [16], block_size=16) == 1
    assert max_sequences(ARTICLE, 2**77 + 16 * per_token, huge + [16, 1], block_size=16) == 2
    with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
        max_sequences(ARTICLE, 10**15, [2**63], block_size=16)


def test_synthetic_prefix_is_stable_and_chunks_match_lists():
    assert synthetic_seq_lens(5, seed=1) == synthetic_seq_lens(50, seed=1)[:5]
    chunks = synthetic_seq_len_chunks(3, seed=1)  # the calculator reads the same stream in chunks
    assert [n for _ in range(3) for n in next(chunks).tolist()] == synthetic_seq_lens(9, seed=1)


@pytest.mark.parametrize("block_size", [1, 2, 16, 256])
def test_mean_tail_waste_is_the_mean_over_one_period_of_lengths(block_size):
    tails = [paged_wasted_slots(n, block_size) for n in range(1000, 1000 + block_size)]
    assert max(tails) == block_size - 1 and mean_tail_waste(block_size) == sum(tails) / block_size
    with pytest.raises(ValueError, match="block_size"):
        mean_tail_waste(0)
