"""pagedlib's ``Engine`` against vLLM itself (0.32.0, the CPU build), stepped through the same seeded
workloads: the same tokens, and step by step the same schedule (new tokens per request), the same blocks
held (which requests share which), the same prefix-cache hits, free blocks and preemptions.

Where pagedlib differs from vLLM on purpose, the comparison sets pagedlib to vLLM's behaviour, and a test of
its own pins the difference. vLLM runs in one worker process for the whole module (``VllmWorker``): its CPU
backend binds threads in the process that builds it, and starting it costs tens of seconds.
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from pagedlib.engine import Engine
from pagedlib.vllm.bridge import (
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


def shared_prefix_same_step(rng, tiny):
    """Four prompts behind a 70-token prefix, all arriving before step 0: the first request's full blocks
    are registered when they are scheduled, so the other three find them in the same step."""
    prefix = tokens(rng, 70)
    return [Arrival(f"r{i}", prefix + tokens(rng, n), 8) for i, n in enumerate([17, 26, 32, 35])]


def second_long_prompt(rng, tiny):
    """A 200-token prompt, then a 150-token one while the first still prefills, in 10 blocks of 32 under a
    budget of 96: the second is admitted only once blocks for its whole prompt are free."""
    return [Arrival("long", tokens(rng, 200), 20), Arrival("later", tokens(rng, 150), 20, step=2)]


def eviction_order(rng, tiny):
    """Three finished prompts leave their blocks cached; a fourth, new prompt evicts some of them; a repeat
    of each earlier prompt then finds exactly the blocks both engines kept."""
    prompts = [tokens(rng, 96) for _ in range(3)]
    first = [Arrival(f"p{i}", prompt, 2, step=i * 6) for i, prompt in enumerate(prompts)]
    return first + [Arrival("new", tokens(rng, 120), 2, step=20)] + [
        Arrival(f"again{i}", prompt + tokens(rng, 5), 2, step=30 + i * 6) for i, prompt in enumerate(prompts)]


def preempted_with_shared_blocks(rng, tiny):
    """Requests sharing a 64-token prefix outgrow a small pool: a preempted request gives back blocks the
    others still hold, and finds them again when it returns."""
    prefix = tokens(rng, 64)
    return [Arrival(f"r{i}", prefix + tokens(rng, 8), 60, step=i) for i in range(4)]


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
    "shared_prefix_same_step": (shared_prefix_same_step, dict(num_blocks=40, max_num_batched_tokens=512),
                                lambda records: sum(records[0].hits.values()) == 3 * 64),
    "second_long_prompt": (second_long_prompt, dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=96),
                           lambda records: not any(r.preempted for r in records)
                           and "later" not in records[2].scheduled),
    "eviction_order": (eviction_order, dict(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=128),
                       lambda records: any(r.hits.get("again0") for r in records)
                       and any(r.cached_free_blocks for r in records)),
    "preempted_with_shared_blocks": (preempted_with_shared_blocks,
                                     dict(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=64),
                                     lambda records: any(r.preempted for r in records)),
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


def host_tier_workload(rng):
    """Three conversations whose blocks four long requests evict from an 8-block pool (and which outgrow it
    while they run: preemptions) before each conversation's second turn arrives."""
    first = [tokens(rng, rng.randrange(40, 70)) for _ in range(3)]
    answers = Engine(load_tiny_model(), 24, BLOCK, max_num_batched_tokens=128).generate(first, 12)
    workload = [Arrival(f"a{i}", prompt, 12) for i, prompt in enumerate(first)]
    workload += [Arrival(f"fill{i}", tokens(rng, 60), 40, step=15 + i) for i in range(4)]
    return workload + [Arrival(f"b{i}", prompt + answer + tokens(rng, 10), 12, step=80)
                       for i, (prompt, answer) in enumerate(zip(first, answers))]


def load_tiny_model():
    from pagedlib.teach.train_tiny import load_tiny

    return load_tiny()[0]


