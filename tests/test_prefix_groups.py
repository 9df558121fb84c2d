"""Prefix caching across KV-cache groups (notebook 15): every group registers its full blocks under the
chained keys of the tokens, each on its own shelf, and shares one queue of cached free blocks; a new request
attaches the longest prefix every group serves, a window group only the blocks its window still reads.

pagedlib keeps every full block of every group findable, as vLLM 0.32.0 does with
``prefix_cache_retention_interval=None`` (dense retention). Its block manager is replayed op for op beside
vLLM's own ``KVCacheManager`` (``pagedlib.vllm.hybrid``, no model) on the issue's numbers, the #45238 shift
and seeded random workloads that share prefixes, split prompts, refuse, preempt and evict: the same tables in
every group (block ids and null entries), the same hits, the same free and cached free blocks after every op.
A hypothesis test runs the scheduler over random shared prompts and checks the invariants per group and that
every request reads back the K/V of its own tokens, attached or computed."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from helpers import arrival_steps, assert_unchanged, snapshot, write_step_kv
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedlib.core.blocks import BlockManager, Reservation
from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.core.groups import FULL, NULL_BLOCK, SLIDING, KVGroup, kv_groups
from pagedlib.core.prefix_cache import PrefixCache, chained_keys
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.testing import InvariantError, check_invariants
from pagedlib.vllm.bridge import vllm_available
from pagedlib.vllm.hybrid import Add, Allocate, Free, Preempt, vllm_hybrid_runs

AVAILABLE, WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not AVAILABLE, reason=WHY)

VOCAB = 96
ISSUE = (KVGroup(FULL, None, (1, 3)), KVGroup(SLIDING, 64, (0, 2)))  # block 16: the issue's setting


def layers(groups: Sequence[KVGroup]) -> int:
    return sum(len(group.layers) for group in groups)


# ---- pagedlib's block manager driven by the ops vLLM's manager replays ----------------------------------

def pagedlib_states(groups: Sequence[KVGroup], ops: Sequence, *, block_size: int, num_blocks: int,
                    max_num_batched_tokens: int = 2048, full_sequence_must_fit: bool = True) -> list[dict]:
    """After each op, what ``vllm_hybrid_run`` reports of vLLM's manager, from pagedlib's: the tables of every
    request added (empty before its first step and after a preemption), the hit of an admission, the tokens
    scheduled, whether the step was allocated, the free and cached free blocks. An admission is looked up and
    tested as ``Scheduler.cached_prefix`` and ``Scheduler.fits`` do; a running request gives its window's
    blocks back before its blocks are counted, as vLLM's ``allocate_slots`` does, even if it is refused."""
    cache = PagedKVCache(num_blocks, layers(groups), block_size, 1, 1, groups=groups,
                         enable_prefix_caching=True)
    sched = Scheduler(cache, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=64,
                      max_model_len=num_blocks * block_size, full_prompt_must_fit=full_sequence_must_fit)
    manager = cache.manager
    requests: dict[str, Request] = {}
    states = []
    for op in ops:
        state = {"hit": None, "scheduled": 0, "allocated": True}
        if isinstance(op, Add):
            requests[op.name] = Request(len(requests), 0, len(op.prompt), 1 << 20, tuple(op.prompt))
        elif isinstance(op, Allocate):
            request = requests[op.name]
            if op.name not in cache.seq_lens:                    # new or preempted: looked up, then admitted
                found, hit, _ = sched.cached_prefix(request)
                n = min(op.budget, request.num_tokens - hit)
                state["hit"] = hit
                if sched.fits(request, found, hit + n):
                    manager.add_sequence(op.name, request.token_ids, sched.prompt_keys(request))
                    assert cache.seq_lens[op.name] == hit
                    state["allocated"] = reserve(manager, op.name, n, request)
                else:
                    state["allocated"] = False
            else:
                n = min(op.budget, request.num_tokens - cache.seq_lens[op.name])
                manager.give_back(op.name, Reservation())         # first, kept if the step is refused
                state["allocated"] = reserve(manager, op.name, n, request)
            if state["allocated"]:
                state["scheduled"] = n
                if cache.seq_lens[op.name] == request.num_tokens:
                    request.output_tokens.append(op.token)
        else:                                                    # Preempt or Free (perhaps never admitted)
            if op.name in cache.seq_lens:
                manager.free_sequence(op.name)
            if isinstance(op, Free):
                del requests[op.name]
        check_invariants(cache)
        state["tables"] = {name: [list(tables.get(name, [])) for tables in cache.group_tables]
                           for name in requests}
        state["free_blocks"] = cache.num_free_blocks
        state["cached_free_blocks"] = cache.num_cached_free_blocks
        states.append(state)
    return states


