"""Engine: continuous batching through the paged cache gives, token for token, what transformers gives:
``generate`` one prompt at a time, and its own paged continuous batching ``generate_batch``; also when the
pool is so small that requests are preempted and recomputed, and with prefix caching (hits > 0)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

import pytest
import torch
from helpers import ORACLE_NEW_TOKENS, assert_unchanged, hf_greedy, snapshot, tiny_llama

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.engine import Engine
from pagedlib.model import PagedLlama
from pagedlib.testing import check_invariants

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (conftest)


def assert_idle(engine: Engine) -> None:
    """Every block back on the free stack, no request left."""
    check_invariants(engine.cache)
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
    (dict(prompts=[list(range(40))], max_new_tokens=26), "5 blocks of 16, more than the pool of 4 blocks"),
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

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return PagedLlama.forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", failing_forward)
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


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_an_error_mid_prefill_leaves_no_placeholder_block_to_find(model, shared, monkeypatch, prefix_cache):
    """The scheduler registers the full blocks it schedules before the forward pass computes their K/V (as
    vLLM does); if the pass fails, the step is undone: none of those blocks can be found, and the same
    prompts then get fresh, correct tokens from the same engine."""
    prompts, want = shared
    engine = Engine(model, num_blocks=64, block_size=8, enable_prefix_caching=True, prefix_cache=prefix_cache)
    monkeypatch.setattr(model, "_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(prompts[:2], 4)
    monkeypatch.undo()
    assert_idle(engine)
    assert engine.cache.prefix_cache_stats()["cached_blocks"] == 0
    assert engine.generate(prompts[:2], 4) == [w[:4] for w in want[:2]]


# ------------------------------------------------------------------------------------------------------
# an interrupted step, threads, numpy prompts, the watermark


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_an_interrupted_step_is_undone_and_the_engine_goes_on(ref, model, monkeypatch, enable_prefix_caching):
    """A KeyboardInterrupt inside the forward pass: the step is undone (no block of it allocated, findable
    or admitted), the interrupt reaches the caller, and the next ``step()`` plans the same step again: the
    tokens are exactly transformers'."""
    _, prompts, outs = ref
    engine = Engine(model, num_blocks=32, block_size=4, enable_prefix_caching=enable_prefix_caching)
    first = engine.add_request(prompts[4], 12)
    engine.step()                                                        # request 0 prefilled
    second = engine.add_request(prompts[7], 12)
    before = snapshot(engine.cache)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "forward", interrupted)                   # step 2 decodes 0, prefills 1
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.undo()
    assert_unchanged(engine.cache, before)
    assert [len(r.output_tokens) for r in engine.requests.values()] == [1, 0]
    assert [r.req_id for r in engine.scheduler.waiting] == [second]
    check_invariants(engine.cache)
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(first), engine.output(second)] == [outs[4][0][:12], outs[7][0][:12]]
    assert engine.cache.num_free_blocks == 32 and not engine.has_unfinished()


def test_a_call_from_inside_a_step_is_refused_and_output_after_reset_says_why(ref, model, monkeypatch):
    """Defects 24, 25: a call into the engine while its step runs names the reason; ``output`` of a request
    that ``reset()`` forgot raises a ``KeyError`` that says so."""
    _, prompts, _ = ref
    engine = Engine(model, num_blocks=32, block_size=4)
    req_id = engine.add_request(prompts[4], 3)
    seen = []

    def reentrant(*args, **kwargs):
        for call in (engine.step, lambda: engine.add_request([1], 2), lambda: engine.abort(req_id)):
            with pytest.raises(RuntimeError, match=r"inside step\(\)"):
                call()
            seen.append(call)
        return PagedLlama.forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", reentrant)
    engine.step()
    assert len(seen) == 3
    monkeypatch.undo()
    engine.reset()
    with pytest.raises(KeyError, match="reset"):
        engine.output(req_id)


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
        check_invariants(engine.cache)
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
        return PagedLlama.forward(model, *args, **kwargs)

    monkeypatch.setattr(model, "forward", slow_step)
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


def test_a_lone_request_may_fill_the_pool_and_the_watermark_holds_only_while_others_run(model):
    """vLLM 0.32.0's rule: the watermark (default 0.0) is kept free only while a request runs. With 100
    blocks of 1 and ``watermark=0.05``, a lone request may still fill all 100 (its peak is the prompt and
    every new token but the last); a second one waits while the first runs if admitting it would leave fewer
    than 5 blocks free."""
    engine = Engine(model, num_blocks=100, block_size=1, watermark=0.05)
    assert engine.config.watermark_blocks == 5
    with pytest.raises(ValueError, match=r"101 token slots .* 101 blocks of 1, more than the pool of 100"):
        engine.generate([list(range(101))], 1)
    assert len(engine.generate([list(range(100))], 1)[0]) == 1
    assert_idle(engine)
    first = engine.add_request(list(range(50)), 20)
    engine.step()                                                        # 50 blocks held, 50 free
    second = engine.add_request(list(range(46)), 2)                      # 46 + 5 > 49 free after a decode
    assert engine.step().prefilled == []
    while second not in engine.step().prefilled:
        pass
    assert first in engine.stats.finished                                # it waited for the first to end
    default = Engine(model, num_blocks=100, block_size=1)                # vLLM's default: no watermark
    default.add_request(list(range(50)), 20)
    default.step()
    late = default.add_request(list(range(46)), 2)
    assert default.step().prefilled == [late]
