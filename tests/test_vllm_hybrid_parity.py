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
from pagedlib.vllm.bridge import Arrival, VllmWorker, config_of, differences, run_engine, vllm_available

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


def hybrid_workload(seed: int) -> tuple[list[Arrival], dict]:
    """Three to six requests of 30 to 200 tokens arriving over the first steps, some behind a shared
    prefix, a budget of 48 to 128 tokens, and a pool of 10 to 16 blocks: tight enough to preempt."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(rng.randrange(40, 120))]
    workload = []
    for i in range(rng.randrange(3, 7)):
        own = [rng.randrange(VOCAB) for _ in range(rng.randrange(30, 130))]
        prompt = shared + own if rng.random() < 0.5 else own
        workload.append(Arrival(f"r{i}", prompt[:200], rng.randrange(8, 40), step=rng.randrange(0, 6)))
    settings = dict(num_blocks=rng.randrange(10, 17), max_num_batched_tokens=rng.choice([48, 64, 96, 128]))
    return workload, settings


@pytest.mark.parametrize("seed", range(6))
def test_the_engine_holds_vllms_blocks_in_every_group_step_by_step(seed, hybrid, vllm):
    model, folder = hybrid
    workload, settings = hybrid_workload(seed)
    engine = Engine(model, block_size=BLOCK, enable_prefix_caching=False, **settings)
    ours, our_tokens = run_engine(engine, workload)
    theirs, their_tokens = vllm.run(config_of(engine, folder), workload)
    assert our_tokens == their_tokens
    assert differences(ours, theirs) == []
    assert all(record.group_blocks for record in ours if record.blocks)       # two tables compared
    released = [NULL_BLOCK in window for record in ours for window, _ in record.group_blocks.values()]
    assert any(released)                                                       # the window gave blocks back