def reserve(manager: BlockManager, name: str, n: int, request: Request) -> bool:
    """Slots for ``n`` more tokens of ``name``, with their token ids; False (nothing changed) if short."""
    start = manager.seq_lens[name]
    try:
        manager.reserve([name], [n], request.token_ids[start:start + n])
    except OutOfBlocksError:
        return False
    return True


def compared(states: list[dict], theirs: list) -> list[str]:
    """Every op where pagedlib's state and vLLM's differ, one line each."""
    out = []
    for i, (ours, state) in enumerate(zip(states, theirs)):
        for name in ("tables", "hit", "scheduled", "allocated", "free_blocks", "cached_free_blocks"):
            if ours[name] != getattr(state, name):
                out.append(f"op {i} {name}: pagedlib {ours[name]}, vLLM {getattr(state, name)}")
    return out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def issue_ops(rng: random.Random) -> list:
    """a: a 300-token prompt in one step, then one decode; b shares 250 tokens with it; a finishes; c sends
    a's prompt again."""
    prompt = tokens(rng, 300)
    return [Add("a", prompt), Allocate("a", 300, token=1), Allocate("a", 1, token=2),
            Add("b", prompt[:250] + tokens(rng, 50)), Allocate("b", 300, token=3),
            Free("a"), Add("c", list(prompt)), Allocate("c", 300, token=4)]


def shifted_ops(rng: random.Random, shared: int) -> list:
    """A 400-token prompt computed and finished, then two 450-token prompts sharing its first ``shared``."""
    long = tokens(rng, 400)
    return [Add("a", long), Allocate("a", 400, token=1), Free("a"),
            Add("b", long[:shared] + tokens(rng, 450 - shared)), Allocate("b", 450, token=1), Free("b"),
            Add("c", long[:shared] + tokens(rng, 450 - shared)), Allocate("c", 450, token=1)]


