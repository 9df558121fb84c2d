"""One door for K/V beyond the device pool: the scheduler plans and books, the engine moves bytes.

``schedule()`` reads and writes no K/V tensor, whatever sits behind the connector (the host tier in every
mode, a store); a store that fails in any way (a disk error on a load, any exception on a save, one block of
several) costs only recomputation, never a token; a plan's requests cannot be finished under it."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.disagg import tiny_store
from pagedlib.engine import Engine
from pagedlib.kv_transfer.connectors import StoreConnector
from pagedlib.kv_transfer.host_tier import HostCache, HostTier
from pagedlib.kv_transfer.store import block_hashes
from pagedlib.testing import check_host, check_invariants

BLOCK = 32
SETTINGS = {"num_blocks": 8, "block_size": BLOCK, "max_num_batched_tokens": 64, "full_prompt_must_fit": False}


@pytest.fixture(scope="module")
def tiny():
    from pagedlib.teach.train_tiny import load_tiny

    return load_tiny()[0]


def prompts_of(lengths, seed=0, shared=0):
    rng = random.Random(seed)
    head = [rng.randrange(96) for _ in range(shared)]
    return [head + [rng.randrange(96) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of((100, 70, 134, 40, 90, 66), shared=40)


@functools.cache
def expected(tiny) -> tuple:
    return tuple(map(tuple, Engine(tiny, **{**SETTINGS, "num_blocks": 64}).generate(PROMPTS, 12)))


class KVSpy(TorchFunctionMode):
    """Records every torch call that touches the storage of ``tensors`` (any view of them)."""

    def __init__(self, tensors):
        super().__init__()
        self.pointers = {t.untyped_storage().data_ptr() for t in tensors}
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for arg in list(args) + list((kwargs or {}).values()):
            if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in self.pointers:
                self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def spied_run(engine: Engine) -> tuple[list, int, int]:
    """Run ``PROMPTS`` to the end, every ``schedule()`` under a spy on the device pool and the host tier:
    the tokens, the K/V calls the scheduler made (none expected), the K/V calls of the steps themselves."""
    ids = [engine.add_request(p, 12) for p in PROMPTS]
    tensors = [engine.cache.pool.k, engine.cache.pool.v]
    if engine.host is not None:
        tensors += [engine.host.k, engine.host.v]
    inside = outside = 0
    schedule = engine.scheduler.schedule

    def watched():
        with KVSpy(tensors) as spy:
            plan = schedule()
        nonlocal inside
        inside += len(spy.calls)
        return plan

    engine.scheduler.schedule = watched
    while engine.has_unfinished():
        with KVSpy(tensors) as spy:
            engine.step()
        outside += len(spy.calls)
        check_invariants(engine.cache)
        check_host(engine.scheduler)
    return [engine.output(i) for i in ids], inside, outside


@pytest.mark.parametrize("tier", [
    {"host_blocks": 16},
    {"host_blocks": 16, "host_write": "victim", "enable_prefix_caching": True},
    {"host_blocks": 16, "preemption": "swap", "host_write": "none"},
    {"host_blocks": 3, "preemption": "swap", "enable_prefix_caching": True},
    {"host_blocks": 16, "preemption": "swap", "enable_prefix_caching": True, "prefix_cache": "radix"},
])
def test_schedule_touches_no_kv_whatever_the_host_tier_does(tiny, tier):
    engine = Engine(tiny, **SETTINGS, **tier)
    tokens, inside, outside = spied_run(engine)
    assert [tuple(t) for t in tokens] == list(expected(tiny))
    stats = engine.host.stats()
    assert stats["bytes_moved"] > 0  # the tier worked
    if tier.get("preemption") == "swap" and engine.stats.preemptions:
        assert stats["swapped_out_blocks"] + stats["swap_fallbacks"] > 0
    assert inside == 0, "schedule() read or wrote K/V"
    assert outside > 0  # the spy sees the steps' own copies and writes: it would see schedule()'s


def test_schedule_touches_no_kv_with_a_store(tiny, tmp_path):
    Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(tmp_path))).generate(PROMPTS[:3], 1)
    engine = Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(tmp_path)))
    tokens, inside, _ = spied_run(engine)
    assert [tuple(t) for t in tokens] == list(expected(tiny))
    assert engine.stats.connector_tokens > 0 and inside == 0


def test_the_spy_sees_a_scheduler_that_copies(tiny):
    """The spy is no test that cannot fail: a scheduler that copies a block inside ``schedule()``, as the
    two-door scheduler's swap-out did, is caught."""
    engine = Engine(tiny, **SETTINGS, host_blocks=16)
    original = engine.scheduler.preempt

    def copying_preempt():
        request = engine.scheduler.running[-1]
        blocks = engine.cache.tables[request.req_id]
        engine.host.copy_out(engine.cache.pool, blocks, list(range(len(blocks))))
        return original()

    engine.scheduler.preempt = copying_preempt
    _, inside, _ = spied_run(engine)
    assert inside > 0


