"""Argument checks of the model and the engine (the neutral ``as_int``, ``ceil_div`` and ``refuse`` are in
``pagedlib.util``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedlib.core.fp8 import FP8_DTYPES
from pagedlib.util import as_int, refuse

#: model_type -> the transformers class ``PagedLlama.from_hf`` loads: each proven token-equal by a test
SUPPORTED_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# config fields that change the computation, and the one value PagedLlama implements
_FIELDS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "sliding_window": None,
           "rope_type": "default"}
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the attention paths' dtypes


def check_hf_config(config: Any) -> None:
    kind = getattr(config, "model_type", None)
    refuse((kind not in SUPPORTED_MODELS, f"PagedLlama supports model_type in {sorted(SUPPORTED_MODELS)} "
            f"only (Mistral: with no sliding window), the config has model_type={kind!r}"))
    got = {k: getattr(config, k, want) for k, want in _FIELDS.items()}
    got["rope_type"] = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    refuse(*((got[k] != v, f"PagedLlama supports {k}={v!r} only, the config has {got[k]!r}")
             for k, v in _FIELDS.items()))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    refuse((head_dim % 2 or heads % kv, "PagedLlama needs an even head_dim and num_attention_heads a "
                                        f"multiple of num_key_value_heads, got {head_dim}, {heads}, {kv}"))


def check_hf_model(hf_model: Any) -> None:
    check_hf_config(getattr(hf_model, "config", None))
    want, got = SUPPORTED_MODELS[hf_model.config.model_type], type(hf_model).__name__
    refuse((got != want, f"PagedLlama.from_hf loads a {want} (a causal LM with its head), got a {got}"))


def check_weights(missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise ValueError(f"not a Llama state_dict: missing {missing[:4]}, unexpected {unexpected[:4]}")


def check_model_dtype(dtype: object) -> None:
    refuse((dtype not in MODEL_DTYPES, f"PagedLlama runs in {', '.join(map(str, MODEL_DTYPES))} (what "
                                       f"attention takes), got {dtype} (pass dtype=...)"))


def token_list(name: str, tokens: Any, vocab_size: int) -> list[int]:
    """``tokens`` (ints, numpy ints, a 1-D integer tensor or numpy array) as ints in ``[0, vocab_size)``."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        kind = str(tokens.dtype).removeprefix("torch.")
        if tokens.ndim != 1 or not kind.startswith(("int", "uint")):
            raise ValueError(f"{name} must be a 1-D integer tensor or array, got {kind} {list(tokens.shape)}")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"{name} must be a list of token ids, got {type(tokens).__name__}")
    out = [as_int(name, t) for t in tokens]
    refuse(*((not 0 <= t < vocab_size, f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")
             for t in out))
    return out


def check_step(model: Any, cache: Any, seq_ids: Any, prompts: Sequence[Any], attention: str
               ) -> tuple[list[Any], list[list[int]]]:
    check_attention(attention)
    check_model_dtype(model.dtype)
    s = model.shape
    dtype = model.dtype if cache.dtype in FP8_DTYPES else cache.dtype  # fp8: quantized on write
    got = (cache.num_layers, cache.kv_heads, cache.head_dim, dtype, cache.device)
    want = (s.num_layers, s.num_kv_heads, s.head_dim, model.dtype, model.device)
    seq_ids = list(seq_ids)
    refuse((got != want, f"cache (layers, kv_heads, head_dim, dtype, device) = {got} does not match the "
                         f"model's {want}"))
    prompts = [token_list(f"tokens of sequence {i}", p, s.vocab_size) for i, p in enumerate(prompts)]
    refuse((len(seq_ids) != len(prompts), f"got {len(seq_ids)} seq_ids but {len(prompts)} token lists"),
           (len(set(seq_ids)) != len(seq_ids), f"seq_ids must be distinct, got {seq_ids}"),
           (not seq_ids, "a step needs at least one sequence"),
           (not all(prompts), "every prompt must hold at least one token"))
    if missing := [sid for sid in seq_ids if sid not in cache.seq_lens]:
        raise KeyError(f"sequence {missing[0]!r} is not in the cache (add_sequence it first)")
    return seq_ids, prompts


def check_kv_cache_dtype(dtype: object, model_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """``kv_cache_dtype`` as ``PagedLlama.new_cache`` takes it: ``None`` for ``None`` or the model's own
    dtype (no quantization), else an fp8 format."""
    if dtype is None or dtype is model_dtype:  # torch dtypes are singletons
        return None
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be None or the model's dtype {model_dtype} (no quantization), "
                         f"or one of {FP8_DTYPES}, got {dtype!r}")
    return dtype


def check_attention(attention: object, block_size: int = 1) -> None:
    refuse((attention not in ("torch", "triton"), f"attention must be one of ('torch', 'triton'), got "
                                                  f"{attention!r}"),
           (attention == "triton" and (block_size > 128 or block_size & (block_size - 1)),
            f"block_size must be a power of two from 1 to 128 for the Triton kernel, got {block_size}"))


def check_generate(prompts: object, max_new_tokens: object, pending: bool) -> int:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, minimum=1)
    refuse((pending, "the engine still has unfinished requests (from add_request): step() them to completion "
                     "first"))
    return max_new_tokens


def check_engine(model: Any, model_class: type, num_blocks: int, block_size: int, attention: str,
                 enable_prefix_caching: bool, max_num_seqs: int) -> tuple[int, int, int]:
    if not isinstance(model, model_class):
        raise ValueError(f"model must be a PagedLlama (Engine.from_hf takes a transformers model), "
                         f"got {type(model).__name__}")
    check_model_dtype(model.dtype)
    sizes = [as_int(n, v, minimum=1) for n, v in (("num_blocks", num_blocks), ("block_size", block_size))]
    check_attention(attention, sizes[1])
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
    return sizes[0], sizes[1], as_int("max_num_seqs", max_num_seqs, minimum=1)


def check_token_budget(budget: object, threshold: object) -> tuple[int | None, int | None]:
    """``(max_num_batched_tokens, long_prefill_token_threshold)`` as ints (``None``: whole prompts)."""
    refuse((budget is None and threshold is not None,
            "long_prefill_token_threshold needs max_num_batched_tokens (a token budget)"))
    return tuple(None if v is None else as_int(n, v, minimum=1) for n, v in (
        ("max_num_batched_tokens", budget), ("long_prefill_token_threshold", threshold)))
