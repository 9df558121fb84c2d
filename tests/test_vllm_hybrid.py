"""vLLM's own hybrid KV-cache manager (0.32.0), driven without a model by ``pagedlib.vllm.hybrid``: the
numbers issue 54 and notebook 15 quote, read back from vLLM, and the invariants a table per group keeps;
then vLLM's CPU build serving the tiny hybrid model through the bridge: transformers' tokens, a table per
group per step, and the same tables from the manager replaying the served schedule.

A full group and a window group (window 64) over one pool of 16-token blocks. Every run goes to one child
process (``vllm_hybrid_runs``): importing vLLM, not the runs, takes the time. The checks of bad input run
without vLLM: they are refused before any child starts.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from pagedlib.core.groups import FULL, NULL_BLOCK, SLIDING, KVGroup, kv_groups
from pagedlib.util import ceil_div
from pagedlib.vllm.bridge import (
    Arrival,
    BridgeConfig,
    VllmWorker,
    differences,
    max_model_len,
    vllm_available,
)
from pagedlib.vllm.hybrid import (
    Add,
    Allocate,
    Free,
    Preempt,
    replay_schedule,
    vllm_hybrid_run,
    vllm_hybrid_runs,
)

AVAILABLE, WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not AVAILABLE, reason=WHY)

BLOCK, WINDOW, VOCAB, POOL = 16, 64, 96, 200
TIGHT, SEEDS = 28, range(6)           # the random workloads' pool: tight enough to refuse steps
GROUPS = (KVGroup(FULL, None, (1, 3)), KVGroup(SLIDING, WINDOW, (0, 2)))
FULL_ONLY = GROUPS[:1]
RNG = random.Random(54)


def tokens(n: int) -> list[int]:
    return [RNG.randrange(VOCAB) for _ in range(n)]


PROMPT = tokens(300)
SHARES_250 = PROMPT[:250] + tokens(50)
LONG = tokens(400)                       # the #45238 runs: a cached prompt, then prompts sharing part of it


def issue_ops():
    """a: a 300-token prompt in one step, then one decode; b shares 250 tokens with it; a finishes; c sends
    a's prompt again."""
    return [Add("a", PROMPT), Allocate("a", 300, token=1), Allocate("a", 1, token=2),
            Add("b", SHARES_250), Allocate("b", 300, token=3),
            Free("a"), Add("c", list(PROMPT)), Allocate("c", 300, token=4)]


def shifted_ops(shared: int):
    """A 400-token prompt computed and finished, then two 450-token prompts sharing its first ``shared``."""
    return [Add("a", LONG), Allocate("a", 400, token=1), Free("a"),
            Add("b", LONG[:shared] + tokens(450 - shared)), Allocate("b", 450, token=1), Free("b"),
            Add("c", LONG[:shared] + tokens(450 - shared)), Allocate("c", 450, token=1)]


def tight_ops():
    """A pool of 40 blocks: a holds 38 of them, b cannot be admitted until a is preempted; a comes back."""
    return [Add("a", PROMPT), Allocate("a", 300, token=1), Allocate("a", 1, token=2),
            Add("b", tokens(300)), Allocate("b", 300, token=3), Preempt("a"), Allocate("a", 400, token=5)]


