"""The scheduler over a cache of several KV-cache groups (notebook 15): a request needs blocks in every
group, a sliding-window group fewer as its blocks leave the window, so admission, growth and preemption count
blocks per group as vLLM 0.32.0's ``KVCacheManager.allocate_slots`` does, and a pool with window groups runs
more requests at once than the same pool with full groups."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
from helpers import arrival_steps, write_step_kv
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.connector import KVConnector
from pagedlib.core.groups import FULL, NULL_BLOCK, SLIDING, KVGroup, kv_groups
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.sim.workloads import fake_output_token
from pagedlib.testing import check_invariants
from pagedlib.util import ceil_div

L = 4
MAX_MODEL_LEN = 48


def hybrid(window: int) -> tuple[KVGroup, ...]:
    return kv_groups([SLIDING, FULL, SLIDING, FULL], window, L)


TWO_FULL = (KVGroup(FULL, None, (0, 2)), KVGroup(FULL, None, (1, 3)))  # the same pool, nothing given back


def run(sched: Scheduler, requests: list[Request], check=None) -> dict:
    """Serve ``requests`` (arriving at their steps) to the end, a forward pass writing K = position and V =
    request id; what happened."""
    most_running, preemptions, steps = 0, 0, 0
    for _ in arrival_steps(sched, requests):
        plan = sched.schedule()
        write_step_kv(sched, plan, "request")
        if check is not None:
            check(sched, plan)
        most_running = max(most_running, len(sched.running))
        preemptions += len(plan.preempted)
        steps += 1
        sched.update(plan, [fake_output_token(r) for r, _ in plan.work])
    return dict(most_running=most_running, preemptions=preemptions, steps=steps)


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 8))
    return [Request(i, draw(st.integers(0, 10)), draw(st.integers(1, 30)), draw(st.integers(1, 16)))
            for i in range(n)]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=workloads(), block_size=st.sampled_from([1, 2, 4]), window=st.sampled_from([1, 3, 6, 8, 100]),
       budget=st.sampled_from([None, 5, 16]), spare=st.integers(0, 16), max_num_seqs=st.integers(1, 6),
       must_fit=st.booleans())
def test_hybrid_scheduler_step_by_step(requests, block_size, window, budget, spare, max_num_seqs, must_fit):
    """Random workloads over a hybrid pool just big enough for any request alone, plus ``spare`` blocks:
    after every step the invariants hold per group (window tables exactly as vLLM leaves them), the batch's
    group rows agree with the tables, every request reads back its own K/V in the blocks its groups still
    hold, a window group never holds more than vLLM's admission cap; every request finishes; nothing leaks."""
    groups = hybrid(window)
    probe = Scheduler(PagedKVCache(1, L, block_size, 1, 1, groups=groups), max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=budget)
    alone = max(probe.blocks_alone(r) for r in requests)
    cache = PagedKVCache(alone + spare, L, block_size, 1, 1, groups=groups, fill=float("nan"))
    sched = Scheduler(cache, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=budget,
                      max_num_seqs=max_num_seqs, full_prompt_must_fit=must_fit)
    step = MAX_MODEL_LEN if budget is None else budget
    cap = ceil_div(min(window - 1 + step, MAX_MODEL_LEN), block_size) + 1

    def check(sched: Scheduler, plan) -> None:
        check_invariants(cache)
        batch = plan.batch
        assert batch.group_tables[0] == batch.block_tables and batch.group_slots[0] == batch.slots
        for row, (request, n) in enumerate(plan.work):
            for g, tables in enumerate(cache.group_tables):
                assert batch.group_tables[g][row] == tables[request.req_id]
                assert len(batch.group_slots[g][row]) == n
        for r in sched.running:
            length = cache.seq_lens[r.req_id]
            held = [b for b in cache.group_tables[0][r.req_id] if b != NULL_BLOCK]
            assert len(held) <= cap
            gone = cache.group_tables[0][r.req_id].count(NULL_BLOCK) * block_size
            k, v = cache.gather(r.req_id)  # [L, length, 1, 1]
            for layer in range(L):
                first = gone if layer in groups[0].layers else 0
                assert k[layer, first:].flatten().tolist() == list(range(first, length))
                assert set(v[layer, first:].flatten().tolist()) <= {r.req_id}
                assert k[layer, :first].isnan().all()
        event(f"preempted: {bool(plan.preempted)}")

    outcome = run(sched, requests, check)
    assert all(len(r.output_tokens) == r.output_len for r in requests)
    assert cache.num_free_blocks == cache.num_blocks and not cache.seq_lens
    check_invariants(cache)
    event(f"most running: {min(outcome['most_running'], 3)}")


