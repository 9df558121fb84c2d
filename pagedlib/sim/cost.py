"""A simulation's steps in modelled seconds (notebooks 07 and 10): ``simulate`` counts steps, and a step that
prefills a long prompt, or recomputes a preempted request, weighs as much as a decode step of one token.
``StepCost`` (notebook 09, section 1) prices each step by the tokens it computes and the K/V it reads."""

from __future__ import annotations

import numpy as np

from pagedlib.sim.simulate import SimResult, StepCost

#: Notebook 09's fit (section 6) on a CPU (a random Llama of hidden size 256 with 4 layers in fp32),
#: rounded: an order of magnitude, a CPU's ratios, not a property of any GPU.
FITTED_COST = StepCost(fixed=6e-3, per_token=9e-5, per_context=1.7e-6)

#: A GPU's ratios instead, from datasheet peaks (lower bounds on each cost): OPT-13B in fp16 on an A100-40GB
#: (1,555 GB/s of HBM, 312 TFLOP/s of dense fp16 tensor-core arithmetic, NVIDIA's A100 datasheet), the
#: setting of notebook 07's workloads. A step reads the 26 GB of weights once (``fixed``), computes 2 FLOPs
#: per weight for each new token (``per_token``) and reads 800 KiB of K/V (40 layers x K and V x 5,120 x 2
#: bytes) for each token of context (``per_context``).
A100_OPT13B_COST = StepCost(fixed=2 * 13e9 / 1.555e12, per_token=2 * 13e9 / 312e12,
                            per_context=40 * 2 * 5120 * 2 / 1.555e12)


def step_seconds(result: SimResult, cost: StepCost) -> np.ndarray:
    """Modelled seconds of every simulated step, ``[steps]``: the fixed cost, the new tokens (prefills,
    recomputations and decodes) and the K/V tokens attention reads."""
    series = result.series
    return cost.fixed + cost.per_token * series["tokens"] + cost.per_context * series["context"]


def busy_seconds(result: SimResult, cost: StepCost) -> float:
    """Modelled seconds of the whole run, summed over the steps simulated (idle stretches are skipped, so
    they count nothing)."""
    return float(step_seconds(result, cost).sum())


def mean_latency_seconds(result: SimResult, cost: StepCost) -> float:
    """Mean modelled seconds from the start of a request's arrival step to the end of the step that sampled
    its last token (``SimResult.mean_latency`` counts the same span in steps)."""
    ends = np.cumsum(step_seconds(result, cost))                        # [steps] clock at each step's end
    end_of = dict(zip(result.series["step"].tolist(), ends.tolist()))
    start_of = dict(zip(result.series["step"].tolist(), (ends - step_seconds(result, cost)).tolist()))
    spans = [end_of[request.finished] - start_of[request.arrival] for request in result.requests]
    if not spans:
        return 0.0
    return float(np.mean(spans))


def tokens_per_second(result: SimResult, cost: StepCost) -> float:
    """Generated tokens per modelled busy second: recomputed tokens cost time and add nothing here."""
    seconds = busy_seconds(result, cost)
    if seconds == 0:
        return 0.0
    return result.tokens_generated / seconds


def mean_occupancy(result: SimResult) -> float:
    """Mean share of the budget's slots holding a token's K/V, over the steps simulated: how full the memory
    is on average, where ``peak_running`` only says how many requests it held at its fullest moment."""
    tokens = result.series["token"]                                   # [steps] slots holding a token
    if len(tokens) == 0:
        return 0.0
    return float(tokens.mean() / (result.kv_budget_blocks * result.block_size))
