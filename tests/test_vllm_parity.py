"""pagedlib's ``Engine`` against vLLM itself (0.32.0, the CPU build), stepped through the same seeded
workloads: the same tokens, and step by step the same schedule (new tokens per request), the same blocks
held (which requests share which), the same prefix-cache hits, free blocks and preemptions.

Where pagedlib differs from vLLM on purpose, the comparison sets pagedlib to vLLM's behaviour, and a test of
its own pins the difference. vLLM runs in one worker process for the whole module (``VllmWorker``): its CPU
backend binds threads in the process that builds it, and starting it costs tens of seconds.
"""

from __future__ import annotations

import random

import pytest

from pagedlib.engine import Engine
from pagedlib.vllm_bridge import (
    Arrival,
    BridgeConfig,
    VllmWorker,
    config_of,
    differences,
    run_engine,
    vllm_available,
)

AVAILABLE, WHY = vllm_available()
if not AVAILABLE:
    pytest.skip(WHY, allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
VOCAB = 96          # the tiny model's characters
BLOCK = 32          # vLLM's CPU attention takes multiples of 32 only


@pytest.fixture(scope="module")
def vllm():
    with VllmWorker() as worker:
        yield worker


@pytest.fixture(scope="module")
def tiny():
    from pagedlib.teach.train_tiny import load_tiny

    return load_tiny()[0]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_system_prompt(rng, tiny):
    """Six requests behind one 40-token system prompt, one arriving a step: hits on its full block."""
    system = tokens(rng, 40)
    return [Arrival(f"r{i}", system + tokens(rng, rng.randrange(5, 20)), 16, step=i) for i in range(6)]


def multi_turn(rng, tiny):
    """Three conversations; each second turn (its first prompt, the answer, a new question) arrives once the
    first turns are done, so their blocks are found in the cache."""
    first = [tokens(rng, rng.randrange(20, 70)) for _ in range(3)]
    answers = Engine(tiny, 24, BLOCK, max_num_batched_tokens=128).generate(first, 12)
    turns = [Arrival(f"a{i}", prompt, 12) for i, prompt in enumerate(first)]
    return turns + [Arrival(f"b{i}", prompt + answer + tokens(rng, 10), 12, step=20)
                    for i, (prompt, answer) in enumerate(zip(first, answers))]


def block_boundaries(rng, tiny):
    """Prompts that end one token into a block, on a block's last token, and in between."""
    return [Arrival(f"len{n}", tokens(rng, n), 8, step=i % 2) for i, n in enumerate([1, 31, 32, 33, 64, 65])]


def tight_pool(rng, tiny):
    """Four requests whose tokens outgrow 8 blocks: the newest is preempted and recomputed."""
    return [Arrival(f"r{i}", tokens(rng, 40), 60) for i in range(4)]


def mid_block_budget(rng, tiny):
    """A budget of 40 tokens cuts 100-token prompts into chunks that end mid-block."""
    return [Arrival(f"r{i}", tokens(rng, 100), 6, step=i) for i in range(4)]


def same_prompt_twice(rng, tiny):
    """A prompt of exactly two blocks, asked again once the first request is done: every block is cached."""
    prompt = tokens(rng, 64)
    return [Arrival("first", prompt, 4), Arrival("again", prompt, 4, step=8)]


def queue_behind_max_num_seqs(rng, tiny):
    """Six requests, two running at a time."""
    return [Arrival(f"r{i}", tokens(rng, rng.randrange(8, 50)), 10) for i in range(6)]


# name -> (workload, Engine's keywords, a check that the workload did what it is there for)
WORKLOADS = {
    "shared_system_prompt": (shared_system_prompt,
                             dict(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=64),
                             lambda records: any(n >= BLOCK for r in records for n in r.hits.values())),
    "multi_turn": (multi_turn, dict(num_blocks=24, max_num_seqs=8, max_num_batched_tokens=128),
                   lambda records: any(n >= 2 * BLOCK for r in records for n in r.hits.values())),
    "block_boundaries": (block_boundaries, dict(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=96),
                         lambda records: any(len(b) == 3 for r in records for b in r.blocks.values())),
    "tight_pool": (tight_pool, dict(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=128),
                   lambda records: any(r.preempted for r in records)),
    "mid_block_budget": (mid_block_budget, dict(num_blocks=20, max_num_seqs=8, max_num_batched_tokens=40),
                         lambda records: any(n % BLOCK and n > 1
                                             for r in records for n in r.scheduled.values())),
    "no_prefix_caching": (shared_system_prompt, dict(num_blocks=20, max_num_seqs=4, max_num_batched_tokens=64,
                                                     enable_prefix_caching=False),
                          lambda records: not any(n for r in records for n in r.hits.values())),
    "same_prompt_twice": (same_prompt_twice, dict(num_blocks=8, max_num_seqs=8, max_num_batched_tokens=64),
                          lambda records: any(r.hits.get("again") for r in records)),
    "max_num_seqs": (queue_behind_max_num_seqs,
                     dict(num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64),
                     lambda records: max(len(r.scheduled) for r in records) == 2),
}


def engine_for(tiny, num_blocks, enable_prefix_caching=True, **options):
    return Engine(tiny, num_blocks, BLOCK, enable_prefix_caching=enable_prefix_caching, **options)


@pytest.mark.parametrize("name", WORKLOADS)
def test_same_tokens_and_same_schedule_as_vllm(name, tiny, vllm):
    build, options, happened = WORKLOADS[name]
    workload = build(random.Random(sum(map(ord, name))), tiny)
    engine = engine_for(tiny, **options)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert differences(ours, theirs) == []
    assert happened(ours), f"workload {name} did not exercise what it is there for"


def test_watermark_is_pagedlibs_own(tiny, vllm):
    """pagedlib keeps 1% of the blocks free when it admits a request (vLLM V0's watermark, which notebook 07
    teaches): so that running requests can grow without preempting at once. vLLM V1 admits a request as long
    as its blocks are free. Below 100 blocks 1% rounds to none, so the comparisons above agree; at 100
    blocks, a request that needs exactly the last free blocks is admitted by vLLM and waits in pagedlib."""
    rng = random.Random(7)
    workload = [Arrival(f"r{i}", tokens(rng, 470), 2) for i in range(6)]
    workload.append(Arrival("last", tokens(rng, 300), 2))
    engine = engine_for(tiny, 100, max_num_seqs=8, max_num_batched_tokens=4096)
    assert engine.watermark_blocks == 1
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert "last" in theirs[0].scheduled and theirs[0].free_blocks == 0
    assert "last" not in ours[0].scheduled and ours[0].free_blocks == 10


def test_whole_prompts_are_pagedlibs_own(tiny, vllm):
    """pagedlib's engine can run whole prompts in a step (nano-vllm's plan, notebooks 07-08: the simplest
    scheduler to read); vLLM V1 always works under a token budget and chunks a long prompt. The tokens agree,
    the schedules do not."""
    rng = random.Random(8)
    workload = [Arrival(f"r{i}", tokens(rng, 100), 4) for i in range(2)]
    engine = engine_for(tiny, 16)                                  # max_num_batched_tokens=None
    with pytest.raises(ValueError, match="always chunks"):
        config_of(engine)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(BridgeConfig(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64),
                                    workload)
    assert our_tokens == their_tokens
    assert ours[0].scheduled == {"r0": 100, "r1": 100}
    assert theirs[0].scheduled == {"r0": 64}


def test_radix_tree_is_sglangs_not_vllms(tiny, vllm):
    """With ``prefix_cache="radix"`` (SGLang's tree, notebook 11) pagedlib also finds the part of a block a
    prompt shares with a cached block (it copies that block); vLLM hashes full blocks only. Two prompts share
    40 tokens, a block and a quarter: the second finds 40 tokens, against vLLM's 32."""
    rng = random.Random(9)
    shared = tokens(rng, 40)
    workload = [Arrival("first", shared + tokens(rng, 30), 4),
                Arrival("second", shared + tokens(rng, 8), 4, step=6)]
    engine = engine_for(tiny, 16, max_num_seqs=8, max_num_batched_tokens=64, prefix_cache="radix")
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert [r.hits["second"] for r in ours if "second" in r.hits] == [40]
    assert [r.hits["second"] for r in theirs if "second" in r.hits] == [32]


def test_difference_a_block_becomes_findable_once_its_k_v_are_written(tiny, vllm):
    """Deliberate difference. Two requests with one 40-token system prompt arrive together. vLLM registers
    a full block's hash when the block is scheduled (``KVCacheManager.allocate_slots``), so the second
    request finds the first block, which the first request computes in the same forward pass. pagedlib
    makes a block findable only once every layer has written its K/V (``BlockManager.reserve`` registers
    after the forward pass), so that a step interrupted midway leaves no block registered with half-written
    K/V (issue 30, defect 2): its second request computes the block itself. Same tokens either way."""
    rng = random.Random(10)
    system = tokens(rng, 40)
    workload = [Arrival(f"r{i}", system + tokens(rng, 12), 4) for i in range(2)]
    engine = engine_for(tiny, 16, max_num_seqs=8, max_num_batched_tokens=128)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert theirs[0].hits == {"r0": 0, "r1": 32}
    assert ours[0].hits == {"r0": 0, "r1": 0}


def test_bench_generate_has_a_vllm_row_with_the_same_tokens(tmp_path, capsys):
    """``python -m pagedlib.bench generate`` runs vLLM on the same random model (head size 32, one vLLM
    takes), in the same run, start-up reported apart."""
    import json

    from pagedlib.bench.__main__ import main

    out = tmp_path / "generate.json"
    argv = ["generate", "--num-requests", "4", "--min-prompt", "3", "--max-prompt", "40", "--max-new-tokens",
            "6", "--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
            "--vocab", "64", "--repeats", "1", "--threads", "1", "--device", "cpu", "--json", str(out)]
    assert main(argv) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["vllm"]["same_tokens"] == "yes" and rows["vllm"]["startup_s"] > 0
    assert "startup_s" not in rows["engine"]