def random_ops(seed: int, steps: int = 60):
    """Requests arriving, stepped with small budgets (prompts split into chunks), preempted and finished at
    random, some sharing a prefix with an earlier one."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    live: dict[str, int] = {}          # name -> tokens it has left to compute
    ops: list = []
    for step in range(steps):
        if len(live) < 3 and rng.random() < 0.4:
            name = f"r{step}"
            prompt = (rng.choice(prompts)[:rng.randrange(1, 200)] if prompts and rng.random() < 0.5 else [])
            prompt += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 150))]
            prompts.append(prompt)
            live[name] = len(prompt)
            ops.append(Add(name, prompt))
        if not live:
            continue
        name = rng.choice(sorted(live))
        roll = rng.random()
        if roll < 0.1:
            ops.append(Free(name))
            del live[name]
        elif roll < 0.15:
            ops.append(Preempt(name))
        else:
            ops.append(Allocate(name, rng.choice([1, 7, 16, 40, 500]), token=rng.randrange(VOCAB)))
    return ops


RUNS = {
    "issue dense": dict(groups=GROUPS, ops=issue_ops(), retention_interval=None),
    "issue served": dict(groups=GROUPS, ops=issue_ops()),
    "shift 384": dict(groups=GROUPS, ops=shifted_ops(384)),
    "shift 284": dict(groups=GROUPS, ops=shifted_ops(284)),
    "shift 284 dense": dict(groups=GROUPS, ops=shifted_ops(284), retention_interval=None),
    "shift 284 full only": dict(groups=FULL_ONLY, ops=shifted_ops(284)),
    "tight": dict(groups=GROUPS, ops=tight_ops(), num_blocks=40),
    **{f"random {seed}": dict(groups=GROUPS, ops=random_ops(seed), num_blocks=TIGHT,
                              retention_interval=[0, None][seed % 2]) for seed in SEEDS},
}


@pytest.fixture(scope="module")
def vllm_runs():
    """Each run of ``RUNS``: its ops and the states vLLM's manager went through."""
    settings = [dict(block_size=BLOCK, num_blocks=POOL) | run for run in RUNS.values()]
    return {name: (run["ops"], states)
            for (name, run), states in zip(RUNS.items(), vllm_hybrid_runs(settings, timeout=600))}


@needs_vllm
def test_issue_numbers_a_prompt_holds_19_blocks_per_group_then_5_in_the_window(vllm_runs):
    ops, states = vllm_runs["issue dense"]
    prefill, decode = states[1], states[2]
    assert prefill.scheduled == 300 and prefill.hit == 0
    # 300 tokens: ceil(300 / 16) = 19 blocks in each group, none given back yet (the window group gives
    # blocks back at the request's next step, on the tokens computed before it)
    assert [len(table) for table in prefill.tables["a"]] == [19, 19] and prefill.held("a") == [19, 19]
    assert prefill.free_blocks == POOL - 38
    # one decode: tokens 0..236 fall wholly out of the window of the token at 300 (it sees 237..300), so
    # the 14 blocks of tokens 0..223 go back; 5 blocks (224..303) stay
    assert decode.held("a") == [19, 5]
    assert decode.tables["a"][1][:14] == [NULL_BLOCK] * 14
    assert decode.tables["a"][1][14:] == prefill.tables["a"][1][14:]
    assert decode.tables["a"][0] == prefill.tables["a"][0]
    assert decode.free_blocks == POOL - 38 + 14
    assert decode.cached_free_blocks == 14          # given back, still findable by their hashes


@needs_vllm
def test_issue_numbers_a_request_sharing_250_tokens_hits_240(vllm_runs):
    ops, states = vllm_runs["issue dense"]
    prefill, b = states[1], states[4]
    # 250 shared tokens: 15 whole blocks; the window group finds the 4 blocks (ceil(63 / 16)) ending at 240
    assert b.hit == 240 and b.group_hits == [240, 240] and b.scheduled == 60
    assert b.tables["b"][0][:15] == prefill.tables["a"][0][:15]
    # b's window table: what is out of the window of its next token (240) is null; blocks 11..14 are the
    # very blocks a gave back at its decode, taken out of the free queue again
    assert b.tables["b"][1][:11] == [NULL_BLOCK] * 11
    assert b.tables["b"][1][11:15] == prefill.tables["a"][1][11:15]
    assert b.held("b") == [19, 8]


@needs_vllm
@pytest.mark.parametrize("run", ["issue dense", "issue served"])
def test_the_same_prompt_again_hits_288_with_the_last_windows_blocks_only(vllm_runs, run):
    ops, states = vllm_runs[run]
    prefill, c = states[1], states[7]
    # at most num_tokens - 1 = 299 tokens may hit (the last one is computed for its logits): 18 blocks
    assert c.hit == 288 and c.group_hits == [288, 288] and c.scheduled == 12
    assert c.tables["c"][0][:18] == prefill.tables["a"][0][:18]
    # the window group needs only the blocks of the window before token 288: 4 blocks, 14 nulls
    assert c.tables["c"][1][:14] == [NULL_BLOCK] * 14
    assert c.tables["c"][1][14:18] == prefill.tables["a"][1][14:18]
    assert c.held("c") == [19, 5]