# notebook 13's host tier: (Engine settings, what the run must show it did)
HOST_TIERS = {
    "write-through, hash": ({"enable_prefix_caching": True, "host_blocks": 64},
                            lambda s: s["loaded_blocks"] > 0),
    "victim, radix": ({"enable_prefix_caching": True, "prefix_cache": "radix", "host_blocks": 64,
                       "host_write": "victim"}, lambda s: s["loaded_blocks"] > 0),
    "swap, no prefix cache": ({"host_blocks": 64, "preemption": "swap", "host_write": "none"},
                              lambda s: s["swapped_in_blocks"] > 0),
    "swap and write-through, hash": ({"enable_prefix_caching": True, "host_blocks": 64, "preemption": "swap"},
                                     lambda s: s["swapped_in_blocks"] > 0),
    "swap and write-through, radix": ({"enable_prefix_caching": True, "prefix_cache": "radix",
                                       "host_blocks": 64, "preemption": "swap"},
                                      lambda s: s["swapped_in_blocks"] > 0 and s["loaded_blocks"] > 0),
}


@pytest.fixture(scope="module")
def host_tier_case(tiny, vllm):
    """The workload and vLLM's tokens for it (vLLM has no host tier on its CPU backend: its own pool)."""
    workload = host_tier_workload(random.Random(5))
    plain = engine_for(tiny, 8, max_num_batched_tokens=128, max_num_seqs=8)
    return workload, vllm.run(config_of(plain), workload)[1]


@pytest.mark.parametrize("name", HOST_TIERS)
def test_a_host_tier_changes_no_token_of_vllms(name, tiny, host_tier_case):
    settings, happened = HOST_TIERS[name]
    workload, their_tokens = host_tier_case
    settings = dict(settings)
    engine = Engine(tiny, 8, BLOCK, max_num_batched_tokens=128, max_num_seqs=8, **settings)
    _, our_tokens = run_engine(engine, workload)
    assert our_tokens == their_tokens
    assert engine.stats.preemptions > 0 and happened(engine.host.stats())
    with pytest.raises(ValueError, match="host tier"):
        config_of(engine)


def random_workload(seed: int) -> tuple[list[Arrival], dict]:
    """A seeded workload and pool: arrivals over a few steps, prompts that share prefixes (or not), lengths
    across block boundaries, pools from tight to roomy, budgets from one block up."""
    rng = random.Random(seed)
    prefixes = [tokens(rng, rng.randrange(1, 80)) for _ in range(rng.randrange(1, 4))]
    workload = []
    for i in range(rng.randrange(2, 7)):
        prompt = tokens(rng, rng.randrange(1, 90))
        if rng.random() < 0.6:
            prompt = rng.choice(prefixes) + prompt
        workload.append(Arrival(f"r{i}", prompt, rng.randrange(1, 30), step=rng.randrange(0, 12)))
    longest = max(len(a.prompt) + a.max_new_tokens for a in workload)
    num_blocks = -(-longest // BLOCK) + rng.randrange(0, 12)
    options = dict(num_blocks=num_blocks, max_num_seqs=rng.choice([2, 4, 8]),
                   max_num_batched_tokens=rng.choice([32, 48, 64, 96, 256]),
                   enable_prefix_caching=rng.random() < 0.8)
    if rng.random() < 0.3:
        options["long_prefill_token_threshold"] = rng.choice([16, 32, 40])
    return workload, options


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_have_the_same_schedule_as_vllm(seed, tiny, vllm):
    workload, options = random_workload(seed)
    engine = engine_for(tiny, **options)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert differences(ours, theirs) == []


def test_a_workload_run_twice_with_the_same_config_meets_a_fresh_pool_both_times(tiny, vllm):
    """The worker shares an LLM between jobs with one config, but a workload is compared with a fresh
    Engine, so it must meet a fresh pool (``make_pool_fresh``): the second run of the same workload, after
    the first left cached blocks and a reordered free queue behind, gives the same records, both equal to
    the Engine's."""
    build, options, _ = WORKLOADS["shared_system_prompt"]
    workload = build(random.Random(3), tiny)
    ours, _ = run_engine(engine_for(tiny, **options), workload)
    config = config_of(engine_for(tiny, **options))
    first, _ = vllm.run(config, workload)
    second, _ = vllm.run(config, workload)
    assert first == second
    assert differences(ours, second) == []
    assert any(r.cached_free_blocks for r in first)   # the first run did leave cached blocks behind


def test_the_watermark_is_applied_alike(tiny, vllm):
    """With ``watermark=0.05`` (config_of passes it to vLLM's ``SchedulerConfig.watermark``), both engines
    keep 5 of 100 blocks free when they admit a request while another runs: the same steps."""
    rng = random.Random(7)
    workload = [Arrival(f"r{i}", tokens(rng, 470), 2) for i in range(6)]
    workload.append(Arrival("last", tokens(rng, 300), 2))
    engine = engine_for(tiny, 100, max_num_seqs=8, max_num_batched_tokens=4096, watermark=0.05)
    assert engine.config.watermark_blocks == 5
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert differences(ours, theirs) == []
    assert "last" not in ours[0].scheduled and ours[0].free_blocks < 10 + 5


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


def test_a_block_is_findable_once_it_is_scheduled_as_in_vllm(tiny, vllm):
    """Two requests with one 40-token system prompt arrive together. vLLM registers a full block's hash when
    the block is scheduled (``KVCacheManager.allocate_slots``), and so does pagedlib's scheduler: the second
    request finds the first block, which the first computes in the same forward pass (each layer writes its
    K/V before it attends). A step whose forward pass raises is undone, so no such block outlives it
    (``tests/test_engine.py``)."""
    rng = random.Random(10)
    system = tokens(rng, 40)
    workload = [Arrival(f"r{i}", system + tokens(rng, 12), 4) for i in range(2)]
    engine = engine_for(tiny, 16, max_num_seqs=8, max_num_batched_tokens=128)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine), workload)
    assert our_tokens == their_tokens
    assert ours[0].hits == theirs[0].hits == {"r0": 0, "r1": 32}
    assert differences(ours, theirs) == []


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


