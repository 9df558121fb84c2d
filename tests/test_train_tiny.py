"""The committed tiny character-level model: it loads (as PagedLlama and as transformers' Llama), both
generate the same tokens, it is trained (held-out loss far below chance), and save/load round-trips.
Nothing here trains: the weights come from ``python -m pagedlib.teach.train_tiny``."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math

import pytest
import torch
from helpers import hf_greedy, tiny_llama

import pagedlib  # noqa: F401  (before transformers: pagedlib picks Triton's mode first)
from pagedlib.engine import Engine
from pagedlib.teach.train_tiny import (
    HYBRID_DIR,
    HYBRID_LAYERS,
    HYBRID_WINDOW,
    TINY_DIR,
    CharTokenizer,
    TrainConfig,
    config_record,
    corpus,
    load_tiny,
    load_tiny_hf,
    load_tiny_hybrid,
    load_tiny_hybrid_hf,
    save,
)
from pagedlib.teach.train_tiny import _loss as loss_on
from pagedlib.teach.train_tiny import _lr as lr_at


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_tiny()
    torch.set_num_threads(threads)


def test_committed_files_are_small_and_say_how_they_were_made():
    weights = TINY_DIR / "model.safetensors"
    assert weights.stat().st_size < 4 * 2**20
    record = json.loads((TINY_DIR / "training.json").read_text())
    assert record["command"] == "nice -n 10 python -m pagedlib.teach.train_tiny"
    assert record["config"] == config_record(TrainConfig())    # the defaults made these weights
    assert record["train_seconds"] > 0


def test_paged_model_and_transformers_generate_the_same_text(tiny):
    model, tok = tiny
    hf, _ = load_tiny_hf()
    prompts = [tok.encode('The "for" statement'), tok.encode("import ")]
    got = Engine(model, num_blocks=16, block_size=16).generate(prompts, 40)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, 40)[0]


def test_the_model_is_trained(tiny):
    """Held-out text (the corpus's last 5%, never trained on) costs far fewer nats per character than
    guessing uniformly over the 96 characters (ln 96 = 4.56)."""
    _, tok = tiny
    hf, _ = load_tiny_hf()
    data = torch.tensor(tok.encode(corpus()))
    held_out = data[int(len(data) * 0.95):]
    with torch.no_grad():
        loss = loss_on(hf, held_out, torch.tensor([0, 1000, 5000, 9000]), 128)
    assert loss.item() < 0.5 * math.log(len(tok))


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer("\n" + "".join(chr(c) for c in range(32, 127)))
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    assert tok.decode(tok.encode("\u201cquoted\u201d \u2014 dash")) == '"quoted" - dash'
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("caf\u00e9")
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("aa")


def test_learning_rate_schedule():
    cfg = TrainConfig(steps=100, warmup=10, lr=1.0)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0) and lr_at(cfg, 100) == pytest.approx(0.1)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 100))


def test_save_then_load_round_trips(tmp_path):
    """An untrained model of the tiny vocabulary, saved and loaded back: same weights, same tokens."""
    tok = CharTokenizer("\n" + "".join(chr(c) for c in range(32, 127)))
    hf = tiny_llama(seed=5, vocab_size=len(tok))
    save(hf, tok, TrainConfig(steps=0), {"train_seconds": 0.0}, tmp_path)
    model, tok2 = load_tiny(tmp_path)
    assert tok2.chars == tok.chars
    for name, t in hf.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name.removeprefix("model.")], t, rtol=0, atol=0)
    prompt = tok.encode("while True:")
    assert Engine(model, num_blocks=4).generate([prompt], 6)[0] == hf_greedy(hf, prompt, 6)[0]


def test_missing_weights_say_how_to_make_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m pagedlib.teach.train_tiny"):
        load_tiny(tmp_path)


def test_tokenizer_refuses_ids_outside_the_vocabulary():
    tok = CharTokenizer("abc")
    assert tok.decode([0, 2, 1]) == "acb"
    for bad, match in [([-1], "outside the vocabulary"), ([3], "outside the vocabulary"), ([1.0], "int")]:
        with pytest.raises(ValueError, match=match):
            tok.decode(bad)


def test_load_tiny_takes_a_str_path(tiny):
    model, tok = load_tiny(str(TINY_DIR))
    assert tok.chars == tiny[1].chars
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny[0].state_dict().values()))
    with pytest.raises(FileNotFoundError, match="no tiny model"):
        load_tiny_hf(str(TINY_DIR / "missing"))


# -------------------------------------------------------------------------------------------------------
# the hybrid sibling (notebook 15): sliding-window and full layers in turn


def test_the_hybrid_sibling_says_how_it_was_made_and_which_layers_slide():
    record = json.loads((HYBRID_DIR / "training.json").read_text())
    assert record["command"] == "nice -n 10 python -m pagedlib.teach.train_tiny --hybrid"
    hybrid = TrainConfig(num_layers=len(HYBRID_LAYERS), layer_types=HYBRID_LAYERS,
                         sliding_window=HYBRID_WINDOW)
    assert record["config"] == config_record(hybrid)
    hf, tok = load_tiny_hybrid_hf()
    assert type(hf).__name__ == "MinistralForCausalLM"
    assert hf.config.layer_types == list(HYBRID_LAYERS) and hf.config.sliding_window == HYBRID_WINDOW
    assert hf.config.architectures == ["MistralForCausalLM"]       # the class vLLM serves it with
    model, _ = load_tiny_hybrid()
    assert [model.shape.window(layer) for layer in range(4)] == [HYBRID_WINDOW, None, HYBRID_WINDOW, None]
    data = torch.tensor(tok.encode(corpus()))
    held_out = data[int(len(data) * 0.95):]
    with torch.no_grad():
        loss = loss_on(hf, held_out, torch.tensor([0, 1000, 5000, 9000]), 128)
    assert loss.item() < 0.5 * math.log(len(tok))
    with pytest.raises(FileNotFoundError, match="--hybrid"):
        load_tiny_hybrid_hf(TINY_DIR / "missing")


HYBRID_PROMPTS = ["The return statement leaves the current function call with the expression list ",
                  'The "for" statement is used to iterate over the elements of a sequence (such as a string',
                  "import "]


@pytest.mark.parametrize("attention", ["torch", "cpu"])
@pytest.mark.parametrize("hybrid_kv_cache", [True, False])
def test_hybrid_sibling_generates_what_transformers_generates(attention, hybrid_kv_cache):
    """Prompts longer than the 48-token window and one shorter, 60 new tokens: the window layers read only
    their last 48 tokens, with their own tables (blocks given back) or one table for every layer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_tiny_hybrid()
        hf, _ = load_tiny_hybrid_hf()
        prompts = [tok.encode(text) for text in HYBRID_PROMPTS]
        engine = Engine(model, num_blocks=64, block_size=16, attention=attention,
                        hybrid_kv_cache=hybrid_kv_cache)
        got = engine.generate(prompts, 60)
        for prompt, tokens in zip(prompts, got):
            assert tokens == hf_greedy(hf, prompt, 60)[0]
    finally:
        torch.set_num_threads(threads)


def test_a_host_tier_or_connector_over_the_hybrid_siblings_groups_is_refused_by_name(tmp_path):
    """The host tier and the connectors serve one full-attention group: over the sibling's two groups the
    engine refuses the argument the caller passed, before it builds anything, and names the way out; with
    one table for every layer (``hybrid_kv_cache=False``) the host tier runs, with transformers' tokens."""
    from pagedlib.kv_transfer.connectors import StoreConnector
    from pagedlib.kv_transfer.store import KVStore

    model, tok = load_tiny_hybrid()
    groups = "sliding window 48: layers 0, 2; full attention: layers 1, 3"
    with pytest.raises(ValueError, match=rf"host_blocks= with a model whose layers form KV-cache groups "
                                         rf"\({groups}\).*hybrid_kv_cache=False"):
        Engine(model, 64, 16, host_blocks=8, preemption="swap")
    shape = model.shape
    store = KVStore(tmp_path / "store", model="tiny-hybrid", block_size=16, num_layers=shape.num_layers,
                    kv_heads=shape.num_kv_heads, head_dim=shape.head_dim)
    with pytest.raises(ValueError, match=r"connector= with a model whose layers form KV-cache groups"):
        Engine(model, 64, 16, connector=StoreConnector(store, "producer"))
    hf, _ = load_tiny_hybrid_hf()
    prompt = tok.encode(HYBRID_PROMPTS[0])
    engine = Engine(model, 64, 16, hybrid_kv_cache=False, host_blocks=8)
    assert engine.generate([prompt], 20) == [hf_greedy(hf, prompt, 20)[0]]
