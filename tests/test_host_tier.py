"""The host tier beside the device pool (notebook 13): blocks stored write-through or as victims, found again
after the device pool evicted them, and preemption by swapping. Whatever the tier does, the tokens are
transformers' own; after every step (interrupted ones included) every block of both tiers is accounted for.
"""

from __future__ import annotations

import functools
import itertools
import os
import random

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from helpers import hf_greedy, tiny_hf_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pagedlib  # noqa: F401
from pagedlib.engine import Engine
from pagedlib.kv_transfer.host_tier import HostTier
from pagedlib.testing import InvariantError, check_host, check_invariants

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
NEW_TOKENS = 10


@functools.cache
def hf():
    return tiny_hf_model("Llama")


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    """Three 22-token texts, each asked four times with its own tail, the texts taking turns: by the time a
    text comes back, a tight device pool has evicted its blocks, and the host tier still has them."""
    g = torch.Generator().manual_seed(11)
    texts = [torch.randint(0, 200, (22,), generator=g).tolist() for _ in range(3)]
    out = []
    for round_ in range(4):
        for text in texts:
            tail = torch.randint(0, 200, (1 + 3 * round_,), generator=g).tolist()
            out.append(tuple(text + tail))
    return tuple(out)


@functools.cache
def want(index: int) -> tuple[int, ...]:
    return tuple(hf_greedy(hf(), list(prompts()[index]), NEW_TOKENS)[0])


def device_blocks() -> int:
    """The longest request fits alone, with two blocks to spare: others are preempted."""
    longest = max(len(p) for p in prompts()) + NEW_TOKENS - 1
    return -(-longest // BLOCK) + 2


def run(engine: Engine, prompts_: list[list[int]]) -> list[list[int]]:
    """Every prompt added, then steps to the end, the invariants of both tiers checked after each."""
    ids = [engine.add_request(p, NEW_TOKENS) for p in prompts_]
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine.cache)
        check_host(engine.scheduler)
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    if engine.host is not None:
        assert engine.host.cache.reserved == 0  # no swapped blocks left behind
    return [engine.output(i) for i in ids]


PREFIX = {"none": {}, "hash": {"enable_prefix_caching": True},
          "radix": {"enable_prefix_caching": True, "prefix_cache": "radix"}}
CELLS = [(prefix, write, preemption, host)
         for prefix, write, preemption, host in itertools.product(
             PREFIX, ("through", "victim", "none"), ("recompute", "swap"), ("roomy", "tiny"))
         if not (write == "victim" and prefix == "none")
         and not (write == "none" and preemption == "recompute")]


@pytest.mark.parametrize("prefix,write,preemption,host", CELLS)
def test_the_tokens_are_transformers_whatever_the_host_tier_does(prefix, write, preemption, host):
    host_blocks = 64 if host == "roomy" else 3
    engine = Engine.from_hf(hf(), device_blocks(), BLOCK, host_blocks=host_blocks, host_write=write,
                            preemption=preemption, max_num_batched_tokens=16, **PREFIX[prefix])
    got = run(engine, [list(p) for p in prompts()])
    assert [tuple(t) for t in got] == [want(i) for i in range(len(prompts()))]
    stats = engine.host.stats()
    assert engine.stats.preemptions > 0  # the pool is tight: the workload tests what it means to
    if write != "none" and host == "roomy":
        assert engine.stats.connector_tokens > 0 and stats["loaded_blocks"] > 0
        assert stats["saved_blocks"] > 0
    if preemption == "swap" and host == "roomy":
        assert stats["swapped_out_blocks"] >= stats["swapped_in_blocks"] > 0  # less what the cache kept
    if preemption == "swap" and host == "tiny":  # 3 slots hold no request's blocks: it recomputes
        assert stats["swap_fallbacks"] > 0
    if preemption == "swap" and stats["swap_fallbacks"] == 0:
        assert engine.stats.recomputed_tokens == 0  # every preemption swapped: nothing computed twice
    if preemption == "recompute":  # a preempted request's blocks may come back from the host tier
        assert stats["swapped_out_blocks"] == 0
        assert engine.stats.recomputed_tokens > 0 or engine.stats.connector_tokens > 0


def test_the_host_tier_saves_prefill_that_the_device_pool_alone_recomputes():
    both = Engine.from_hf(hf(), device_blocks(), BLOCK, enable_prefix_caching=True, host_blocks=64)
    alone = Engine.from_hf(hf(), device_blocks(), BLOCK, enable_prefix_caching=True)
    assert run(both, [list(p) for p in prompts()]) == run(alone, [list(p) for p in prompts()])
    assert both.stats.prefill_tokens < alone.stats.prefill_tokens
    assert both.stats.connector_tokens > 0 == alone.stats.connector_tokens
    lookups = both.host.stats()  # every admission's lookup counts, the misses too
    assert lookups["queried_blocks"] > lookups["hit_blocks"] == lookups["loaded_blocks"] > 0
    assert 0 < lookups["hit_rate"] < 1


