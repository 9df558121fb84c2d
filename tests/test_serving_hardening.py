"""The scheduler, the workloads and the serving command line under a hostile user (issue 19): a concurrency
cap that does not size memory, sliding windows counted at admission, a step that fails and leaves nothing
half-done, every bad argument named, every bad flag a usage error before any work."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

import pagedlib.bench.serving as serving_cli
from pagedlib.bench.__main__ import main as bench_main
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.sim.budgets import SlabScheduler
from pagedlib.sim.simulate import sim_step, simulate
from pagedlib.sim.window import WindowScheduler
from pagedlib.sim.workloads import (
    LengthModel,
    alpaca_like,
    shared_prompt_like,
    sharegpt_like,
    synthetic_workload,
)
from pagedlib.testing import check_invariants

LIMIT = 2 * 2**30  # address space of the probe: a few times what importing torch and pagedlib takes


def run_limited(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter whose address space is capped at ``LIMIT`` bytes."""
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


# ------------------------------------------------------------------------------------------------------
# a concurrency cap is not a memory size (item 4)


def test_a_huge_max_num_seqs_allocates_nothing_for_it():
    out = run_limited("""
        from pagedlib.sim.simulate import simulate
        from pagedlib.sim.workloads import sharegpt_like
        reqs = sharegpt_like(3)
        for policy in ("paged", "reserve-max", "reserve-oracle"):
            r = simulate(reqs, policy, 400, max_num_seqs=10**8)
            assert r.tokens_generated == sum(q.output_len for q in reqs) and r.leaked_blocks == 0
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_command_line_max_num_seqs_allocates_nothing_for_it():
    out = run_limited("""
        from pagedlib.bench.__main__ import main
        main(["serving", "--num-requests", "3", "--budget-blocks", "400", "--max-num-seqs", "100000000"])
    """)
    assert out.returncode == 0 and "reserve-max" in out.stdout, out.stderr[-2000:]


def test_the_cap_still_caps():
    reqs = alpaca_like(12, rate=math.inf)
    for policy in ("paged", "reserve-oracle"):
        assert simulate(reqs, policy, 400, max_num_seqs=3).peak_running == 3
        assert simulate(reqs, policy, 400, max_num_seqs=100).peak_running == 12


# ------------------------------------------------------------------------------------------------------
# sliding windows at admission (item 5)


def test_a_windowed_request_is_checked_against_what_it_holds():
    # window 8, blocks of 4: the request holds at most ceil((8 + 4) / 4) = 3 blocks, not its 26
    long = Request(0, 0, prompt_len=4, output_len=100)
    sched = WindowScheduler(PagedKVCache(3, 1, 4, 1, 1), 8, watermark=0.0, max_model_len=128)
    sched.check(long)
    unwindowed = Scheduler(PagedKVCache(3, 1, 4, 1, 1), watermark=0.0, max_model_len=128)
    with pytest.raises(ValueError, match="needs 26 blocks"):
        unwindowed.check(long)
    r = simulate([long], "paged", 3, 4, watermark=0.0, max_model_len=128, sliding_window=8)
    assert r.requests[0].generated == 100 and r.requests[0].final_kv_len == long.max_kv_len
    assert r.leaked_blocks == 0


def test_windowed_requests_preempted_late_come_back_within_their_window():
    # two long windowed requests in a pool that holds one and a half: preemptions happen late in their
    # lives, and a readmitted request stores only what its window still sees
    reqs = [Request(0, 0, 20, 60), Request(1, 0, 3, 70)]
    cache = PagedKVCache(5, 1, 4, 1, 1)
    sched = WindowScheduler(cache, 8, watermark=0.0, max_model_len=128)
    for q in reqs:
        sched.add(q)
    steps = preemptions = 0
    while sched.has_unfinished and steps < 1000:
        plan, _ = sim_step(sched)
        preemptions += len(plan.preempted)
        for r in sched.running:  # K holds each token's position: what is held is the window's tail
            k, _ = cache.gather(r.req_id)
            start = r.num_computed_tokens - cache.seq_lens[r.req_id]
            assert k.flatten().tolist() == list(range(start, r.num_computed_tokens))
            assert len(cache.tables[r.req_id]) <= 5
        steps += 1
    assert not sched.has_unfinished and preemptions > 0 and cache.num_free_blocks == 5


# ------------------------------------------------------------------------------------------------------
# a step that fails changes nothing (item 5)


def snapshot(sched: Scheduler) -> tuple:
    slabs = {}
    if isinstance(sched, SlabScheduler):
        slabs = dict(sched.slots.slabs)
    requests = [(r.req_id, r.status, r.num_computed_tokens, list(r.output_tokens))
                for r in sched.requests.values()]
    return ([r.req_id for r in sched.waiting], [r.req_id for r in sched.running], requests,
            dict(sched.cache.seq_lens), sched.cache.num_free_blocks, slabs)


def fail_on(monkeypatch, cache: PagedKVCache, seq_id: int, error: BaseException) -> dict:
    """Make the block manager's ``add_sequence(seq_id, ...)`` (the scheduler's admission) raise ``error``
    while the returned switch is on."""
    switch = {"on": True}
    add_sequence = cache.manager.add_sequence

    def failing(sid, *args):
        if sid == seq_id and switch["on"]:
            raise error
        return add_sequence(sid, *args)

    monkeypatch.setattr(cache.manager, "add_sequence", failing)
    return switch


@pytest.mark.parametrize("budget", [None, 8])
@pytest.mark.parametrize("error", [ValueError("bad ids"), KeyboardInterrupt()])
def test_a_failing_admission_leaves_every_request_waiting(monkeypatch, error, budget):
    # issue 30 item 4: the chunked step left a request running with a token and no K/V; both modes now
    # undo this step's admissions before the error propagates
    cache = PagedKVCache(16, 1, 4, 1, 1, enable_prefix_caching=True)
    sched = Scheduler(cache, watermark=0.0, max_model_len=32, max_num_batched_tokens=budget)
    for i in range(3):
        sched.add(Request(i, 0, 3, 2, tuple(range(10 * i, 10 * i + 3))))
    switch = fail_on(monkeypatch, cache, 1, error)
    before = snapshot(sched)
    with pytest.raises(type(error)):
        sched.schedule()
    assert snapshot(sched) == before
    check_invariants(cache)
    switch["on"] = False
    plan, _ = sim_step(sched)                     # and the scheduler works on
    assert [r.req_id for r, _ in plan.prefill] == [0, 1, 2]


def test_a_failing_model_step_leaves_the_requests_where_the_plan_found_them():
    # an interrupt in the forward pass: the plan is undone, no request has advanced, the cache is as before
    # the step, and the next plan computes the same tokens again
    cache = PagedKVCache(16, 1, 4, 1, 1)
    sched = Scheduler(cache, watermark=0.0, max_model_len=32, max_num_batched_tokens=4)
    for i in range(2):
        sched.add(Request(i, 0, 6, 2))
    sim_step(sched)                               # request 0: 4 of its 6 tokens
    before = snapshot(sched)
    plan = sched.schedule()                       # request 0: 2 more; request 1: its first 2
    sched.undo(plan)                              # the model raised: nothing was written or sampled
    assert snapshot(sched) == before
    with pytest.raises(ValueError, match="open plan"):
        sched.update(plan, [0, 0])                # an undone plan is not taken again
    again, _ = sim_step(sched)
    assert [(r.req_id, n) for r, n in again.prefill] == [(0, 2), (1, 2)]
    assert sched.requests[0].output_tokens and not sched.requests[1].output_tokens


def test_a_failing_add_sequence_gives_the_slabs_back():
    cache = PagedKVCache(12, 1, 4, 1, 1)
    sched = SlabScheduler(cache, "reserve-oracle", max_num_seqs=4, kv_budget_blocks=8, max_model_len=32)
    for i in range(3):
        sched.add(Request(i, 0, 5, 2))
    cache.add_sequence(1)                     # a caller who touched the cache behind the scheduler's back
    before = snapshot(sched)
    with pytest.raises(ValueError, match="1"):
        sched.schedule()
    assert snapshot(sched) == before
    cache.free_sequence(1)
    assert [r.req_id for r, _ in sched.schedule().prefill] == [0, 1, 2]


# ------------------------------------------------------------------------------------------------------
# workload arguments are the ones named in the error (item 5)


@pytest.mark.parametrize("make, kwargs, name", [
    (sharegpt_like, {"rate": 1e-30}, "rate"),
    (sharegpt_like, {"num_requests": 10**12}, "num_requests"),
    (sharegpt_like, {"max_model_len": 10**30}, "max_model_len"),
    (shared_prompt_like, {"system_len": 2048}, "system_len"),
    (shared_prompt_like, {"vocab_size": 2**63}, "vocab_size"),
    (shared_prompt_like, {"num_system_prompts": 10**9}, "num_system_prompts"),
    (shared_prompt_like, {"rate": -1.0}, "rate"),
])
def test_workload_errors_name_the_argument_given(make, kwargs, name):
    args = {"num_requests": 5, **kwargs}
    with pytest.raises(ValueError, match=f"^{name}"):
        make(**args)


def test_shared_prompt_like_names_what_the_caller_passed():
    # issue 30 item 14: shared_prompt_like(0) said "num_system_prompts must be <= 1, got 2"
    assert shared_prompt_like(0) == []
    with pytest.raises(ValueError, match="num_system_prompts must be <= num_requests = 1"):
        shared_prompt_like(1)


def test_the_largest_accepted_values_work():
    assert len(shared_prompt_like(3, system_len=2046, vocab_size=2**40)) == 3
    assert sharegpt_like(3, rate=1e-12)[-1].arrival > 10**12


def test_a_budget_beyond_int32_slots_is_refused_by_name():
    for budget, block_size in ((2**31, 1), (2**27, 16)):
        with pytest.raises(ValueError, match="^kv_budget_blocks"):
            simulate(sharegpt_like(2), "paged", budget, block_size)


@pytest.mark.parametrize("bad", [{"prompt_mean": -1.0}, {"output_sigma": math.nan}, {"prompt_mean": math.inf},
                                 {"output_mean": True}])
def test_length_model_fields_are_checked(bad):
    fields = {"prompt_mean": 10.0, "prompt_sigma": 0.5, "output_mean": 20.0, "output_sigma": 0.5, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        synthetic_workload(3, LengthModel(**fields))


# ------------------------------------------------------------------------------------------------------
# the command line: bad flags are usage errors before any work (item 5)


@pytest.mark.parametrize("flags", [
    ["--rate", "0"], ["--rate", "x"], ["--budget-blocks", "0"], ["--num-requests", "-1"],
    ["--block-size", "0"], ["--max-num-seqs", "0"], ["--seed", "-1"], ["--num-requests", "2.5"],
    ["--json", "/nonexistent/dir/x.json"],
    ["--enable-prefix-caching"],                       # needs --workload shared
    ["--budget-blocks", "3"],                          # a request that could never run
    ["--workload", "shared", "--policies", "paged", "--budget-blocks", "40", "--block-size", "4"],
])
def test_bad_flags_are_usage_errors_before_any_work(flags, monkeypatch, capsys):
    monkeypatch.setattr(serving_cli, "simulate", lambda *a, **k: pytest.fail("simulated before the check"))
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["serving", "--num-requests", "20", *flags])
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err