def random_ops(seed: int, steps: int = 80) -> list:
    """Requests arriving (most sharing a prefix of an earlier prompt, some resending one), stepped with
    budgets that split prompts, preempted and finished at random."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    live: list[str] = []
    ops: list = []
    for step in range(steps):
        if len(live) < 4 and rng.random() < 0.4:
            name = f"r{step}"
            prompt = []
            if prompts and rng.random() < 0.7:
                prompt = rng.choice(prompts)[:rng.randrange(1, 260)]
            prompt += tokens(rng, rng.randrange(0 if prompt else 1, 120))
            prompts.append(prompt)
            live.append(name)
            ops.append(Add(name, prompt))
        if not live:
            continue
        name = rng.choice(live)
        roll = rng.random()
        if roll < 0.12:
            ops.append(Free(name))
            live.remove(name)
        elif roll < 0.18:
            ops.append(Preempt(name))
        else:
            ops.append(Allocate(name, rng.choice([1, 1, 5, 16, 40, 500]), token=rng.randrange(VOCAB)))
    return ops


# (groups, block size, pool) of the random runs: the tiny hybrid model's layout, windows that are and are not
# multiples of the block size, a window of 1, one window group alone (Mistral's), three full groups beside it
LAYOUTS = [
    (ISSUE, 16, 30),
    (kv_groups([SLIDING, FULL, SLIDING, FULL], 48, 4), 16, 24),
    (kv_groups([SLIDING, FULL], 6, 2), 4, 60),
    (kv_groups([SLIDING, FULL], 1, 2), 4, 60),
    (kv_groups([SLIDING, SLIDING], 20, 2), 8, 30),
    (kv_groups([SLIDING, FULL, FULL, FULL], 33, 4), 8, 60),
]
RANDOM = [(layout, seed) for layout in range(len(LAYOUTS)) for seed in range(3)]


def runs() -> dict[str, dict]:
    rng = random.Random(54)
    out = {"issue": dict(groups=ISSUE, ops=issue_ops(rng), block_size=16, num_blocks=200),
           "shift 384": dict(groups=ISSUE, ops=shifted_ops(rng, 384), block_size=16, num_blocks=200),
           "shift 284": dict(groups=ISSUE, ops=shifted_ops(rng, 284), block_size=16, num_blocks=200)}
    for layout, seed in RANDOM:
        groups, block_size, pool = LAYOUTS[layout]
        out[f"random {layout} {seed}"] = dict(groups=groups, ops=random_ops(100 * layout + seed),
                                              block_size=block_size, num_blocks=pool,
                                              max_num_batched_tokens=64)
    return out


@pytest.fixture(scope="module")
def paired():
    """Each run: pagedlib's states and vLLM's (dense retention), side by side."""
    settings_ = runs()
    theirs = vllm_hybrid_runs([dict(run, retention_interval=None) for run in settings_.values()], timeout=900)
    return {name: (pagedlib_states(**run), states) for (name, run), states in zip(settings_.items(), theirs)}


@needs_vllm
def test_the_issues_numbers_with_every_block_kept_findable(paired):
    """A 300-token prompt holds 19 blocks per group, the window group 5 after one decode step; a request
    sharing 250 tokens hits 240 (15 blocks: 11 null, 4 read by its window); a's prompt sent again hits 288."""
    ours, theirs = paired["issue"]
    assert compared(ours, theirs) == []
    _, prefill, decode, _, b, _, _, c = ours
    assert [len(table) for table in prefill["tables"]["a"]] == [19, 19]
    assert [table.count(NULL_BLOCK) for table in decode["tables"]["a"]] == [0, 14]
    assert b["hit"] == 240 and b["tables"]["b"][1][:11] == [NULL_BLOCK] * 11
    assert b["tables"]["b"][1][11:15] == prefill["tables"]["a"][1][11:15]      # the window's blocks, shared
    assert c["hit"] == 288


@needs_vllm
def test_a_100_token_shift_hits_what_every_group_kept(paired):
    """The #45238 prompts: sharing 384 tokens hits 384; sharing 284 hits 272 at once (every block of the
    window group stayed findable; vLLM's served default hits 0 there: notebook 15)."""
    for name, want in (("shift 384", [0, 384, 384]), ("shift 284", [0, 272, 272])):
        ours, theirs = paired[name]
        assert compared(ours, theirs) == []
        assert [state["hit"] for state in ours if state["hit"] is not None] == want


@needs_vllm
@pytest.mark.parametrize("layout, seed", RANDOM)
def test_the_block_manager_equals_vllms_op_for_op(paired, layout, seed):
    ours, theirs = paired[f"random {layout} {seed}"]
    assert compared(ours, theirs) == []


@needs_vllm
def test_the_random_runs_reach_what_they_are_for(paired):
    """Hits past a window, refused steps, preemptions and evictions of cached blocks all happen."""
    hits = refused = evictions = 0
    for layout, seed in RANDOM:
        ours, _ = paired[f"random {layout} {seed}"]
        hits += sum(bool(state["hit"]) for state in ours)
        refused += sum(not state["allocated"] for state in ours)
        evictions += sum(later["cached_free_blocks"] < earlier["cached_free_blocks"]
                         and later["free_blocks"] < earlier["free_blocks"]
                         for earlier, later in zip(ours, ours[1:]))
    assert hits > 20 and refused > 5 and evictions > 5


# ---- the lookup itself ---------------------------------------------------------------------------------

def test_peek_groups_takes_the_shortest_prefix_and_nulls_what_the_window_skips():
    """Blocks of 4, window 6: the full group finds blocks 0-5; the window group lost block 4, so its last run
    covering a window (2 blocks) before block 6 is blocks 2-3: the hit is 16 tokens, its table [-1, -1, b2,
    b3]; with block 4 back it is 24 tokens and [-1, -1, -1, -1, b4, b5]."""
    cache = PrefixCache(4, num_groups=2)
    prompt = list(range(30))
    keys = list(chained_keys(prompt, 4))
    for index, key in enumerate(keys[:6]):
        cache.add(100 + index, key, group=0)
        if index != 4:
            cache.add(200 + index, key, group=1)
    assert cache.peek_groups(prompt, None, (None, 6)) == [[100, 101, 102, 103], [-1, -1, 202, 203]]
    cache.add(204, keys[4], group=1)
    assert cache.peek_groups(prompt, keys, (None, 6)) == [[100 + i for i in range(6)],
                                                           [-1, -1, -1, -1, 204, 205]]
    # alone, the window group takes the last run wherever it is; a run from block 0 shorter than a window
    assert cache.peek_groups(prompt, keys, (6,)) == [[-1, -1, -1, -1, 104, 105]]
    assert cache.peek_groups(prompt[:9], keys, (None, 100)) == [[100, 101], [200, 201]]


