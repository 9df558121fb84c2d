"""Notebook 14's prices: colocated against disaggregated serving under the course's step cost."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlib.sim import disagg
from pagedlib.sim.disagg import NDR_400, best_colocated, colocated, disaggregated, goodput, step_cost
from pagedlib.sim.offload import LLAMA_3_8B

COST = step_cost()


def test_the_step_cost_is_the_datasheets_arithmetic():
    assert COST.fixed == pytest.approx(2 * 8.03e9 / 3.35e12)          # fp16 weights read once
    assert COST.per_token == pytest.approx(2 * 8.03e9 / 989e12)      # 2 FLOPs a weight
    assert COST.per_context == pytest.approx(2 * 32 * 8 * 128 * 2 / 3.35e12)  # 128 KiB of K/V a token
    assert NDR_400.bytes_per_second == 50e9


@pytest.mark.parametrize("prompt, output, rate", [(4000, 200, 5.0), (200, 400, 40.0), (1000, 1000, 3.0)])
def test_a_colocated_step_is_the_fixed_point_of_its_load(prompt, output, rate):
    latency = colocated(COST, prompt, output, rate)
    t, r = latency.mean_itl, rate / 2
    decoding = r * output * t  # Little's law: requests decoding on one GPU
    tokens = decoding + r * t * prompt  # its decodes and the prompt tokens arriving in one step
    context = decoding * (prompt + output / 2)
    assert t == pytest.approx(COST.fixed + COST.per_token * tokens + COST.per_context * context)
    assert latency.itl >= t  # a decode beside a chunk waits for the whole step


def test_disaggregated_first_token_is_the_prefill_and_the_transfer():
    latency = disaggregated(COST, 4000, 200, 1.0)
    prefill = COST.fixed + (COST.per_token + COST.per_context) * 4000
    assert latency.ttft == pytest.approx(prefill + 4000 * LLAMA_3_8B.kv_bytes_per_token / 50e9)
    assert latency.itl == latency.mean_itl


def test_latency_grows_with_the_rate_until_the_gpus_cannot_keep_up():
    rates = [1, 5, 10, 15]
    itls = [colocated(COST, 4000, 200, r).mean_itl for r in rates]
    assert itls == sorted(itls)
    assert colocated(COST, 4000, 200, 1e4) is None and disaggregated(COST, 4000, 200, 1e4) is None


@pytest.mark.parametrize("serve, options", [(colocated, {"budget": 512}), (disaggregated, {})])
def test_goodput_is_the_edge_of_the_objectives(serve, options):
    slo = {"ttft_slo": 0.5, "itl_slo": 0.02}
    rate = goodput(serve, 4000, 200, cost=COST, **slo, **options)
    assert rate > 0

    def meets(r):
        latency = serve(COST, 4000, 200, r, **options)
        return latency is not None and latency.ttft <= 0.5 and latency.itl <= 0.02

    assert meets(rate) and not meets(rate * 1.002)
    assert goodput(serve, 4000, 200, cost=COST, ttft_slo=1e-6, itl_slo=1.0, **options) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.integers(16, 16000), st.integers(1, 4000))
def test_a_one_to_one_split_never_serves_more_requests_than_two_colocated_gpus(prompt, output):
    """Throughput alone: the split's rate is the smaller of two GPUs' limits, colocation's at least their
    harmonic mean."""
    loose = {"ttft_slo": math.inf, "itl_slo": math.inf}
    split = goodput(disaggregated, prompt, output, cost=COST, **loose)
    together = goodput(colocated, prompt, output, cost=COST, budget=10**9, **loose)
    assert split <= together * 1.002


def test_splitting_pays_for_long_prompts_under_a_tight_inter_token_objective_only():
    tight = {"ttft_slo": 0.3, "itl_slo": 0.012}
    loose = {"ttft_slo": 1.0, "itl_slo": 0.05}
    for prompt, output in ((4000, 200), (8000, 100)):
        assert goodput(disaggregated, prompt, output, cost=COST, **tight) > \
            best_colocated(COST, prompt, output, **tight)[0]
        assert goodput(disaggregated, prompt, output, cost=COST, **loose) < \
            best_colocated(COST, prompt, output, **loose)[0]
    assert goodput(disaggregated, 200, 400, cost=COST, **tight) < best_colocated(COST, 200, 400, **tight)[0]


def test_best_colocated_tries_each_budget():
    rate, budget = best_colocated(COST, 4000, 200, ttft_slo=0.5, itl_slo=0.02)
    assert budget in disagg.BUDGETS
    assert rate == max(goodput(colocated, 4000, 200, cost=COST, ttft_slo=0.5, itl_slo=0.02, budget=b)
                       for b in disagg.BUDGETS)