def test_bytes_moved_are_blocks_times_the_block_size_in_bytes():
    engine = Engine.from_hf(hf(), device_blocks(), BLOCK, host_blocks=64, preemption="swap")
    run(engine, [list(p) for p in prompts()])
    host = engine.host
    layers, kv_heads, head_dim = 2, 2, 16
    assert host.block_bytes == 2 * layers * BLOCK * kv_heads * head_dim * 4  # K and V, fp32
    moved = host.saved_blocks + host.loaded_blocks + host.swapped_out_blocks + host.swapped_in_blocks
    assert host.bytes_moved == moved * host.block_bytes > 0


@pytest.mark.parametrize("settings_,message", [
    ({"preemption": "swap"}, "needs a host tier"),
    ({"host_blocks": 8, "host_policy": "mru"}, "host_policy"),
    ({"host_blocks": 8, "host_write": "back"}, "host_write"),
    ({"host_blocks": 8, "host_write": "victim"}, "enable_prefix_caching"),
    ({"host_blocks": -1}, "host_blocks"),
    ({"host_blocks": 2.5}, "host_blocks"),
    ({"host_blocks": 8, "preemption": "drop"}, "preemption"),
])
def test_bad_host_settings_are_refused_by_name(settings_, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_hf(hf(), 16, BLOCK, **settings_)


def test_a_host_tier_of_another_shape_is_refused():
    from pagedlib.core.scheduler import Scheduler
    from pagedlib.kv_transfer.connectors import HostConnector

    engine = Engine.from_hf(hf(), 16, BLOCK)
    other = Engine.from_hf(hf(), 16, 8).cache.pool
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(engine.cache, connector=HostConnector(HostTier(other, 4)))
    fp8 = Engine.from_hf(hf(), 16, BLOCK, kv_cache_dtype=torch.float8_e4m3fn).cache.pool
    with pytest.raises(ValueError, match="host tier blocks"):
        Scheduler(engine.cache, connector=HostConnector(HostTier(fp8, 4)))


def test_check_host_names_a_slot_in_two_places():
    engine = Engine.from_hf(hf(), device_blocks(), BLOCK, host_blocks=64)
    run(engine, [list(p) for p in prompts()[:4]])
    cache = engine.host.cache
    cache.free_slots.append(next(iter(cache.slots.values())))
    with pytest.raises(InvariantError, match="two places"):
        check_host(engine.scheduler)


def test_check_host_finds_a_stored_block_whose_bytes_differ():
    engine = Engine.from_hf(hf(), 64, BLOCK, enable_prefix_caching=True, host_blocks=64)
    run(engine, [list(p) for p in prompts()[:4]])
    slot = next(iter(engine.host.cache.slots.values()))
    engine.host.k[slot] += 1
    with pytest.raises(InvariantError, match="different K/V"):
        check_host(engine.scheduler)


class Interrupt(BaseException):
    pass


# the cases the random runs found, kept: a victim store made for a copy-in's own allocation overwrote the
# block being loaded (no pin); a swapped request re-registered blocks the radix tree held; an interrupted
# victim copy inside the radix tree's partial-block allocation lost the block
@example(seed=0, prefix="hash", write="victim", preemption="recompute", host_blocks=2, spare=0,
         policy="lru", budget=None, faults=0.0)
@example(seed=1, prefix="radix", write="through", preemption="swap", host_blocks=5, spare=0,
         policy="lru", budget=None, faults=0.0)
@example(seed=1, prefix="radix", write="victim", preemption="recompute", host_blocks=1, spare=0,
         policy="lru", budget=None, faults=0.25)
@settings(max_examples=60, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), prefix=st.sampled_from(sorted(PREFIX)),
       write=st.sampled_from(["through", "victim", "none"]),
       preemption=st.sampled_from(["recompute", "swap"]),
       host_blocks=st.integers(1, 24), spare=st.integers(0, 6), policy=st.sampled_from(["lru", "arc"]),
       budget=st.sampled_from([None, 8, 16]), faults=st.floats(0, 0.3))