# ---- a store that fails: only recomputation ---------------------------------------------------------------

def stored(tiny, root) -> None:
    """Every full block of ``PROMPTS`` in the store at ``root``."""
    roomy = {**SETTINGS, "num_blocks": 64}
    Engine(tiny, **roomy, connector=StoreConnector(tiny_store(root))).generate(PROMPTS, 1)


def run_with(tiny, root, patch) -> tuple[Engine, list]:
    engine = Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(root)))
    patch(engine.connector.store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = engine.generate(PROMPTS, 12)
    return engine, [str(w.message) for w in caught], tokens


def test_a_disk_error_on_a_load_is_recomputed_counted_and_logged(tiny, tmp_path):
    stored(tiny, tmp_path)
    failed = []

    def patch(store):
        original = store.get

        def get(key):
            if not failed:
                failed.append(key)
                raise OSError(5, "Input/output error")
            return original(key)
        store.get = get

    engine, messages, tokens = run_with(tiny, tmp_path, patch)
    assert [tuple(t) for t in tokens] == list(expected(tiny))
    assert engine.stats.load_failures == 1 and engine.connector.load_failures == 1
    assert any(failed[0][:12] in m and "OSError" in m for m in messages), messages


@pytest.mark.parametrize("error", [ValueError("bad"), RuntimeError("boom"), OSError(28, "No space")])
def test_any_failing_save_is_a_later_miss_and_each_block_is_tried_alone(tiny, tmp_path, error):
    calls = []

    def patch(store):
        original = store.put

        def put(key, *args):
            calls.append(key)
            if len(calls) == 1:
                raise error
            return original(key, *args)
        store.put = put

    engine, messages, tokens = run_with(tiny, tmp_path, patch)
    assert [tuple(t) for t in tokens] == list(expected(tiny))
    assert engine.connector.save_failures == 1 and any(type(error).__name__ in m for m in messages)
    store = tiny_store(tmp_path)
    keys = {key for p in PROMPTS for key in block_hashes(p + [0] * 12, BLOCK)[:len(p) // BLOCK]}
    missing = [key for key in keys if key not in store]
    assert set(missing) <= {calls[0]}, "one failed block cost only itself (or nothing: saved again later)"


def test_an_interrupt_inside_a_save_propagates_and_the_engine_goes_on(tiny, tmp_path):
    def patch(store):
        original = store.put
        state = {"armed": True}

        def put(*args):
            if state["armed"]:
                state["armed"] = False
                raise KeyboardInterrupt
            return original(*args)
        store.put = put

    with pytest.raises(KeyboardInterrupt):
        run_with(tiny, tmp_path, patch)
    engine = Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(tmp_path)))
    assert [tuple(t) for t in engine.generate(PROMPTS, 12)] == list(expected(tiny))


# ---- the random fault run: the store and both connectors -------------------------------------------------

WRITER = """
import sys
from pagedlib.disagg import tiny_store
from pagedlib.engine import Engine
from pagedlib.kv_transfer.connectors import StoreConnector
from pagedlib.teach.train_tiny import load_tiny
prompts = eval(sys.argv[2])
engine = Engine(load_tiny()[0], 64, 32, connector=StoreConnector(tiny_store(sys.argv[1]), "producer"))
engine.generate(prompts, 1)
"""


class Flaky(BaseException):
    """An interrupt the fault run injects (a BaseException: it passes every ``except Exception``)."""


def faulty(rng, function, rate, errors):
    def call(*args, **kwargs):
        if rng.random() < rate:
            raise rng.choice(errors)
        return function(*args, **kwargs)
    return call


def damage(rng, store, root) -> None:
    """Spoil one entry on disk: truncated, garbled, another entry's bytes, or a folder in its place."""
    entries = sorted(root.glob("??/*.safetensors"))
    if not entries:
        return
    path = rng.choice(entries)
    how = rng.choice(["truncate", "garble", "swap", "folder"])
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[:rng.randrange(len(data))])
    elif how == "garble":
        i = rng.randrange(8, len(data))
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
    elif how == "swap":
        path.write_bytes(rng.choice(entries).read_bytes())
    else:
        path.unlink()
        path.mkdir()


