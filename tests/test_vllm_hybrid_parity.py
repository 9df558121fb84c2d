"""The course's engine serving the tiny hybrid model (notebook 15) against vLLM 0.32.0 serving it, stepped
through seeded workloads: the same tokens, and step by step the same schedule, the same blocks held in each
KV-cache group's table (given-back blocks as ``NULL_BLOCK`` in both), the same free blocks and preemptions.

The workloads are drawn at random from a seed: prompts longer than the 48-token window, a budget that cuts
prompts into chunks, and a pool small enough that requests are preempted. With prefix caching (pagedlib keeps
every full block of every group findable; the bridge runs vLLM with ``prefix_cache_retention_interval=None``,
which does the same) most prompts share part of a text and the pool is smaller still: hits across both
groups, cached blocks evicted."""

from __future__ import annotations

import random

import pytest

from pagedlib.core.groups import NULL_BLOCK
from pagedlib.engine import Engine
from pagedlib.vllm.bridge import (
    Arrival,
    VllmWorker,
    config_of,
    differences,
    max_model_len,
    run_engine,
    vllm_available,
)

AVAILABLE, WHY = vllm_available()
if not AVAILABLE:
    pytest.skip(WHY, allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BLOCK = 32          # vLLM's CPU attention takes multiples of 32 only
VOCAB = 96


@pytest.fixture(scope="module")
def vllm():
    with VllmWorker() as worker:
        yield worker


@pytest.fixture(scope="module")
def hybrid():
    from pagedlib.teach.train_tiny import HYBRID_DIR, load_tiny_hybrid

    return load_tiny_hybrid()[0], HYBRID_DIR


def hybrid_workload(seed: int, model, folder) -> tuple[list[Arrival], Engine]:
    """Three to six requests of up to 200 tokens arriving over the first steps, some behind a shared
    prefix, a budget of 48 to 128 tokens, and a pool of 10 to 16 blocks: tight enough to preempt. Each
    request is cut to vLLM's ``max_model_len`` for that pool (both groups' blocks counted)."""
    rng = random.Random(seed)
    engine = Engine(model, rng.randrange(10, 17), BLOCK, enable_prefix_caching=False, max_num_seqs=8,
                    max_num_batched_tokens=rng.choice([48, 64, 96, 128]))
    limit = max_model_len(config_of(engine, folder))
    shared = [rng.randrange(VOCAB) for _ in range(rng.randrange(40, 120))]
    workload = []
    for i in range(rng.randrange(3, 7)):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(30, 130))]
        prompt = shared + own if rng.random() < 0.5 else own
        new = rng.randrange(8, 40)
        workload.append(Arrival(f"r{i}", prompt[:limit - new], new, step=rng.randrange(0, 6)))
    return workload, engine


def cached_workload(seed: int, model, folder) -> tuple[list[Arrival], Engine]:
    """Four to nine requests, most starting with part of one text, over the first 12 steps; a pool of 8 to
    12 blocks (prefix caching on)."""
    rng = random.Random(seed)
    engine = Engine(model, rng.randrange(8, 13), BLOCK, enable_prefix_caching=True, max_num_seqs=8,
                    max_num_batched_tokens=rng.choice([48, 64, 96, 128]))
    limit = max_model_len(config_of(engine, folder))
    shared = [rng.randrange(VOCAB) for _ in range(rng.randrange(40, 160))]
    workload = []
    for i in range(rng.randrange(4, 10)):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 130))]
        if rng.random() < 0.7:
            own = shared[:rng.randrange(len(shared) // 2, len(shared) + 1)] + own
        new = rng.randrange(2, 40)
        workload.append(Arrival(f"r{i}", own[:limit - new], new, step=rng.randrange(0, 12)))
    return workload, engine


def compare(seed: int, hybrid, vllm, caching: bool = False) -> list:
    """Run one seed's workload through both engines: the same tokens; their step records."""
    workload, engine = (cached_workload if caching else hybrid_workload)(seed, *hybrid)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine, hybrid[1]), workload)
    assert our_tokens == their_tokens
    return ours, theirs


@pytest.mark.parametrize("seed", range(8))
def test_the_engine_holds_vllms_blocks_in_every_group_step_by_step(seed, hybrid, vllm):
    ours, theirs = compare(seed, hybrid, vllm)
    assert differences(ours, theirs) == []
    assert all(record.group_blocks for record in ours if record.blocks)       # two tables compared
    released = [NULL_BLOCK in window for record in ours for window, _ in record.group_blocks.values()]
    assert any(released)                                                       # the window gave blocks back


def test_the_seeds_preempt_and_split_prompts(hybrid):
    """The seeds above reach what the comparison is for: preemptions and prompts cut into chunks."""
    preempted = chunked = 0
    for seed in range(8):
        workload, engine = hybrid_workload(seed, *hybrid)
        ours, _ = run_engine(engine, workload)
        preempted += sum(len(record.preempted) for record in ours)
        chunked += any(n < len(a.prompt) for a in workload for record in ours
                       for name, n in record.scheduled.items() if name == a.name and n > 1)
    assert preempted > 0 and chunked > 0


@pytest.mark.parametrize("seed", range(8))
def test_with_prefix_caching_the_engine_finds_and_evicts_what_vllm_does(seed, hybrid, vllm):
    ours, theirs = compare(seed, hybrid, vllm, caching=True)
    assert differences(ours, theirs) == []


def test_the_cached_seeds_hit_preempt_and_evict(hybrid):
    """The prefix-caching seeds reach hits past the window, preemptions and evictions of cached blocks."""
    hits = preempted = evicted = 0
    for seed in range(8):
        workload, engine = cached_workload(seed, *hybrid)
        ours, _ = run_engine(engine, workload)
        hits += sum(n > 48 for record in ours for n in record.hits.values())
        preempted += sum(len(record.preempted) for record in ours)
        evicted += engine.cache.prefix_cache.evicted_blocks
    assert hits > 0 and preempted > 0 and evicted > 0