def test_random_runs_with_interrupted_copies_keep_every_block_and_every_token(
        seed, prefix, write, preemption, host_blocks, spare, policy, budget, faults):
    """Random prompts sharing texts, random tier sizes and modes; each copy between the tiers and each forward
    pass is interrupted with probability ``faults``. After every step, failed or not, both tiers' invariants
    hold; retried, every request ends with the tokens of an engine with no host tier."""
    if write == "victim" and prefix == "none":
        write = "through"
    if write == "none" and preemption == "recompute":
        preemption = "swap"
    rng = random.Random(seed)
    texts = [[rng.randrange(200) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    prompts_ = [rng.choice(texts) + [rng.randrange(200) for _ in range(rng.randrange(1, 9))]
                for _ in range(rng.randrange(2, 9))]
    longest = max(len(p) for p in prompts_) + 5
    num_blocks = -(-longest // BLOCK) + spare
    plain = Engine.from_hf(hf(), num_blocks, BLOCK, max_num_batched_tokens=budget)
    expected = plain.generate(prompts_, 6)
    engine = Engine.from_hf(hf(), num_blocks, BLOCK, host_blocks=host_blocks, host_write=write,
                            host_policy=policy, preemption=preemption, max_num_batched_tokens=budget,
                            **PREFIX[prefix])
    ids = [engine.add_request(p, 6) for p in prompts_]
    host = engine.host
    originals = {name: getattr(HostTier, name) for name in ("copy_out", "copy_in")}
    forward = engine.model.forward

    def flaky(function):
        def call(*args, **kwargs):
            if rng.random() < faults:
                raise Interrupt
            return function(*args, **kwargs)
        return call

    host.copy_out = flaky(functools.partial(originals["copy_out"], host))
    host.copy_in = flaky(functools.partial(originals["copy_in"], host))
    engine.model.forward = flaky(forward)
    steps = 0
    try:
        while engine.has_unfinished():
            steps += 1
            assert steps < 2000, "no progress"
            try:
                engine.step()
            except Interrupt:
                pass
            check_invariants(engine.cache)
            check_host(engine.scheduler)
    finally:
        del engine.model.forward
    assert [engine.output(i) for i in ids] == expected
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert host.cache.reserved == 0


def test_an_fp8_cache_moves_its_bytes_unchanged():
    """fp8 blocks are copied as their bytes (torch has no fp8 indexing on the CPU): the tokens are the fp8
    engine's own."""
    fp8 = dict(kv_cache_dtype=torch.float8_e4m3fn, enable_prefix_caching=True, max_num_batched_tokens=16)
    plain = run(Engine.from_hf(hf(), device_blocks(), BLOCK, **fp8), [list(p) for p in prompts()])
    engine = Engine.from_hf(hf(), device_blocks(), BLOCK, host_blocks=64, preemption="swap", **fp8)
    assert run(engine, [list(p) for p in prompts()]) == plain
    assert engine.host.k.dtype == torch.float8_e4m3fn and engine.host.stats()["loaded_blocks"] > 0


def test_aborting_a_swapped_request_gives_its_host_slots_back():
    engine = Engine.from_hf(hf(), device_blocks(), BLOCK, host_blocks=64, preemption="swap",
                            host_write="none", max_num_batched_tokens=16)
    ids = [engine.add_request(list(p), NEW_TOKENS) for p in prompts()]
    swapped = None
    while swapped is None and engine.has_unfinished():
        engine.step()
        swapped = next((r for r in engine.scheduler.waiting if r.req_id in engine.connector.swapped), None)
    assert swapped is not None, "the workload swaps a request out"
    held, its_slots = engine.host.cache.reserved, len(engine.connector.swapped[swapped.req_id].slots)
    engine.abort(swapped.req_id)
    assert engine.host.cache.reserved == held - its_slots and its_slots > 0
    assert swapped.req_id not in engine.connector.swapped
    check_host(engine.scheduler)
    while engine.has_unfinished():
        engine.step()
        check_host(engine.scheduler)
    assert engine.host.cache.reserved == 0
    assert all(engine.output(i) for i in ids if i != swapped.req_id)


def test_an_interrupted_generate_leaves_a_fresh_tier_and_the_same_tokens_after():
    engine = Engine.from_hf(hf(), device_blocks(), BLOCK, enable_prefix_caching=True, host_blocks=64,
                            preemption="swap", max_num_batched_tokens=16)
    calls = 0
    forward = engine.model.forward

    def interrupted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 20:
            raise KeyboardInterrupt
        return forward(*args, **kwargs)

    engine.model.forward = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.generate([list(p) for p in prompts()], NEW_TOKENS)
    del engine.model.forward
    assert engine.host.cache.reserved == 0 and len(engine.host.cache) == 0  # reset: a new tier
    got = engine.generate([list(p) for p in prompts()], NEW_TOKENS)
    assert [tuple(t) for t in got] == [want(i) for i in range(len(prompts()))]