def test_window_groups_admit_more_than_full_groups_in_the_same_pool():
    """Six 40-token prompts of 8 outputs each, block 4, chunks of 16 tokens, a 32-block pool. With every
    group full attention a request holds 10 + 10 blocks to start and 12 + 12 at the end: one runs at a time.
    With a window-8 group its window table shrinks to 3 blocks as it runs (at most 12 + 3 held), and the
    next one's admission needs 10 + 7 (the window group's capped at cdiv(8 - 1 + 16, 4) + 1 = 7): both fit."""
    requests = [Request(i, 0, 40, 8) for i in range(6)]
    outcomes = {}
    for name, groups in (("full", TWO_FULL), ("window", hybrid(8))):
        cache = PagedKVCache(32, L, 4, 1, 1, groups=groups)
        sched = Scheduler(cache, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
        outcomes[name] = run(sched, [Request(r.req_id, 0, 40, 8) for r in requests])
    assert outcomes["full"]["most_running"] == 1
    assert outcomes["window"]["most_running"] >= 2
    assert outcomes["window"]["steps"] < outcomes["full"]["steps"]


def test_growth_counts_the_blocks_the_window_gives_back_first():
    """A running request whose next step needs a new block in each group: its window group gives a block
    back before the count (vLLM: ``remove_skipped_blocks``, then ``get_num_blocks_to_allocate``), so it
    needs one block net; an undone step holds the block again."""
    cache = PagedKVCache(8, L, 4, 1, 1, groups=hybrid(6))
    sched = Scheduler(cache, max_model_len=MAX_MODEL_LEN)
    sched.add(Request(0, 0, 12, 3))  # 3 + 3 blocks for the prompt: 2 left
    plan = sched.schedule()
    sched.update(plan, [fake_output_token(r) for r, _ in plan.work])
    assert cache.num_free_blocks == 2 and NULL_BLOCK not in cache.group_tables[0][0]
    request = sched.running[0]
    assert sched.blocks_for(request, 1) == 2 - 1  # a new block per group, less block 0 given back
    plan = sched.schedule()  # token 12: block 0 (tokens 0-3) leaves the window (12 - 6 + 1 = 7 skipped)
    assert not plan.preempted and plan.decode == [request]
    assert cache.group_tables[0][0][0] == NULL_BLOCK and cache.num_free_blocks == 1
    check_invariants(cache)
    sched.undo(plan)  # a failed step: block 0 held again
    assert NULL_BLOCK not in cache.group_tables[0][0] and cache.num_free_blocks == 2
    check_invariants(cache)


def test_admission_counts_every_group_with_vllms_window_cap():
    """``blocks_alone``: a full group holds the whole sequence, a window group at most ``cdiv(window - 1 +
    step tokens, block) + 1`` blocks (vLLM's ``SlidingWindowSpec.max_admission_blocks_per_request``)."""
    cache = PagedKVCache(64, L, 4, 1, 1, groups=hybrid(8))
    sched = Scheduler(cache, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8)
    request = Request(0, 0, 40, 8)  # 47 tokens at most: 12 blocks
    assert sched.blocks_alone(request) == 12 + (ceil_div(8 - 1 + 8, 4) + 1)
    plain = Scheduler(PagedKVCache(64, L, 4, 1, 1), max_model_len=MAX_MODEL_LEN)
    assert plain.blocks_alone(request) == math.ceil(47 / 4)


def test_connector_with_groups_is_refused():
    class Nothing(KVConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, plan):
            return None

        def start_load_kv(self, pool, meta):
            pass

        def wait_for_save(self, pool, meta):
            pass

    with pytest.raises(ValueError, match="connector with KV-cache groups .* not supported yet"):
        Scheduler(PagedKVCache(8, L, 4, 1, 1, groups=hybrid(8)), connector=Nothing(4))


# vLLM 0.32.0's admission count for a new request (``get_num_blocks_to_allocate`` with the window cap, as
# ``allocate_slots`` asks it when the full sequence must fit), over a window group and a full group, in a
# child (vLLM's import changes process-wide settings)
VLLM_ADMISSION = """
import json, sys, torch
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
out = []
for block_size, window, budget, max_model_len, num_tokens in json.loads(sys.argv[1]):
    kw = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["s"], SlidingWindowSpec(sliding_window=window, **kw)),
              KVCacheGroupSpec(["f"], FullAttentionSpec(**kw))]
    manager = KVCacheManager(KVCacheConfig(num_blocks=4000, kv_cache_tensors=[], kv_cache_groups=groups),
                             max_model_len=max_model_len, scheduler_block_size=block_size,
                             hash_block_size=block_size, enable_caching=False, max_in_flight_tokens=budget)
    out.append(manager.coordinator.get_num_blocks_to_allocate(
        request_id="new", num_tokens=num_tokens, new_computed_blocks=([], []), num_encoder_tokens=0,
        total_computed_tokens=0, num_local_computed_tokens=0, num_tokens_main_model=num_tokens,
        apply_admission_cap=True))
print(json.dumps(out))
"""


def test_admission_blocks_equal_vllms():
    """``blocks_of(n, capped=True)``, the full-sequence admission count, equals vLLM 0.32.0's for seeded
    random block sizes, windows, token budgets (vLLM's ``max_in_flight_tokens``), model lengths and
    request lengths."""
    rng = random.Random(15)
    cases = []
    for _ in range(60):
        max_model_len = rng.choice([48, 256, 4096])
        cases.append((rng.choice([1, 2, 4, 16]), rng.choice([1, 3, 8, 48, 64, 100]),
                      rng.choice([1, 5, 16, 256, 2048]), max_model_len, rng.randint(1, max_model_len)))
    done = subprocess.run([sys.executable, "-c", VLLM_ADMISSION, json.dumps(cases)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    got = []
    for block_size, window, budget, max_model_len, num_tokens in cases:
        groups = (KVGroup(SLIDING, window, (0,)), KVGroup(FULL, None, (1,)))
        sched = Scheduler(PagedKVCache(1, 2, block_size, 1, 1, groups=groups), max_model_len=max_model_len,
                          max_num_batched_tokens=budget)
        got.append(sched.blocks_of(num_tokens, capped=True))
    assert got == want
