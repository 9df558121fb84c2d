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


# what a seed draws from: (pool blocks, requests, shared text's tokens, a request's own tokens, new tokens,
# arrival steps) as ranges, and how often a request starts with the text
PLAIN = dict(caching=False, pool=(10, 17), requests=(3, 7), shared=(40, 120), own=(30, 130), new=(8, 40),
             steps=(0, 6), share=0.5)
CACHED = dict(caching=True, pool=(8, 13), requests=(4, 10), shared=(40, 160), own=(1, 130), new=(2, 40),
              steps=(0, 12), share=0.7)


def hybrid_workload(seed: int, model, folder, draw=PLAIN) -> tuple[list[Arrival], Engine]:
    """Requests of up to a few hundred tokens arriving over the first steps, some starting with a shared
    text (all of it, or with prefix caching (``CACHED``) at least its first half), a budget of 48 to 128
    tokens, and a pool tight enough to preempt (and with prefix caching, to evict). Each request is cut to
    vLLM's ``max_model_len`` for that pool (both groups' blocks counted)."""
    rng = random.Random(seed)
    engine = Engine(model, rng.randrange(*draw["pool"]), BLOCK, enable_prefix_caching=draw["caching"],
                    max_num_seqs=8, max_num_batched_tokens=rng.choice([48, 64, 96, 128]))
    limit = max_model_len(config_of(engine, folder))
    shared = [rng.randrange(VOCAB) for _ in range(rng.randrange(*draw["shared"]))]
    workload = []
    for i in range(rng.randrange(*draw["requests"])):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(*draw["own"]))]
        if rng.random() < draw["share"]:
            text = shared[:rng.randrange(len(shared) // 2, len(shared) + 1)] if draw["caching"] else shared
            prompt = text + prompt
        new = rng.randrange(*draw["new"])
        workload.append(Arrival(f"r{i}", prompt[:limit - new], new, step=rng.randrange(*draw["steps"])))
    return workload, engine


def compare(seed: int, hybrid, vllm, caching: bool = False) -> list:
    """Run one seed's workload through both engines: the same tokens; their step records."""
    workload, engine = hybrid_workload(seed, *hybrid, CACHED if caching else PLAIN)
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
        workload, engine = hybrid_workload(seed, *hybrid, CACHED)
        ours, _ = run_engine(engine, workload)
        hits += sum(n > 48 for record in ours for n in record.hits.values())
        preempted += sum(len(record.preempted) for record in ours)
        evicted += engine.cache.prefix_cache.evicted_blocks
    assert hits > 0 and preempted > 0 and evicted > 0
