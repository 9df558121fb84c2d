"""The scheduler on random workloads (Hypothesis): whatever the policy, budget, block size, batch cap,
watermark, sliding window or prefix caching, it never exceeds its budget, never leaks a block, keeps the
cache consistent, and finishes every request with exactly its output length, preempted ones included."""

from __future__ import annotations

import math

from helpers import arrival_steps
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.sim.budgets import POLICIES, SlabScheduler
from pagedlib.sim.simulate import CATEGORIES, held_slots, new_scheduler, simulate, write_fake_kv
from pagedlib.sim.workloads import fake_output_token, fake_token_ids
from pagedlib.testing import check_invariants

MAX_MODEL_LEN = 40


@st.composite
def workloads(draw):
    """Up to 12 requests; each prompt is a piece of one shared 20-token text followed by random ids from
    a 2-token vocabulary, so that prefixes are shared often (whole blocks, and single tokens at size 1)."""
    n = draw(st.integers(1, 12))
    rows = draw(st.lists(st.tuples(st.integers(0, 15), st.integers(1, 20), st.integers(1, 20)),
                         min_size=n, max_size=n))
    shared = draw(st.lists(st.integers(0, 1), min_size=20, max_size=20))
    out = []
    for i, (a, p, o) in enumerate(rows):
        head = shared[:draw(st.integers(0, p))]
        out.append(Request(i, a, p, o, tuple(head + draw(st.lists(st.integers(0, 1), min_size=p - len(head),
                                                                   max_size=p - len(head))))))
    return out


@st.composite
def configs(draw, caching=False):
    """Any policy and options; with ``caching``, the paged policy with prefix caching (no window)."""
    policy = "paged" if caching else draw(st.sampled_from(POLICIES))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    watermark = draw(st.sampled_from([0.0, 0.05, 0.2])) if policy == "paged" else 0.0
    window = draw(st.none() | st.integers(1, 24)) if policy == "paged" and not caching else None
    need = math.ceil(MAX_MODEL_LEN / block_size)           # any request fits alone
    budget = math.ceil((need + draw(st.integers(0, 4 if caching else 12))) / (1 - watermark)) + 1
    return dict(policy=policy, block_size=block_size, watermark=watermark, sliding_window=window,
                kv_budget_blocks=budget, max_num_seqs=draw(st.integers(1, 6)), caching=caching)


any_config = configs() | configs(caching=True)


def check_step(sched: Scheduler, plan, cfg) -> None:
    cache, bs = sched.cache, cfg["block_size"]
    check_invariants(cache)
    assert len(sched.running) <= cfg["max_num_seqs"]
    if not isinstance(sched, SlabScheduler):
        assert cache.num_used_blocks <= cfg["kv_budget_blocks"]
    else:
        spans = sorted(sched.slots.slabs.values())
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))       # disjoint
        assert sched.slots.used_slots <= cfg["kv_budget_blocks"] * bs
        assert all(cache.seq_lens[r.req_id] <= held_slots(sched, r) for r in sched.running)
    for r in sched.running:  # after the step's writes: its tokens are computed
        n = cache.seq_lens[r.req_id]
        start = r.num_computed_tokens + dict(plan.work).get(r, 0) - n
        k, v = cache.gather(r.req_id)                 # K = position, V = request id
        assert k.flatten().tolist() == list(range(start, start + n))
        if cfg["caching"]:  # found blocks hold another request's V, and exactly this request's tokens
            assert cache.token_ids[r.req_id] == fake_token_ids(r, n)
            assert set(v.flatten().tolist()) <= set(range(12))
        else:
            assert set(v.flatten().tolist()) <= {r.req_id}
        assert len(r.output_tokens) < r.output_len
    if cfg["sliding_window"]:
        limit = math.ceil(cfg["sliding_window"] / bs) + 1
        assert all(len(cache.tables[r.req_id]) <= limit for r in plan.decode)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workloads(), cfg=any_config)
def test_scheduler_invariants_step_by_step(requests, cfg):
    sched = new_scheduler(requests, cfg["policy"], cfg["kv_budget_blocks"], cfg["block_size"],
                          max_num_seqs=cfg["max_num_seqs"], watermark=cfg["watermark"],
                          sliding_window=cfg["sliding_window"], max_model_len=MAX_MODEL_LEN,
                          enable_prefix_caching=cfg["caching"])
    cache = sched.cache
    generated, final = {}, {}
    for _ in arrival_steps(sched, requests):
        plan = sched.schedule()
        write_fake_kv(sched, plan)
        check_step(sched, plan, cfg)
        for r in sched.update(plan, [fake_output_token(r) for r, _ in plan.work]):
            generated[r.req_id] = len(r.output_tokens)
            final[r.req_id] = r.num_computed_tokens
            if cfg["caching"]:
                assert r.token_ids == fake_token_ids(r, r.prompt_len + r.output_len)
    assert generated == {r.req_id: r.output_len for r in requests}
    assert final == {r.req_id: r.max_kv_len for r in requests}
    assert cache.num_free_blocks == cache.num_blocks
    if isinstance(sched, SlabScheduler):
        assert not sched.slots.slabs
    check_invariants(cache)


@settings(max_examples=80, deadline=None)
@given(requests=workloads(), cfg=any_config)
def test_simulate_accounts_for_every_slot(requests, cfg):
    budget_slots = cfg["kv_budget_blocks"] * cfg["block_size"]
    r = simulate(requests, cfg["policy"], cfg["kv_budget_blocks"], cfg["block_size"],
                 max_num_seqs=cfg["max_num_seqs"], watermark=cfg["watermark"],
                 sliding_window=cfg["sliding_window"], max_model_len=MAX_MODEL_LEN,
                 enable_prefix_caching=cfg["caching"])
    assert r.leaked_blocks == 0
    assert r.tokens_generated == sum(q.output_len for q in requests)
    assert sorted((q.req_id, q.generated, q.final_kv_len) for q in r.requests) == \
        sorted((q.req_id, q.output_len, q.max_kv_len) for q in requests)
    s = r.series
    in_use = s["token"] + s["reservation"] + s["internal"]
    assert (in_use + s["free"] == budget_slots).all()                 # every slot is somewhere
    assert (s["external"] + s["other"] <= s["free"]).all()
    assert abs(sum(r.breakdown[k] for k in CATEGORIES) - 1) < 1e-9
    assert r.preemptions == 0 or cfg["policy"] == "paged"
    assert s["preempted"].sum() == r.preemptions                       # the per-step marks of the figures
    assert r.prefill_tokens + r.cached_tokens >= sum(q.prompt_len for q in requests)
    if cfg["caching"]:  # every token of an admission is looked up: found (cached) or computed (prefill)
        assert r.cached_tokens % cfg["block_size"] == 0
        event(f"prefix caching, {'some' if r.cached_tokens else 'no'} tokens found, "
              f"{'some' if r.preemptions else 'no'} preemptions")
        assert r.prefix_cache_hit_rate == r.cached_tokens / (r.cached_tokens + r.prefill_tokens)
    else:  # a readmission computes what was lost, plus the token the interrupted decode would have fed
        assert r.cached_tokens == 0 and r.prefix_cache_hit_rate is None
        assert r.prefill_tokens == sum(q.prompt_len for q in requests) + r.recomputed_tokens + r.preemptions