@needs_vllm
def test_what_vllm_serves_with_caches_the_window_sparsely_and_the_250_token_share_hits_0(vllm_runs):
    """vLLM's default ``prefix_cache_retention_interval=0`` keeps only the window's blocks before a's last
    block boundary (224..287): b, which leaves a at token 250, finds no window for any length, and the
    hybrid hit, the shortest every group serves, is 0, although the full group alone would serve 240."""
    ops, states = vllm_runs["issue served"]
    assert states[2].held("a") == [19, 5] and states[2].cached_free_blocks == 0
    assert states[4].hit == 0 and states[4].group_hits == [240, 0]
    assert states[4].held("b") == [19, 19]


@needs_vllm
def test_issue_45238_a_100_token_shift_drops_the_hit_to_0(vllm_runs):
    """A 400-token prompt cached; prompts sharing 384 of its tokens hit 384, prompts sharing 284 hit 0 (the
    window group holds no window ending in the shared part, so the full group's 272 is cut to 0), until a
    second one arrives: the first one's lookup pinned the junction at 272 and kept that window."""
    hits = {name: [state.hit for state in vllm_runs[name][1] if state.hit is not None]
            for name in ("shift 384", "shift 284", "shift 284 dense", "shift 284 full only")}
    assert hits == {"shift 384": [0, 384, 384], "shift 284": [0, 0, 272],
                    "shift 284 dense": [0, 272, 272], "shift 284 full only": [0, 272, 272]}
    b = vllm_runs["shift 284"][1][4]
    assert b.group_hits == [272, 0]
    assert b.held("b") == [29, 29]            # b computes all 450 tokens: no block of a reused


@needs_vllm
def test_a_refused_admission_changes_nothing_and_a_preempted_request_finds_its_blocks(vllm_runs):
    ops, states = vllm_runs["tight"]
    decode, refused, preempted, back = states[2], states[4], states[5], states[6]
    assert decode.held("a") == [19, 5] and decode.free_blocks == 40 - 24
    assert not refused.allocated and refused.scheduled == 0 and refused.hit == 0
    assert refused.tables == {"a": decode.tables["a"], "b": [[], []]}
    assert refused.free_blocks == decode.free_blocks
    assert preempted.tables["a"] == [[], []] and preempted.free_blocks == 40
    # a holds 302 tokens (its prompt, two sampled): up to 301 may hit, 18 full blocks; its window blocks
    # 14..17 were cached when computed
    assert back.allocated and back.hit == 288 and back.scheduled == 302 - 288
    assert back.tables["a"][0][:18] == decode.tables["a"][0][:18]
    assert back.tables["a"][1][14:18] == decode.tables["a"][1][14:18]


@needs_vllm
@pytest.mark.parametrize("seed", SEEDS)
def test_tables_per_group_keep_one_pool(vllm_runs, seed):
    """Seeded random workloads: a block is in one group at a time; held blocks and free blocks make up the
    pool; a full table has no null entry; a window table's nulls come first, and after a step it holds no
    more than the window needs (plus the block being written and the tokens the step computed)."""
    ops, states = vllm_runs[f"random {seed}"]
    assert sum(state.scheduled > 0 for state in states) > 20
    assert any(not state.allocated for state in states)              # the pool refused some steps
    assert any(state.hit and state.allocated for state in states)    # and some admissions hit the cache
    for op, state in zip(ops, states):
        full = {block for tables in state.tables.values() for block in tables[0]}
        window = {block for tables in state.tables.values() for block in tables[1]} - {NULL_BLOCK}
        assert not full & window
        assert all(0 <= block < TIGHT for block in full | window)
        assert len(full) + len(window) + state.free_blocks == TIGHT
        for full_table, window_table in state.tables.values():
            assert NULL_BLOCK not in full_table
            nulls = window_table.count(NULL_BLOCK)
            assert window_table[:nulls] == [NULL_BLOCK] * nulls
            assert len(full_table) == len(window_table)
        if isinstance(op, Allocate) and state.scheduled:
            held = state.held(op.name)[1]
            assert held <= ceil_div(WINDOW - 1 + state.scheduled, BLOCK) + 1


