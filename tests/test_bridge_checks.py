"""What the vLLM bridge and the scheduler refuse before anything runs (issue 37): these need no vLLM."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_llama

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.engine import Engine
from pagedlib.model import PagedLlama
from pagedlib.sim.simulate import sim_step
from pagedlib.vllm.bridge import Arrival, StepRecord, config_of, differences, run_engine


@pytest.fixture(scope="module")
def model():
    return PagedLlama.from_hf(tiny_llama())


@pytest.fixture(scope="module")
def tiny():
    from pagedlib.teach.train_tiny import load_tiny

    return load_tiny()[0]


def test_config_of_refuses_what_vllm_would_run_differently(tiny):
    """Defects 4, 17: a non-engine is a TypeError; an fp8 cache or a block size vLLM's CPU backend does not
    take is refused by name; every setting that changes a decision is passed."""
    with pytest.raises(TypeError, match="must be a pagedlib Engine"):
        config_of(object())
    fp8 = Engine(tiny, 8, 32, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        config_of(fp8)
    with pytest.raises(ValueError, match="multiples of 32"):
        config_of(Engine(tiny, 8, 16, max_num_batched_tokens=64, max_num_seqs=4))
    engine = Engine(tiny, 8, 32, max_num_batched_tokens=64, max_num_seqs=4, watermark=0.25,
                    long_prefill_token_threshold=40, full_prompt_must_fit=False)
    config = config_of(engine)
    assert (config.watermark, config.long_prefill_token_threshold, config.scheduler_reserve_full_isl,
            config.dtype) == (0.25, 40, False, "float32")


def test_run_engine_checks_the_whole_workload_before_it_runs(model):
    """Defects 6, 7: a repeated name or a request the engine refuses is found before any request runs."""
    engine = Engine(model, 8, 32, max_num_batched_tokens=64, max_num_seqs=4)
    ok = Arrival("a", [1, 2, 3], 2)
    for workload, error, match in [([ok, Arrival("a", [4], 2)], ValueError, "names 'a' twice"),
                                   ([ok, Arrival("b", [4], 0, step=3)], ValueError, "max_new_tokens"),
                                   ([ok, ("b", [4], 2)], TypeError, "Arrival")]:
        with pytest.raises(error, match=match):
            run_engine(engine, workload)
        assert not engine.has_unfinished() and engine.stats.steps == 0


def test_differences_compares_block_identity_over_the_whole_run():
    """Defect 20: block ids are renamed once per run, so a request that gets back another block than the
    other engine's is a difference; raw dicts are refused."""
    ours = [StepRecord(blocks={"a": [3]}), StepRecord(blocks={"b": [3]})]       # b reuses a's block
    theirs = [StepRecord(blocks={"a": [7]}), StepRecord(blocks={"b": [8]})]     # b gets another
    assert differences(ours, theirs) == ["step 1 blocks: pagedlib {'b': [0]}, vLLM {'b': [1]}"]
    assert differences(ours, [StepRecord(blocks={"a": [5]}), StepRecord(blocks={"b": [5]})]) == []
    with pytest.raises(TypeError, match="StepRecord"):
        differences([{"blocks": {}}], ours)


def test_a_plan_is_taken_once_and_its_tokens_are_checked():
    """Defects 10, 22, 23: ``update`` takes the open plan once, with one token id (an int >= 0) per row;
    a request finished already cannot be finished again; nothing changes the queues while a plan is open."""
    sched = Scheduler(PagedKVCache(8, 1, 4, 1, 1), max_model_len=32)
    sched.add(Request(0, 0, 3, 2))
    sched.add(Request(1, 0, 2, 1))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="plan is open"):
        sched.schedule()
    with pytest.raises(RuntimeError, match="plan is open"):
        sched.abort(0)
    for bad, match in [([1], "must hold 2 tokens"), ([1, -1], r"sampled\[1\] must be >= 0"),
                       ([1, 2.5], "must be an int"), (None, "list of 2 token ids")]:
        with pytest.raises(ValueError, match=match):
            sched.update(plan, bad)
    finished = sched.update(plan, [5, 6])
    assert [r.req_id for r in finished] == [1]
    with pytest.raises(ValueError, match="open plan"):
        sched.update(plan, [5, 6])
    with pytest.raises(ValueError, match="finished already"):
        sched.finish(finished[0])
    while sched.has_unfinished:
        sim_step(sched)
    assert sched.cache.num_free_blocks == 8


def test_config_of_refuses_a_folder_that_holds_another_model():
    """Defect 18: the engine's model (vocabulary 200, 2 layers) is not the tiny model of the folder."""
    engine = Engine(PagedLlama.from_hf(tiny_llama()), 8, 32, max_num_batched_tokens=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="is not the engine's model.*vocab_size"):
        config_of(engine)