# ------------------------------------------------------------------------------------------------------
# the worker: interrupted, refused and stopped without lying (issue 37, defects 1-3)


def small_job(name: str, tiny) -> tuple[BridgeConfig, list[Arrival]]:
    rng = random.Random(sum(map(ord, name)))
    workload = [Arrival(f"{name}{i}", tokens(rng, 20 + 7 * i), 3) for i in range(2)]
    return config_of(engine_for(tiny, 8, max_num_seqs=4, max_num_batched_tokens=64)), workload


def as_job(config: BridgeConfig, workload: list[Arrival]) -> dict:
    return {"config": dataclasses.asdict(config), "workload": [dataclasses.asdict(a) for a in workload]}


def test_an_answer_left_by_an_interrupted_job_is_never_returned_for_the_next(tiny, vllm):
    """Defect 1: a job whose caller was interrupted (sent, never read) still answers later; the next job
    gets its own answer, and so does the one after."""
    config, first = small_job("a", tiny)
    _, second = small_job("b", tiny)
    vllm.send(as_job(config, first))
    for workload in (second, first):
        _, their_tokens = vllm.run(config, workload)
        assert sorted(their_tokens) == sorted(a.name for a in workload)


def test_a_refused_job_leaves_nothing_behind_for_the_next(tiny, vllm):
    """Defect 2: a job vLLM refuses (a prompt longer than its max_model_len) raises, and the next job's
    tokens are its own and right: vLLM is built afresh after a failure."""
    config, workload = small_job("c", tiny)
    too_long = workload + [Arrival("huge", [1] * (config.num_blocks * config.block_size + 10), 2)]
    with pytest.raises(ValueError, match="exceed vLLM's max_model_len"):     # defect 5: refused before
        vllm.run(config, too_long)
    bad = dataclasses.replace(workload[0], prompt=[1] * 300)                # past vLLM's limits: refused
    with pytest.raises(RuntimeError, match="vLLM: "):                        # inside vLLM, then rebuilt
        vllm.job(as_job(dataclasses.replace(config, max_num_batched_tokens=64), [bad]))
    engine = engine_for(tiny, 8, max_num_seqs=4, max_num_batched_tokens=64)
    _, our_tokens = run_engine(engine, workload)
    assert vllm.run(config, workload)[1] == our_tokens


