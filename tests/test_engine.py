"""Engine: continuous batching through the paged cache gives, token for token, what transformers gives:
``generate`` one prompt at a time, and its own paged continuous batching ``generate_batch``; also when the
pool is so small that requests are preempted and recomputed, and with prefix caching (hits > 0)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

import pytest
import torch
from helpers import ORACLE_NEW_TOKENS, hf_greedy, tiny_llama

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.engine import Engine
from pagedlib.model import PagedLlama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (conftest)


def assert_idle(engine: Engine) -> None:
    """Every block back on the free stack, no request left."""
    engine.cache.check_invariants()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert not engine.cache.seq_lens and not engine.has_unfinished() and not engine.requests


def test_generate_in_a_small_pool_with_one_new_token_and_a_progress_bar(ref, model, capsys):
    _, prompts, outs = ref
    engine = Engine(model, num_blocks=10, block_size=8)
    assert engine.generate(prompts, 1, progress=True) == [t[:1] for t, _ in outs]
    assert "generate" in capsys.readouterr().err
    assert_idle(engine)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
    (dict(prompts=[[1, 200]]), r"prompts\[0\]: token id 200 is outside the vocabulary"),
    (dict(prompts=[[-3]]), "outside the vocabulary"),
    (dict(prompts=[[1, 2.5]]), "must be an int"),
    (dict(prompts=[[True]]), "bool"),
    (dict(prompts="hello"), "list of token-id lists"),
    (dict(prompts=[[1]], max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(prompts=[[1]], max_new_tokens=2.0), "max_new_tokens must be an int"),
    (dict(prompts=[[1]] * 3 + [list(range(62))]), r"prompts\[3\] \(62 tokens\) .* needs 65 token slots"),
    (dict(prompts=[list(range(40))], max_new_tokens=26), "more than the pool of 4 blocks x 16 = 64"),
])
def test_bad_input_is_rejected_before_any_work(model, kwargs, match):
    engine = Engine(model, num_blocks=4, block_size=16)                  # 64 token slots
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        engine.generate(args["prompts"], args["max_new_tokens"])
    assert engine.stats.steps == 0
    assert_idle(engine)
    assert engine.generate([list(range(40))], 25) == engine.generate([list(range(40))], 25)  # still works


@pytest.mark.parametrize("kwargs, match", [
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be a bool"),
    (dict(attention="flash"), "attention must be"),
    (dict(attention="triton", block_size=12), "power of two"),
    (dict(num_blocks=0), "num_blocks must be >= 1"),
    (dict(block_size=True), "block_size must be an int"),
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
])
def test_bad_engine_arguments(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model, **{"num_blocks": 8, **kwargs})


def test_engine_wants_a_paged_model():
    with pytest.raises(ValueError, match="PagedLlama"):
        Engine(tiny_llama(vocab_size=32), num_blocks=8)


def test_an_error_mid_run_frees_everything(model, monkeypatch):
    engine = Engine(model, num_blocks=16, block_size=4)
    calls = []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return PagedLlama.step(model, *args, **kwargs)

    monkeypatch.setattr(model, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate([[1, 2, 3], [4, 5]], 8)
    assert_idle(engine)
    monkeypatch.undo()
    assert len(engine.generate([[1, 2, 3], [4, 5]], 8)[1]) == 8


def test_generate_refuses_while_stepped_requests_are_pending(model):
    engine = Engine(model, num_blocks=8, block_size=4)
    engine.add_request([1, 2, 3], 2)
    with pytest.raises(ValueError, match="unfinished"):
        engine.generate([[1]], 1)


# ------------------------------------------------------------------------------------------------------
# prefix caching

# (tokens of the shared 48-token text, own tokens): whole and partial prefixes ending on and around block
# boundaries of 4, 8 and 16, a prompt that is exactly the text (twice), and one sharing nothing
SPLITS = [(48, 0), (48, 1), (47, 2), (32, 0), (32, 1), (33, 15), (16, 0), (16, 16), (17, 31), (48, 16),
          (8, 1), (0, 9), (48, 0), (40, 24)]


@pytest.fixture(scope="module")
def shared(ref):
    """Prompts sharing a prefix, and transformers' greedy tokens for each."""
    hf = ref[0]
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, 200, (48,), generator=g).tolist()
    prompts = [text[:n] + torch.randint(0, 200, (m,), generator=g).tolist() for n, m in SPLITS]
    return prompts, [hf_greedy(hf, p, ORACLE_NEW_TOKENS)[0] for p in prompts]


