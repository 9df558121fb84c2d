"""The simulation in modelled seconds (notebooks 07 and 10): a step costs what it computes and reads, so a
recomputation costs time, a request's latency spans the steps from its arrival to its last token, and the
mean occupancy is the tokens held, averaged over the steps, not the fullest moment."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagedlib.core.scheduler import Request
from pagedlib.sim.cost import (
    FITTED_COST,
    busy_seconds,
    mean_latency_seconds,
    mean_occupancy,
    step_seconds,
    tokens_per_second,
)
from pagedlib.sim.simulate import StepCost, simulate
from pagedlib.sim.workloads import sharegpt_like

UNIT_STEPS = StepCost(fixed=1.0, per_token=0.0, per_context=0.0)  # every step one second: seconds = steps


@pytest.fixture(scope="module")
def tight():
    """The budget sweep of notebook 07 at its tightest budget: many preemptions."""
    return simulate(sharegpt_like(30, seed=1, rate=math.inf), "paged", 160, 16)


def test_a_step_costs_its_fixed_part_its_tokens_and_the_kv_it_reads():
    # one request, 4 prompt tokens and 3 outputs, blocks of 4: a prefill of 4 tokens, then 2 decodes
    res = simulate([Request(0, 0, 4, 3)], "paged", 4, 4, max_model_len=16)
    cost = StepCost(fixed=1.0, per_token=10.0, per_context=100.0)
    assert res.series["tokens"].tolist() == [4, 1, 1] and res.series["context"].tolist() == [4, 5, 6]
    assert step_seconds(res, cost).tolist() == [1 + 40 + 400, 1 + 10 + 500, 1 + 10 + 600]
    assert busy_seconds(res, cost) == 441 + 511 + 611


def test_under_unit_steps_the_modelled_latency_is_the_latency_in_steps(tight):
    assert tight.preemptions > 0
    assert mean_latency_seconds(tight, UNIT_STEPS) == pytest.approx(tight.mean_latency)
    assert busy_seconds(tight, UNIT_STEPS) == tight.steps
    assert tokens_per_second(tight, UNIT_STEPS) == pytest.approx(tight.tokens_generated / tight.steps)


def test_recomputation_costs_time_that_steps_do_not_show(tight):
    """Priced by the token, a run costs every prompt token, every token fed back for a decode, and every
    token recomputed after a preemption (a readmission's prefill also feeds the token a decode would have)."""
    per_token = StepCost(fixed=0.0, per_token=1.0, per_context=0.0)
    prompts = sum(r.prompt_len for r in sharegpt_like(30, seed=1, rate=math.inf))
    decodes = tight.tokens_generated - 30 - tight.preemptions  # first tokens come from prefills
    assert busy_seconds(tight, per_token) == tight.prefill_tokens + decodes
    assert tight.prefill_tokens == prompts + tight.recomputed_tokens + tight.preemptions
    assert tight.recomputed_tokens > 0


def test_latency_spans_idle_gaps_and_counts_from_the_arrival_step():
    # two requests far apart: the idle stretch between them is skipped and counts nothing
    res = simulate([Request(0, 0, 4, 2), Request(1, 100, 4, 2)], "paged", 8, 4, max_model_len=16)
    assert busy_seconds(res, UNIT_STEPS) == 4
    assert mean_latency_seconds(res, UNIT_STEPS) == 2.0
    cost = StepCost(fixed=0.5, per_token=0.25, per_context=0.0)   # prefill 0.5 + 1.0, decode 0.5 + 0.25
    assert mean_latency_seconds(res, cost) == pytest.approx(1.5 + 0.75)


def test_mean_occupancy_is_an_average_not_a_peak(tight):
    slots = tight.kv_budget_blocks * tight.block_size
    assert mean_occupancy(tight) == pytest.approx(float(np.mean(tight.series["token"])) / slots)
    assert 0 < mean_occupancy(tight) <= tight.series["token"].max() / slots <= 1


def test_an_empty_run_costs_nothing():
    res = simulate([], "paged", 8, 4)
    assert busy_seconds(res, FITTED_COST) == 0.0
    assert mean_latency_seconds(res, FITTED_COST) == 0.0
    assert tokens_per_second(res, FITTED_COST) == 0.0
    assert mean_occupancy(res) == 0.0
