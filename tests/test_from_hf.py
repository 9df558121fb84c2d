"""``from_hf`` accepts exactly what ``PagedLlama`` computes: Llama, Mistral (its one sliding window on every
layer) and Ministral (sliding and full layers, ``layer_types``), each proven token-equal to ``transformers``'
``generate`` (here, and in ``tests/test_engine_oracle.py``); every other family, a bare decoder without its
head, a config field it does not implement (a ``layer_types`` kind among them), float64 weights and (for
the Triton kernel) a head size the kernel cannot take are refused when the model or engine is built, with a
``ValueError`` naming them.

The models are tiny, seeded and built from local configs (no download)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

import pytest
import torch
from helpers import assert_unchanged, snapshot, tiny_hf_model, tiny_llama

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.engine import Engine
from pagedlib.model import LlamaShape, PagedLlama

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, bos_token_id=None, eos_token_id=None)


def hf_model(family: str, seed: int = 0, **overrides):
    """``tiny_hf_model`` at this file's smaller sizes."""
    return tiny_hf_model(family, seed, **{**SIZES, **overrides})


# -------------------------------------------------------------------------------------------------------
# refused, by name


@pytest.mark.parametrize("family", ["Granite", "SmolLM3", "Ernie4_5", "Qwen2", "Qwen3", "Phi3", "Olmo2",
                                    "Cohere"])
def test_other_families_are_refused_naming_the_model_type(family):
    hf = hf_model(family)
    for load in (PagedLlama.from_hf, lambda m: Engine.from_hf(m, num_blocks=8), lambda m: LlamaShape.from_hf(
            m.config)):
        with pytest.raises(ValueError, match=f"model_type={hf.config.model_type!r}"):
            load(hf)


@pytest.mark.parametrize("override, message", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types must list one of"),
    (dict(layer_types=["sliding_attention"]), "for each of the 2 layers"),
    (dict(layer_types="full_attention"), "layer_types must list"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=0), "sliding_window must be"),
    (dict(layer_types=["full_attention", "sliding_attention"], sliding_window=2.5), "sliding_window must be"),
])
def test_layer_kinds_and_windows_it_cannot_run_are_refused(override, message):
    config = hf_model("Ministral", head_dim=8, layer_types=["sliding_attention", "full_attention"],
                      sliding_window=4).config.to_dict()       # a dict: transformers' config refuses some
    with pytest.raises(ValueError, match=message):
        LlamaShape.from_hf({**config, **override})


def test_a_window_reaches_the_layers_that_slide():
    ministral = hf_model("Ministral", head_dim=8, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=5)
    shape = PagedLlama.from_hf(ministral).shape
    assert [shape.window(layer) for layer in range(2)] == [5, None]
    assert [group.layers for group in shape.kv_groups] == [(0,), (1,)]
    mistral = PagedLlama.from_hf(hf_model("Mistral", sliding_window=4)).shape   # one window, every layer
    assert [mistral.window(layer) for layer in range(2)] == [4, 4]
    assert LlamaShape.from_hf(hf_model("Mistral", sliding_window=None).config).layer_types is None


@pytest.mark.parametrize("override, field", [
    (dict(hidden_act="gelu"), "hidden_act"), (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 64}), "rope_type"),
])
def test_llama_config_fields_it_does_not_implement_are_refused(override, field):
    with pytest.raises(ValueError, match=f"supports {field}="):
        PagedLlama.from_hf(tiny_llama(vocab_size=32, **override))


def test_heads_that_do_not_group_are_refused():
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="llama", hidden_size=24, num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LlamaShape.from_hf(config)


def test_a_bare_decoder_without_its_head_is_refused():
    from transformers import LlamaConfig, LlamaModel

    with pytest.raises(ValueError, match="loads a LlamaForCausalLM .* got a LlamaModel"):
        PagedLlama.from_hf(LlamaModel(LlamaConfig(**SIZES)))


def test_a_state_dict_of_other_weights_is_refused():
    hf = tiny_llama(vocab_size=32)
    state = {**hf.state_dict(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="unexpected .*q_proj.bias"):
        PagedLlama.from_state_dict(hf.config, state)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing .*lm_head.weight"):
        PagedLlama.from_state_dict(hf.config, state)


def test_a_config_as_a_dict_and_a_state_dict_of_other_sizes():
    """Issue 37, defects 26 and 27: ``config.to_dict()`` (or a config.json read as a dict) is a config like
    any other; a state_dict whose vocabulary differs from the config's is a ValueError naming the weight."""
    hf = tiny_llama(vocab_size=32)
    model = PagedLlama.from_state_dict(hf.config.to_dict(), hf.state_dict())
    assert model.shape == PagedLlama.from_hf(hf).shape
    other = tiny_llama(vocab_size=40).state_dict()
    with pytest.raises(ValueError, match=r"embed_tokens.weight has shape \(40, .*the config makes it \(32"):
        PagedLlama.from_state_dict(hf.config, other)


def test_float64_is_refused_when_the_model_or_engine_is_built():
    hf = tiny_llama(vocab_size=32)
    with pytest.raises(ValueError, match="float64"):
        PagedLlama.from_hf(hf.double())
    with pytest.raises(ValueError, match="float64"):
        PagedLlama.from_hf(hf, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64"):
        Engine(PagedLlama.from_hf(hf.float()).double(), num_blocks=8)
    assert PagedLlama.from_hf(hf.float(), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_a_head_size_the_triton_kernel_cannot_take_is_refused_up_front():
    pytest.importorskip("triton", reason="Triton ships Linux wheels only")
    model = PagedLlama.from_hf(hf_model("Llama", num_attention_heads=2, num_key_value_heads=1, head_dim=512))
    with pytest.raises(ValueError, match="head_dim must be at most 256 for the Triton kernel"):
        Engine(model, num_blocks=8, block_size=4, attention="triton")
    cache = model.new_cache(num_blocks=4, block_size=4)
    cache.add_sequence(0)
    model.step(cache, [0], [[1, 2, 3]])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="at most 256"):
        model.step(cache, [0], [[4]], attention="triton")
    assert_unchanged(cache, before)
    assert Engine(model, num_blocks=8, block_size=4).generate([[1, 2, 3]], 2)       # torch path: fine