def test_differences_compare_tables_per_group_renamed_with_null_kept():
    from pagedlib.vllm.bridge import StepRecord

    def run(first, second):
        return [StepRecord(blocks={"a": first[0]}, group_blocks={"a": first}),
                StepRecord(blocks={"a": second[0]}, group_blocks={"a": second})]

    ours = run([[0, 1], [2, 3]], [[NULL_BLOCK, 1], [2, 3]])
    assert differences(ours, run([[7, 5], [9, 4]], [[NULL_BLOCK, 5], [9, 4]])) == []
    # the window group gives its first block back at another step, or gives back another block
    assert differences(ours, run([[7, 5], [9, 4]], [[7, 5], [9, 4]]))
    assert differences(ours, run([[7, 5], [9, 4]], [[7, NULL_BLOCK], [9, 4]]))
    # a block of the window group turns up in the full group
    assert differences(ours, run([[7, 5], [9, 4]], [[NULL_BLOCK, 5], [9, 5]]))


def test_bad_input_is_refused_before_vllm_runs():
    with pytest.raises(ValueError, match="block_size"):
        vllm_hybrid_run(GROUPS, [], block_size=0, num_blocks=8)
    with pytest.raises(ValueError, match="retention_interval=8 must be a multiple of block_size=16"):
        vllm_hybrid_run(GROUPS, [], block_size=16, num_blocks=8, retention_interval=8)
    with pytest.raises(ValueError, match="needs a window"):
        vllm_hybrid_run([KVGroup(SLIDING, None, (0,))], [], block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="groups must hold at least one"):
        vllm_hybrid_run([], [], block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match=r"op 1 \(Allocate\): request 'b' is not live"):
        vllm_hybrid_run(GROUPS, [Add("a", [1]), Allocate("b", 1, token=0)], block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match=r"op 2 \(Allocate\): request 'a' is not live"):
        vllm_hybrid_run(GROUPS, [Add("a", [1]), Free("a"), Allocate("a", 1)], block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="is live already"):
        vllm_hybrid_run(GROUPS, [Add("a", [1]), Add("a", [2])], block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        vllm_hybrid_run(GROUPS, [Add("a", [1]), Allocate("a", 0)], block_size=16, num_blocks=8)
    with pytest.raises(ValueError, match="prompt token must be >= 0"):
        vllm_hybrid_run(GROUPS, [Add("a", [1, -2])], block_size=16, num_blocks=8)
    with pytest.raises(TypeError, match="ops must be Add"):
        vllm_hybrid_run(GROUPS, ["a"], block_size=16, num_blocks=8)


@needs_vllm
def test_a_step_that_samples_needs_its_token():
    with pytest.raises(ValueError, match=r"op 1 \(Allocate 'a'\) computes the request's last known token"):
        vllm_hybrid_run(GROUPS, [Add("a", [1, 2, 3]), Allocate("a", 3)], block_size=16, num_blocks=8)


# ---- vLLM serving the tiny hybrid model (window 48) --------------------------------------------------------

# as vLLM serves it: a window group keeps only some of its blocks findable (retention 0)
SERVED = BridgeConfig(num_blocks=48, block_size=32, max_num_batched_tokens=64, max_num_seqs=8,
                      prefix_cache_retention_interval=0)


@pytest.fixture(scope="module")
def hybrid():
    """The tiny hybrid model in transformers, its tokenizer and its folder."""
    from pagedlib.teach.train_tiny import HYBRID_DIR, load_tiny_hybrid_hf

    model, tok = load_tiny_hybrid_hf()
    return model, tok, str(HYBRID_DIR)


@pytest.fixture(scope="module")
def served(hybrid):
    """Workloads served by vLLM on the hybrid model, prompts longer than the window split by a 64-token
    budget: "shared" (b shares 80 of a's tokens, d is a's prompt again once a finished) and "tight" (a pool
    of 10 blocks: requests preempted and recomputed). Per workload: it, vLLM's records and tokens, the
    config."""
    from pagedlib.teach.train_tiny import corpus

    _, tok, folder = hybrid
    text, rng = corpus(), random.Random(5)
    a, b, c = tok.encode(text[1000:1100]), tok.encode(text[9000:9040]), tok.encode(text[5000:5150])
    workloads = {
        "shared": (SERVED, [Arrival("a", a, 12), Arrival("c", c, 12), Arrival("b", a[:80] + b, 12, step=6),
                            Arrival("d", list(a), 12, step=20)]),
        "tight": (dataclasses.replace(SERVED, num_blocks=10),
                  [Arrival(f"r{i}", [rng.randrange(VOCAB) for _ in range(40)], 60, step=i % 2)
                   for i in range(4)]),
    }
    runs = {}
    with VllmWorker() as worker:
        for name, (config, workload) in workloads.items():
            config = dataclasses.replace(config, model=folder)
            runs[name] = (workload, *worker.run(config, workload), config)
    return runs


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("run", ["shared", "tight"])
def test_vllm_serves_the_hybrid_model_with_transformers_tokens_and_two_groups(hybrid, served, run):
    import torch

    model, _, _ = hybrid
    workload, records, tokens, _ = served[run]
    for arrival in workload:
        with torch.no_grad():
            ref = model.generate(torch.tensor([arrival.prompt]), max_new_tokens=arrival.max_new_tokens,
                                 do_sample=False)
        assert tokens[arrival.name] == ref[0, len(arrival.prompt):].tolist(), arrival.name
    for record in records:
        assert record.group_blocks.keys() == record.blocks.keys()
        for name, (window, full) in record.group_blocks.items():
            assert record.blocks[name] == window                 # vLLM's group 0: layers 0 and 2, window 48
            assert len(window) == len(full) and NULL_BLOCK not in full
            if name in record.scheduled:        # the window before the step's first token, and the step's
                held = sum(block != NULL_BLOCK for block in window)
                assert held <= ceil_div(48 - 1 + record.scheduled[name], 32) + 1
    assert any(NULL_BLOCK in window for record in records for window, _ in record.group_blocks.values())


@needs_vllm
@pytest.mark.slow
def test_served_window_tables_and_hits(served):
    workload, records, tokens, _ = served["shared"]
    # a's window table gives back its first block once a token at 80 or later is computed (window 48)
    assert [record.group_blocks["a"][0][0] == NULL_BLOCK for record in records[:3]] == [False, False, True]
    # d (a's prompt again) hits 96 tokens: a's last window was kept (vLLM's retention 0); b shares 80 of
    # a's tokens, the full group alone would serve 64, but a's window blocks over 0..63 were not kept: 0
    hits = {name: hit for record in records for name, hit in record.hits.items()}
    assert hits == {"a": 0, "b": 0, "c": 0, "d": 96}
    assert sum(len(record.preempted) for record in served["tight"][1]) >= 2


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("run", ["shared", "tight"])
def test_the_manager_replaying_the_served_schedule_holds_the_same_blocks(hybrid, served, run):
    """vLLM's ``KVCacheManager`` driven by ``replay_schedule`` (no model) on the schedule vLLM served: the
    same tables per group at every step, the same hits, the same free blocks."""
    model, _, _ = hybrid
    workload, records, tokens, config = served[run]
    groups = kv_groups(model.config.layer_types, model.config.sliding_window, model.config.num_hidden_layers)
    assert [group.kind for group in groups] == [SLIDING, FULL]
    replayed = replay_schedule(groups, workload, records, tokens, block_size=config.block_size,
                               num_blocks=config.num_blocks, max_model_len=max_model_len(config),
                               max_num_batched_tokens=config.max_num_batched_tokens,
                               retention_interval=config.prefix_cache_retention_interval)
    assert differences(records, replayed) == []


def test_a_hybrid_models_requests_are_limited_by_both_groups_blocks():
    """vLLM refuses to start unless one request of ``max_model_len`` fits: 10 blocks of 32 hold 160 tokens
    of the hybrid model (5 full blocks, and the window group's cap of ceil((47 + 64) / 32) + 1 = 5), where
    they hold 320 of the one-group model."""
    from pagedlib.teach.train_tiny import HYBRID_DIR

    tight = dataclasses.replace(SERVED, num_blocks=10)
    assert max_model_len(dataclasses.replace(tight, model=str(HYBRID_DIR))) == 160
    assert max_model_len(tight) == 320
    assert max_model_len(dataclasses.replace(SERVED, model=str(HYBRID_DIR))) == 512   # the positions
