"""Loading a Hugging Face Llama into ``PagedLlama`` (notebook 08): a transformers config read into the fields
of ``LlamaShape``, and a ``LlamaForCausalLM``-style ``state_dict`` copied into a model already built.

Not on the engine path: ``LlamaShape.from_hf`` and ``PagedLlama.from_state_dict`` call it, and
``PagedLlama.from_hf`` is its ``from_hf``; it never imports ``pagedlib.model`` (it takes the model class or
instance and returns plain values).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from pagedlib import checks
from pagedlib.core.groups import SLIDING


def shape_fields(config: Any) -> dict[str, Any]:
    """``LlamaShape``'s fields, read from a transformers config (``ValueError`` naming a field this model
    does not implement). Missing optional fields take transformers' defaults."""
    if isinstance(config, Mapping):  # a config.json read as a dict, or config.to_dict()
        config = SimpleNamespace(**{"num_key_value_heads": None, **config})
    checks.check_hf_config(config)
    rope = getattr(config, "rope_parameters", None) or {}  # newer transformers keep rope_theta here
    heads = config.num_attention_heads
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        rms_norm_eps=float(config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        **window_fields(config),
    )


def window_fields(config: Any) -> dict[str, Any]:
    """``LlamaShape``'s ``layer_types`` and ``sliding_window`` (notebook 15): ``layer_types`` ``None`` when
    every layer runs full attention; a Mistral's one window for every layer makes each layer a sliding
    one."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is None and window is not None:
        kinds = [SLIDING] * config.num_hidden_layers
    if kinds is None or SLIDING not in kinds:
        return dict(layer_types=None, sliding_window=None)
    return dict(layer_types=tuple(kinds), sliding_window=int(window))


def from_hf(cls: Any, hf_model: Any, *, dtype: torch.dtype | None = None,
            device: torch.device | str | None = None) -> Any:
    """``PagedLlama.from_hf`` (``cls``): a copy of a transformers ``LlamaForCausalLM``,
    ``MistralForCausalLM`` or ``MinistralForCausalLM``, in ``dtype`` on ``device`` (default: those of
    ``hf_model``'s weights)."""
    checks.check_hf_model(hf_model)
    first = next(hf_model.parameters())
    if dtype is None:
        dtype = first.dtype
    if device is None:
        device = first.device
    return cls.from_state_dict(hf_model.config, hf_model.state_dict(), dtype=dtype, device=device)


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> nn.Module:
    """Copy ``state_dict`` into ``model`` (built from the same config), then move it to ``dtype`` and
    ``device`` for inference. ``model.`` prefixes and a missing tied ``lm_head.weight`` are fine;
    ``ValueError`` naming unknown or missing weights."""
    state = {}
    for name, weight in state_dict.items():
        if "rotary_emb" not in name:  # transformers' rotary buffers: the model computes its own
            state[name.removeprefix("model.")] = weight
    if model.shape.tie_word_embeddings and "embed_tokens.weight" in state:
        state.setdefault("lm_head.weight", state["embed_tokens.weight"])
    own = model.state_dict()
    for name, weight in state.items():
        if name in own and tuple(weight.shape) != tuple(own[name].shape):
            raise ValueError(f"weight {name} has shape {tuple(weight.shape)}, the config makes it "
                             f"{tuple(own[name].shape)} (a state_dict of another model?)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    checks.check_weights(missing, unexpected)
    return model.to(dtype=dtype, device=device).eval().requires_grad_(False)
