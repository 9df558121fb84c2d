"""Chunked prefill (notebook 09): the token-budget scheduler keeps its token and block budgets on random
workloads and gives every request exactly its tokens; the simulator's latencies follow from the steps; the
engine's one forward pass per step over flattened tokens gives transformers' tokens with chunking on (chunks
that split prompts mid-block and on block boundaries, tight pools with preemption, prefix caching, Triton in
the interpreter)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.engine import Engine
from pagedlib.sim.simulate import StepCost, new_scheduler, sim_step, simulate, write_fake_kv
from pagedlib.sim.workloads import fake_output_token, shared_prompt_like
from pagedlib.testing import check_invariants

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (conftest)


# ------------------------------------------------------------------------------------------------------
# the scheduler, on fake K/V


@st.composite
def workloads(draw):
    """Requests (with token ids from a 3-token vocabulary, so prefixes repeat) and the scheduler's sizes:
    the pool holds the largest request alone and sometimes little more."""
    n = draw(st.integers(1, 7))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    requests = []
    for i in range(n):
        prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=40))
        arrival, output = draw(st.integers(0, 6)), draw(st.integers(1, 9))
        requests.append(Request(i, arrival, len(prompt), output, tuple(prompt)))
    alone = max(-(-r.max_kv_len // block_size) for r in requests)
    options = dict(max_num_batched_tokens=draw(st.integers(1, 40)), enable_prefix_caching=draw(st.booleans()),
                   long_prefill_token_threshold=draw(st.none() | st.integers(1, 16)),
                   max_num_seqs=draw(st.integers(1, 8)), watermark=0.0, max_model_len=64)
    return requests, alone + draw(st.integers(0, 12)), block_size, options


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_the_scheduler_keeps_its_budgets_and_every_request_gets_its_tokens(case):
    """Every step: at most ``max_num_batched_tokens`` new tokens, no chunk over the cap (applied, as in vLLM,
    only while more than one request is running or waiting), every running
    request's cache holds exactly its positions 0..n-1 (K = position; V = request id unless a prefix is
    shared): chunks land in order, a preempted request's chunks are gone; sampling requests hold all their
    tokens but the last. In the end: each request sampled exactly ``output_len`` tokens, at most one per
    step, and every block is free."""
    requests, num_blocks, block_size, options = case
    sched = new_scheduler(requests, "paged", num_blocks, block_size, **options)
    budget = sched.max_num_batched_tokens
    arrivals, sampled, step = sorted(requests, key=lambda r: r.arrival), {r.req_id: [] for r in requests}, 0
    while arrivals or sched.has_unfinished:
        while arrivals and arrivals[0].arrival <= step:
            sched.add(arrivals.pop(0))
        cap = budget
        if len(sched.running) + len(sched.waiting) > 1:
            cap = sched.chunk_cap or budget
        plan = sched.schedule()
        write_fake_kv(sched, plan)
        assert plan.num_tokens <= budget and all(1 <= n <= cap for _, n in plan.prefill)
        sampling = plan.sampling
        check_invariants(sched.cache)
        for r in sampling:
            sampled[r.req_id].append(step)
        sched.update(plan, [fake_output_token(r) for r, _ in plan.work])
        for r in sched.running:
            k, v = sched.cache.gather(r.req_id)                                    # [1, n, 1, 1]
            held = sched.cache.seq_lens[r.req_id]
            assert k.flatten().tolist() == list(range(held)) and held == r.num_computed_tokens
            assert options["enable_prefix_caching"] or set(v.flatten().tolist()) <= {r.req_id}  # else shared
            if r in sampling:
                assert held == r.num_tokens - 1
        step += 1
        assert step < 2000, "no progress"
    assert {i: len(s) for i, s in sampled.items()} == {r.req_id: r.output_len for r in requests}
    assert all(len(set(s)) == len(s) for s in sampled.values())
    assert sched.cache.num_free_blocks == num_blocks


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode():
    """Budget 8: step 0 prefills 8 of request 0's 10 tokens; step 1 its last 2 (first token) and request
    1's 3; then request 0 and 1 decode first and request 2's 20-token prompt takes what is left."""
    sched = Scheduler(PagedKVCache(20, 1, 4, 1, 1), max_num_batched_tokens=8, watermark=0.0, max_model_len=64)
    for i, (p, o) in enumerate([(10, 3), (3, 4), (20, 2)]):
        sched.add(Request(i, 0, p, o))
    seen = []
    for _ in range(4):
        plan = sched.schedule()
        partial = sorted(r.req_id for r, n in plan.prefill if r not in plan.sampling)
        seen.append(([r.req_id for r in plan.decode], [(r.req_id, n) for r, n in plan.prefill], partial))
        write_fake_kv(sched, plan)
        sched.update(plan, [fake_output_token(r) for r, _ in plan.work])
    assert seen == [([], [(0, 8)], [0]), ([], [(0, 2), (1, 3), (2, 3)], [2]), ([0, 1], [(2, 6)], [2]),
                    ([0, 1], [(2, 6)], [2])]


def test_a_request_preempted_mid_prefill_starts_again():
    """Admitted on its first chunk alone (``full_prompt_must_fit=False``), request 1 has 3 of its 12 tokens
    stored when request 0's decode needs its block back: it loses the chunk (recomputed_tokens), waits first
    in line, and is prefilled from position 0 when it returns. With vLLM's rule (the default) it is not
    admitted until its whole prompt fits, and nobody is preempted."""
    for must_fit in (True, False):
        sched = Scheduler(PagedKVCache(4, 1, 4, 1, 1), max_num_batched_tokens=4, max_model_len=64,
                          full_prompt_must_fit=must_fit)
        sched.add(Request(0, 0, 8, 5))
        sched.add(Request(1, 0, 12, 2))
        plans = []
        while sched.has_unfinished and len(plans) < 40:
            plans.append(sim_step(sched)[0])
        assert not sched.has_unfinished and any(plan.preempted for plan in plans) is not must_fit
    recomputed = sum(plan.counts.recomputed_tokens for plan in plans)
    assert recomputed > 0
    back = next(i for i, p in enumerate(plans) if p.preempted) + 1
    assert any(r.req_id == 1 for r, _ in plans[back].prefill + plans[back + 1].prefill)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(max_num_batched_tokens=8, long_prefill_token_threshold=0), "long_prefill_token_threshold must be"),
    (dict(max_num_batched_tokens=True), "must be an int"),
    (dict(long_prefill_token_threshold=4), "needs max_num_batched_tokens"),
])
def test_bad_token_budgets_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Scheduler(PagedKVCache(8, 1, 4, 1, 1), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(policy="reserve-max", max_num_seqs=4), "needs the 'paged' policy"),
    (dict(policy="paged", sliding_window=4), "no sliding_window"),
])
def test_chunking_with_a_slab_or_a_window_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        new_scheduler([Request(0, 0, 4, 2)], kv_budget_blocks=8, block_size=4, max_num_batched_tokens=8,
                      **kwargs)


def test_the_radix_cache_copy_is_counted_at_admission_in_the_simulator():
    # issue 30 item 1: the partial-block copy took a block admission had reserved for the chunk
    reqs = shared_prompt_like(40)
    radix = simulate(reqs, "paged", 47, 16, enable_prefix_caching=True, prefix_cache="radix",
                     max_num_batched_tokens=16)
    assert radix.leaked_blocks == 0 and radix.tokens_generated == sum(r.output_len for r in reqs)


def test_preempted_mid_prefill_counts_only_what_is_really_recomputed():
    # issue 30 item 17: a request preempted mid-prefill that found its own blocks again was counted as
    # recomputing them. Count, per request, the positions computed again below the furthest position it
    # had computed (or found) before.
    reqs = shared_prompt_like(3, seed=0, system_len=200)
    sched = new_scheduler(reqs, "paged", 30, 16, enable_prefix_caching=True, max_num_batched_tokens=24,
                          watermark=0.0)
    for r in reqs:
        sched.add(r)
    furthest = {r.req_id: 0 for r in reqs}
    true = reported = preemptions = 0
    while sched.has_unfinished:
        plan = sched.schedule()
        for r, n in plan.prefill:
            start = r.num_computed_tokens
            true += max(0, min(start + n, furthest[r.req_id]) - start)
            furthest[r.req_id] = max(furthest[r.req_id], start + n)
        for r in plan.decode:
            furthest[r.req_id] = max(furthest[r.req_id], r.num_computed_tokens + 1)
        reported += plan.counts.recomputed_tokens
        preemptions += len(plan.preempted)
        write_fake_kv(sched, plan)
        sched.update(plan, [fake_output_token(r) for r, _ in plan.work])
    assert preemptions > 0 and true > 0
    assert reported == true


def test_latencies_in_steps_and_in_modelled_seconds():
    """In steps, a request's TTFT counts its arrival step to its first token's; its ITLs are the gaps.
    Under a cost model, a decode stalled by a 400-token prompt's whole prefill waits ~400 token-costs; with
    a 64-token budget no inter-token gap costs more than a step of 64 tokens and the K/V it reads."""
    reqs = [Request(0, 0, 8, 30), Request(1, 5, 400, 3), Request(2, 12, 400, 3)]
    cost = StepCost(fixed=1e-3, per_token=1e-4, per_context=1e-6)
    whole = simulate(reqs, "paged", 64, 16)
    chunked = simulate(reqs, "paged", 64, 16, max_num_batched_tokens=64)
    for res in (whole, chunked):
        lat = res.latencies()
        assert lat["ttft"].tolist() == [r.token_steps[0] - r.arrival + 1 for r in res.requests]
        assert sorted(lat["itl"].tolist()) == sorted(b - a for r in res.requests
                                                     for a, b in zip(r.token_steps, r.token_steps[1:]))
    worst = cost.fixed + cost.per_token * 64 + cost.per_context * int(chunked.series["context"].max())
    assert chunked.latencies(cost)["itl"].max() <= worst + 1e-12
    assert whole.latencies(cost)["itl"].max() > cost.per_token * 400
    assert chunked.series["tokens"].max() <= 64 < whole.series["tokens"].max()


# ------------------------------------------------------------------------------------------------------
# the engine, against transformers


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
    (dict(max_num_batched_tokens=2.5), "max_num_batched_tokens must be an int"),
    (dict(long_prefill_token_threshold=4), "needs max_num_batched_tokens"),
    (dict(max_num_batched_tokens=8, long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
])
def test_bad_engine_token_budgets_are_refused(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, num_blocks=8, **kwargs)