def test_a_block_is_found_in_its_own_group_only():
    cache = PrefixCache(2, num_groups=2)
    key = next(chained_keys([1, 2, 3], 2))
    cache.add(7, key, group=1)
    assert cache.peek([1, 2, 3]) == []                                    # group 0 holds nothing
    assert cache.peek_groups([1, 2, 3], None, (None, 4)) == [[], []]
    cache.forget(7)
    assert cache.keys == {} and cache.group_blocks == [{}, {}]


def test_the_radix_tree_takes_one_full_attention_group_only():
    with pytest.raises(ValueError, match="prefix_cache='radix' with KV-cache groups"):
        PagedKVCache(8, 4, 2, 1, 1, groups=kv_groups([SLIDING, FULL, SLIDING, FULL], 3, 4),
                     enable_prefix_caching=True, prefix_cache="radix")
    with pytest.raises(ValueError, match="radix"):
        BlockManager(8, 2, enable_prefix_caching=True, prefix_cache="radix",
                     groups=[KVGroup(SLIDING, 3, (0,))])


def test_invariant_6_checks_every_groups_keys():
    cache = PagedKVCache(16, 4, 2, 1, 1, groups=kv_groups([SLIDING, FULL, SLIDING, FULL], 3, 4),
                         enable_prefix_caching=True)
    cache.manager.add_sequence("a", [1, 2, 3, 4, 5])
    cache.manager.reserve(["a"], [5], [1, 2, 3, 4, 5])
    check_invariants(cache)
    window_block = cache.group_tables[0]["a"][1]
    shelf = cache.prefix_cache.group_blocks[0]
    key = cache.prefix_cache.keys[window_block]
    del shelf[key][window_block]                      # the block leaves its group's shelf
    if not shelf[key]:
        del shelf[key]
    cache.prefix_cache.group_blocks[1].setdefault(key, {})[window_block] = None   # and joins the other's
    with pytest.raises(InvariantError, match="6: full block .* in group 0"):
        check_invariants(cache)


# ---- the scheduler over shared prompts -----------------------------------------------------------------

LAYER_TYPES = [[SLIDING, FULL, SLIDING, FULL], [SLIDING] * 4, [SLIDING, FULL, FULL, FULL]]


@st.composite
def shared_workloads(draw):
    """Up to 7 requests whose prompts start with part of one of three texts, arriving over 6 steps."""
    texts = [list(range(100 * t, 100 * t + 40)) for t in range(3)]
    out = []
    for i in range(draw(st.integers(1, 7))):
        text = texts[draw(st.integers(0, 2))][:draw(st.integers(0, 40))]
        own = [1000 + 50 * i + j for j in range(draw(st.integers(0 if text else 1, 12)))]
        prompt = tuple(text + own)
        out.append(Request(i, draw(st.integers(0, 6)), len(prompt), draw(st.integers(1, 10)), prompt))
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=shared_workloads(), block_size=st.sampled_from([1, 2, 4]),
       window=st.sampled_from([1, 3, 6, 100]), layer_types=st.sampled_from(LAYER_TYPES),
       budget=st.sampled_from([None, 5, 16]), spare=st.integers(0, 12))