def bridge_processes(*spared: VllmWorker) -> list[int]:
    """Ids of this process's children that run the bridge's worker, from the process table (/proc), less
    those of ``spared`` workers."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:                                   # it ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"pagedlib.vllm.bridge" in cmdline:
            found.append(int(entry))
    return sorted(set(found) - {worker.process.pid for worker in spared})


def test_token_ids_outside_the_vocabulary_are_refused_before_the_job(tiny, vllm):
    """Defect 8: they reached vLLM (an IndexError inside it, then a worker that never answered)."""
    config, workload = small_job("v", tiny)
    bad = [*workload, Arrival("oov", [1, 2, 500], 2)]
    with pytest.raises(ValueError, match="'oov' has token ids outside the model's vocabulary of 96"):
        vllm.run(config, bad)
    assert vllm.run(config, workload)[1].keys() == {a.name for a in workload}


def test_a_job_that_outlives_its_timeout_or_its_with_block_stops_the_worker(tiny, vllm):
    """Defect 3: a timeout stops the worker and says so; leaving a ``with`` block by an exception (a
    Ctrl-C) stops the worker at once, whatever it was doing."""
    config, workload = small_job("d", tiny)
    worker = VllmWorker()
    with pytest.raises(TimeoutError, match="make a new VllmWorker"):
        worker.job(as_job(config, workload), timeout=0.05)
    assert worker.process.poll() is not None
    with pytest.raises(RuntimeError, match="stopped"):
        worker.run(config, workload)
    worker.close()                                                     # defect 9: closing again is fine
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt), VllmWorker() as busy:
        busy.send(as_job(config, workload))
        raise KeyboardInterrupt
    assert busy.process.poll() is not None and time.monotonic() - start < 30
    assert bridge_processes(vllm) == [], "no worker outlives its with block (the process table)"


def test_a_worker_that_died_says_so_and_closes(tiny, vllm):
    """Defect 9: a worker killed from outside gives "exited" (or "stopped") with vLLM's log, not a raw
    BrokenPipeError, and ``close()`` succeeds."""
    config, workload = small_job("e", tiny)
    worker = VllmWorker()
    worker.process.kill()
    worker.process.wait()
    with pytest.raises(RuntimeError, match="stopped|exited"):
        worker.run(config, workload)
    worker.close()
    assert worker.process.poll() is not None and bridge_processes(vllm) == []


def test_a_random_run_of_jobs_refused_interrupted_and_killed_never_mixes_answers(tiny, vllm):
    """Issue 37's acceptance: 32 seeded jobs, each answered (with its own requests' tokens, equal to the
    Engine's) or raising; some are interrupted (sent and never read), some refused inside vLLM, one kills the
    worker; at most 5 vLLM start-ups."""
    rng = random.Random(37)
    config, _ = small_job("x", tiny)
    worker, startups, answered = VllmWorker(), 0, 0
    try:
        for number in range(32):
            kind = rng.choices(["run", "interrupt", "refuse", "kill"], [20, 8, 2, 1])[0]
            if kind == "kill" and startups >= 4 or kind == "refuse" and startups >= 3:
                kind = "run"
            workload = [Arrival(f"j{number}r{i}", tokens(rng, rng.randrange(1, 60)), rng.randrange(1, 6))
                        for i in range(rng.randrange(1, 4))]
            if kind == "interrupt":
                worker.send(as_job(config, workload))
            elif kind == "refuse":
                with pytest.raises(RuntimeError, match="vLLM: "):
                    worker.job(as_job(config, [Arrival(f"j{number}", [1] * 300, 2)]))
            elif kind == "kill":
                worker.process.kill()
                worker.close()
                worker = VllmWorker()
            else:
                answer = worker.job(as_job(config, workload))
                startups += answer["built"]
                _, ours = run_engine(engine_for(tiny, 8, max_num_seqs=4, max_num_batched_tokens=64), workload)
                assert answer["tokens"] == ours, f"job {number} got another job's answer"
                answered += 1
    finally:
        worker.close()
    assert answered >= 15 and startups <= 5
    assert bridge_processes(vllm) == [], "every worker of the run is gone"
