"""Notebook 13's prices for moving K/V against computing it again."""

from __future__ import annotations

import math

import pytest

from pagedlib.sim.offload import (
    ACCELERATORS,
    LINKS,
    LLAMA_3_8B,
    Transformer,
    crossover_tokens,
    load_over_recompute,
    load_seconds,
    recompute_seconds,
)


def test_the_running_example_holds_128_kib_a_token():
    # notebook 01: 512 MiB for a 4,096-token sequence of the 32-layer GQA model in fp16
    assert LLAMA_3_8B.kv_bytes_per_token * 4096 == 512 * 2**20


def test_link_bandwidths_follow_from_their_signalling_rates():
    assert LINKS["PCIe 4.0 x16"].bytes_per_second == pytest.approx(31.5e9, rel=1e-3)
    assert LINKS["PCIe 5.0 x16"].bytes_per_second == pytest.approx(63.0e9, rel=1e-3)
    assert LINKS["NVLink-C2C"].bytes_per_second == 450e9


def test_load_time_is_copies_times_overhead_plus_bytes_over_bandwidth():
    link = LINKS["PCIe 4.0 x16"]
    got = load_seconds(LLAMA_3_8B, 100, link, block_size=16, per_transfer=1e-5, transfers_per_block=64)
    assert got == pytest.approx(7 * 64 * 1e-5 + 100 * 131072 / link.bytes_per_second)


def test_recompute_counts_weights_and_causal_attention():
    small = Transformer("t", num_layers=2, kv_heads=1, head_dim=4, q_heads=2, params=1000)
    a100 = ACCELERATORS["A100"]
    assert recompute_seconds(small, 10, a100) == pytest.approx((2 * 1000 * 10 + 2 * 2 * 8 * 100) / 312e12)


@pytest.mark.parametrize("name", ACCELERATORS)
@pytest.mark.parametrize("block_size,per_transfer",
                         [(1, 1e-5), (4, 1e-5), (16, 1e-5), (16, 0.0), (256, 1e-4)])
def test_the_crossover_is_where_loading_starts_to_win(name, block_size, per_transfer):
    accelerator = ACCELERATORS[name]
    options = dict(block_size=block_size, per_transfer=per_transfer, transfers_per_block=64)
    n = crossover_tokens(LLAMA_3_8B, accelerator, **options)
    # a multiple of the block size, so ceil() does not move it: below the crossover recomputing wins
    above = block_size * (math.floor(n / block_size) + 2)
    assert load_over_recompute(LLAMA_3_8B, above, accelerator, **options) < 1
    if n > 2 * block_size:
        below = block_size * max(1, math.floor(n / block_size) - 1)
        assert load_over_recompute(LLAMA_3_8B, below, accelerator, **options) > 1