def test_an_error_mid_prefill_leaves_no_placeholder_block_to_find(model, shared, monkeypatch):
    """The model reserves slots (registering full blocks by their token ids) before it computes their K/V;
    if the forward pass fails there, those blocks must never be found: the engine starts a fresh cache."""
    prompts, want = shared
    engine = Engine(model, num_blocks=64, block_size=8, enable_prefix_caching=True)
    monkeypatch.setattr(model, "_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(prompts[:2], 4)
    monkeypatch.undo()
    assert_idle(engine)
    assert engine.cache.prefix_cache_stats()["cached_blocks"] == 0
    assert engine.generate(prompts[:2], 4) == [w[:4] for w in want[:2]]


# ------------------------------------------------------------------------------------------------------
# an interrupted step, threads, numpy prompts, the watermark


def test_an_interrupted_step_refuses_every_call_until_reset(ref, model, monkeypatch):
    """A KeyboardInterrupt between the scheduler's plan and the forward pass: the engine says so on every
    later call instead of generating 11 tokens where 12 were asked (or failing later); after ``reset()``
    it is idle and generates exactly what transformers generates."""
    _, prompts, outs = ref
    engine = Engine(model, num_blocks=32, block_size=4)
    engine.add_request(prompts[4], 12)
    engine.step()                                                        # request 0 prefilled
    engine.add_request(prompts[7], 12)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "step", interrupted)                      # step 2 decodes 0, prefills 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    # no request half-moved: each holds the K/V it has computed, and no token was appended
    assert [len(r.output_tokens) for r in engine.requests.values()] == [1, 0]
    assert all(engine.cache.seq_lens[r.req_id] == r.num_computed_tokens for r in engine.scheduler.running)
    for call in (engine.step, lambda: engine.generate([[1, 2]], 3), lambda: engine.add_request([1], 2)):
        with pytest.raises(RuntimeError, match=r"raised midway .* call reset\(\)"):
            call()
    engine.reset()
    assert_idle(engine)
    assert engine.generate([prompts[4], prompts[7]], 12) == [outs[4][0][:12], outs[7][0][:12]]


def test_abort_stops_a_request_in_any_state_and_the_others_run_on(ref, model):
    # issue 30 item 9: a running, a preempted and a waiting request can each be aborted
    _, prompts, outs = ref
    engine = Engine(model, num_blocks=16, block_size=8, max_num_seqs=2)
    ids = [engine.add_request(prompts[i], 30) for i in (20, 21, 22, 23)]  # 48-64 tokens each
    preempted = []
    for _ in range(100):
        preempted = engine.step().preempted
        if preempted:
            break
    assert preempted
    running = [r.req_id for r in engine.scheduler.running]
    waiting = [r.req_id for r in engine.scheduler.waiting if r.req_id not in preempted]
    for req_id in (preempted[0], running[0], waiting[0]):
        engine.abort(req_id)
        engine.cache.check_invariants()
    with pytest.raises(ValueError, match="not a waiting or running request"):
        engine.abort(running[0])
    while engine.has_unfinished():
        engine.step()
    (last,) = set(ids) - {preempted[0], running[0], waiting[0]}
    assert engine.output(last) == outs[20 + ids.index(last)][0][:30]
    assert engine.output(running[0]) == outs[20 + ids.index(running[0])][0][:len(engine.output(running[0]))]
    assert engine.cache.num_free_blocks == 16


def test_generate_from_a_second_thread_is_refused_while_the_first_runs(ref, model, monkeypatch):
    import threading

    _, prompts, outs = ref
    engine = Engine(model, num_blocks=64, block_size=8)
    inside, release, result = threading.Event(), threading.Event(), {}

    def slow_step(*args, **kwargs):
        inside.set()
        release.wait(timeout=30)
        return PagedLlama.step(model, *args, **kwargs)

    monkeypatch.setattr(model, "step", slow_step)
    worker = threading.Thread(target=lambda: result.setdefault("out", engine.generate(prompts[:3], 6)))
    worker.start()
    assert inside.wait(timeout=30)
    try:
        for call in (lambda: engine.generate([[1, 2]], 3), engine.step, lambda: engine.add_request([1], 2)):
            with pytest.raises(RuntimeError, match="single-threaded"):
                call()
    finally:
        release.set()
        worker.join(timeout=60)
    assert result["out"] == [t[:6] for t, _ in outs[:3]]               # the first thread was not disturbed
    assert_idle(engine)


def test_numpy_prompts_are_token_lists(ref, model):
    np = pytest.importorskip("numpy")
    _, prompts, outs = ref
    engine = Engine(model, num_blocks=32, block_size=8)
    arrays = [np.array(prompts[5]), np.array(prompts[9], dtype=np.int32), torch.tensor(prompts[11])]
    assert engine.generate(arrays, 5) == [outs[i][0][:5] for i in (5, 9, 11)]
    req_id = engine.add_request(np.array(prompts[5], dtype=np.uint16), 2)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(req_id) == outs[5][0][:2]
    for bad, match in [(np.array([1.0, 2.0]), "1-D integer"), (np.array([[1, 2]]), "1-D integer"),
                       (np.array([1, 999]), "outside the vocabulary")]:
        with pytest.raises(ValueError, match=match):
            Engine(model, num_blocks=8).generate([bad], 2)


def test_a_lone_request_may_fill_the_pool_up_to_the_documented_watermark(model):
    """With 100 blocks the scheduler keeps 1 free (1%, vLLM's default watermark): a request needing all 100
    is refused with a message that says so; one needing 99 runs."""
    engine = Engine(model, num_blocks=100, block_size=1)
    assert engine.watermark_blocks == 1
    with pytest.raises(ValueError, match=r"100 token slots .* pool of 100 blocks less the watermark of 1 "):
        engine.generate([list(range(100))], 1)
    assert len(engine.generate([list(range(99))], 1)[0]) == 1
    assert_idle(engine)
