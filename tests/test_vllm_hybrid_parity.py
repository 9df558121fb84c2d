"""The course's engine serving the tiny hybrid model (notebook 15) against vLLM 0.32.0 serving it, stepped
through seeded workloads: the same tokens, and step by step the same schedule, the same blocks held in each
KV-cache group's table (given-back blocks as ``NULL_BLOCK`` in both), the same free blocks and preemptions.

The workloads are drawn at random from a seed: prompts longer than the 48-token window, a budget that cuts
prompts into chunks, and a pool small enough that requests are preempted."""

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


def compare(seed: int, hybrid, vllm) -> list:
    """Run one seed's workload through both engines: the same tokens; their step records."""
    workload, engine = hybrid_workload(seed, *hybrid)
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