def test_scheduler_with_prefix_caching_across_groups(requests, block_size, window, layer_types, budget,
                                                     spare):
    """After every step the invariants hold per group (6 included); each running request reads back, in every
    block its groups still hold, the K/V of its own tokens (K = position, V = token id), whether its blocks
    were attached from the cache or computed; every request finishes and nothing leaks."""
    groups = kv_groups(layer_types, window, 4)
    sched = caching_scheduler(requests, groups, block_size, budget, spare, fill=float("nan"))
    cache = sched.cache
    hits = 0
    for _ in arrival_steps(sched, requests):
        plan = sched.schedule()
        hits += sum(plan.hits.values())
        write_step_kv(sched, plan, "token")
        check_invariants(cache)
        for r in sched.running:
            read_back(cache, r, groups)
        sched.update(plan, [7 for _ in plan.work])
    assert all(len(r.output_tokens) == r.output_len for r in requests)
    assert not cache.seq_lens and cache.num_free_blocks == cache.num_blocks
    event(f"hit tokens: {min(hits, 1)}")


def caching_scheduler(requests: list[Request], groups: Sequence[KVGroup], block_size: int,
                      budget: int | None, spare: int, **cache_options) -> Scheduler:
    """A scheduler with prefix caching over a pool of ``groups`` that holds the largest of ``requests``
    alone, plus ``spare`` blocks (4 layers, 1 head, head_dim 1, ``max_model_len`` 64)."""
    probe = Scheduler(PagedKVCache(1, 4, block_size, 1, 1, groups=groups), max_model_len=64,
                      max_num_batched_tokens=budget)
    alone = max(probe.blocks_alone(r) for r in requests)
    cache = PagedKVCache(alone + spare, 4, block_size, 1, 1, groups=groups, enable_prefix_caching=True,
                         **cache_options)
    return Scheduler(cache, max_model_len=64, max_num_batched_tokens=budget)


def read_back(cache: PagedKVCache, request: Request, groups: Sequence[KVGroup]) -> None:
    length = cache.seq_lens[request.req_id]
    k, v = cache.gather(request.req_id)  # [L, length, 1, 1]
    for g, group in enumerate(groups):
        gone = cache.group_tables[g][request.req_id].count(NULL_BLOCK) * cache.block_size
        for layer in group.layers:
            assert k[layer, gone:].flatten().tolist() == list(range(gone, length))
            assert v[layer, gone:].flatten().tolist() == request.token_ids[gone:length]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=shared_workloads(), block_size=st.sampled_from([1, 2, 4]), window=st.sampled_from([2, 3, 6]),
       budget=st.sampled_from([None, 5]), spare=st.integers(0, 6), fail_at=st.sets(st.integers(0, 40)))
def test_a_failed_step_is_undone_whole(requests, block_size, window, budget, spare, fail_at):
    """A step whose forward pass fails is undone: admissions with hits, the registrations, the window's
    blocks given back before the count, all of it; the cache is as before ``schedule`` (bookkeeping, every
    group's shelf, the sequences' keys; a cached block evicted for the step comes back plain, as
    ``BlockManager.undo`` says) and the step runs when planned again."""
    sched = caching_scheduler(requests, kv_groups([SLIDING, FULL, SLIDING, FULL], window, 4), block_size,
                              budget, spare)
    cache = sched.cache
    undone = 0
    for step in arrival_steps(sched, requests):
        if step in fail_at and not any(r.status.name == "PREEMPTED" for r in sched.requests.values()):
            snap, evicted = snapshot(cache), cache.prefix_cache.evicted_blocks
            plan = sched.schedule()
            sched.undo(plan)
            check_invariants(cache)
            # a preemption stays (its blocks may be reused already), an evicted block's key is gone
            if not plan.preempted and cache.prefix_cache.evicted_blocks == evicted:
                unchanged_but_lru(cache, snap)
                undone += 1
        plan = sched.schedule()
        write_step_kv(sched, plan, "token")
        sched.update(plan, [7 for _ in plan.work])
        check_invariants(cache)
    assert not cache.seq_lens and cache.num_free_blocks == cache.num_blocks
    event(f"undone: {min(undone, 1)}")


def unchanged_but_lru(cache: PagedKVCache, snap: PagedKVCache) -> None:
    """``assert_unchanged``, except the order of the cached free blocks: an undone admission's hit blocks
    return to the back of the queue (the scheduler's undo does not keep their age)."""
    now, before = cache.prefix_cache, snap.prefix_cache
    assert set(now.free_queue) == set(before.free_queue)
    now.free_queue = type(now.free_queue)((block, None) for block in before.free_queue)
    assert_unchanged(cache, snap)