def test_vllm_available_checks_the_version(monkeypatch):
    """Defect 21: a vLLM of another version is not the one the course is checked against."""
    from pagedlib.vllm import bridge as vllm_bridge

    monkeypatch.setattr(vllm_bridge, "_installed_version", lambda: "0.1.0")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    available, why = vllm_bridge.vllm_available()
    assert not available and "0.1.0" in why and vllm_bridge.VLLM_VERSION in why


# ---- a hostile user's review: what the bridge and bench generate refuse up front ---------------------------

TESTS = str(Path(__file__).resolve().parent)


def test_vllm_worker_run_refuses_a_name_used_twice_before_sending():
    """Two arrivals of one name: vLLM answers tokens by name, so one request's tokens were lost."""
    from pagedlib.vllm.bridge import BridgeConfig, VllmWorker

    worker = VllmWorker.__new__(VllmWorker)          # no process at all: nothing may be sent
    worker.child = None
    with pytest.raises(ValueError, match="names 'a' twice"):
        worker.run(BridgeConfig(num_blocks=8), [Arrival("a", [1, 2], 2), Arrival("b", [3], 2),
                                                Arrival("a", [4], 2)])


@pytest.fixture
def fresh_probe():
    """``vllm_available``'s import check runs once per process: forget its answer around a test."""
    from pagedlib.vllm import bridge

    bridge._import_error.cache_clear()
    yield
    bridge._import_error.cache_clear()


@pytest.mark.parametrize("init, why", [
    ('raise ImportError("this vllm is broken on purpose")', "ImportError: this vllm is broken on purpose"),
    ('__version__ = "0.1.0"', "import vllm finds version 0.1.0"),
])
def test_vllm_available_checks_that_the_pinned_vllm_imports(init, why, monkeypatch, tmp_path, fresh_probe):
    """A vLLM whose metadata says the pinned version but whose import fails (or finds another vLLM first on
    the path) is not available; the import runs in a child, never in this process."""
    from pagedlib.vllm import bridge

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(init + "\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(bridge, "_installed_version", lambda: bridge.VLLM_VERSION)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    available, message = bridge.vllm_available()
    assert not available and why in message and "vllm" not in sys.modules


@pytest.mark.parametrize("settings, match", [
    ({"block_size": 16}, "block_size=16: vLLM's CPU attention takes multiples of 32"),
    ({"block_size": 0}, "block_size must be >= 1"),
    ({"num_blocks": 0}, "num_blocks must be >= 1"),
    ({"max_num_seqs": 300}, "max_num_seqs=300: vLLM needs max_num_batched_tokens"),
    ({"watermark": 1.0}, "watermark=1.0"),
    ({"kv_role": "both"}, "kv_role='both'"),
    ({"prefix_cache_retention_interval": 16}, "prefix_cache_retention_interval=16 must be a multiple of "
                                              "block_size=32"),
    ({"prefix_cache_retention_interval": -32}, "prefix_cache_retention_interval must be >= 0"),
])
def test_a_bridge_config_built_by_hand_is_checked_as_config_of_checks(settings, match):
    from pagedlib.vllm.bridge import BridgeConfig

    with pytest.raises(ValueError, match=match):
        BridgeConfig(**{"num_blocks": 8, **settings})


def test_a_vllm_worker_whose_process_fails_dies_or_hangs_says_so(monkeypatch):
    """The worker's guarantees, from ``pagedlib.child``, with ``tests/childish.py`` in place of vLLM's worker:
    a refused job keeps its "vLLM: " message, a dead worker names its exit code, a hung one is stopped."""
    from pagedlib.vllm import bridge

    monkeypatch.setattr(bridge, "vllm_available", lambda: (True, ""))
    monkeypatch.setattr(bridge, "WORKER_MODULE", "childish")
    monkeypatch.setenv("PYTHONPATH", TESTS)
    monkeypatch.setenv("CHILDISH", "raise")
    with bridge.VllmWorker() as worker:
        with pytest.raises(RuntimeError, match="^vLLM: ValueError: childish refuses"):
            worker.job({"config": {}})
    monkeypatch.setenv("CHILDISH", "exit3")
    with bridge.VllmWorker() as worker:
        with pytest.raises(RuntimeError, match="python -m childish exited with 3") as error:
            worker.job({"config": {}})
        assert "dying on purpose" in str(error.value)
        with pytest.raises(RuntimeError, match="stopped"):
            worker.send({"config": {}})
    monkeypatch.setenv("CHILDISH", "sleep")
    worker = bridge.VllmWorker(timeout=0.5)
    with pytest.raises(TimeoutError, match=r"within 0.5 s.*make a new VllmWorker"):
        worker.job({"config": {}})
    assert worker.process.poll() is not None
    worker.close()


def test_bench_generate_refuses_a_huge_block_size_before_the_run():
    """``--block-size 10000000`` died of memory after the run started: every request holds whole blocks."""
    import subprocess

    from pagedlib.child import ROOT, child_env

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pagedlib.bench", "generate", "--block-size", "10000000"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env())
    assert done.returncode == 2 and "--block-size" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and time.monotonic() - start < 60