def files_under(folder) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("seed", range(4))
def test_random_store_and_host_faults_never_change_a_token(tiny, tmp_path, seed):
    """Seeded: a second process writes into the same store while this engine runs; entries are damaged
    between steps; loads and saves raise disk errors, other exceptions and interrupts; the host tier's
    copies are interrupted. Every request ends with the tokens of an engine with neither; nothing is
    written outside the store's folder; no process is left."""
    rng = random.Random(seed)
    root, outside = tmp_path / "store", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    before = files_under(tmp_path)
    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), repr(PROMPTS[::-1])], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for connector_kind in ("store", "host"):
            if connector_kind == "store":
                engine = Engine(tiny, **SETTINGS, enable_prefix_caching=rng.random() < 0.5,
                                connector=StoreConnector(tiny_store(root)))
                store = engine.connector.store
                store.get = faulty(rng, store.get, 0.1, [OSError(5, "EIO"), Flaky()])
                store.put = faulty(rng, store.put, 0.1, [OSError(28, "ENOSPC"), ValueError("x"), Flaky()])
            else:
                engine = Engine(tiny, **SETTINGS, host_blocks=rng.randrange(2, 16), preemption="swap",
                                enable_prefix_caching=True, host_write=rng.choice(["through", "victim"]))
                host = engine.host
                host.copy_in = faulty(rng, host.copy_in, 0.1, [Flaky()])
                host.copy_out = faulty(rng, host.copy_out, 0.1, [Flaky()])
            ids = [engine.add_request(p, 12) for p in PROMPTS]
            steps = 0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                while engine.has_unfinished():
                    steps += 1
                    assert steps < 3000, "no progress"
                    if connector_kind == "store" and rng.random() < 0.1:
                        damage(rng, store, root)
                    try:
                        engine.step()
                    except Flaky:
                        pass
                    check_invariants(engine.cache)
                    check_host(engine.scheduler)
            assert [tuple(engine.output(i)) for i in ids] == list(expected(tiny)), connector_kind
        assert writer.wait(timeout=120) == 0, writer.stderr.read().decode()[-2000:]
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
        writer.stderr.close()
    assert writer.poll() is not None
    after = files_under(tmp_path)
    assert {p for p in after - before if not p.startswith("store")} == set(), "written outside the store"
    assert (outside / "keep.txt").read_text() == "mine"
    assert not [p for p in root.rglob("*.tmp")], "a write left its temporary file"


# ---- the scheduler's own hardening ------------------------------------------------------------------------

def test_finish_is_refused_while_a_plan_is_open_and_changes_nothing(tiny):
    engine = Engine(tiny, **SETTINGS)
    scheduler = engine.scheduler
    request = Request(0, 0, 80, 3, tuple(PROMPTS[3]))
    scheduler.add(request)
    plan = scheduler.schedule()
    held = list(engine.cache.tables[0])
    with pytest.raises(RuntimeError, match="a step's plan is open"):
        scheduler.finish(request)
    assert engine.cache.tables[0] == held and scheduler.plan is plan and request in scheduler.running
    late = Request(1, 0, 80, 3, tuple(PROMPTS[3]))
    scheduler.add(late)  # allowed mid-step: it waits for the next step
    assert late not in [r for r, _ in plan.work]
    scheduler.update(plan, [5])
    assert scheduler.plan is None and late in scheduler.waiting


def test_host_cache_and_tier_name_their_own_arguments(tiny):
    with pytest.raises(ValueError, match="capacity"):
        HostCache(-1)
    pool = Engine(tiny, **SETTINGS).cache.pool
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier(pool, -1)
    with pytest.raises(ValueError, match="policy must be one of"):
        HostCache(4, "mru")


def test_a_scheduler_refuses_what_is_not_a_connector(tiny):
    engine = Engine(tiny, **SETTINGS)
    with pytest.raises(ValueError, match="connector must be a KVConnector"):
        Scheduler(engine.model.new_cache(8, BLOCK), connector=object())
