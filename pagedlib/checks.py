"""Argument checks of the model and the engine, and the engine's refusal of a second thread or of a call
after a failed step (the neutral ``as_int``, ``ceil_div`` and ``refuse`` are in ``pagedlib.util``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedlib.core.fp8 import FP8_DTYPES
from pagedlib.core.groups import LAYER_KINDS, SLIDING
from pagedlib.util import as_int

#: model_type -> the transformers class ``PagedLlama.from_hf`` loads: each proven token-equal by a test
SUPPORTED_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "ministral": "MinistralForCausalLM"}  # layer_types: sliding and full (notebook 15)
# config fields that change the computation, and the one value PagedLlama implements
_FIELDS = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "rope_type": "default"}
ATTENTION = ("torch", "triton", "cpu")  # the gather path; the fused kernels for GPUs and for CPUs
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the attention paths' dtypes


def check_hf_config(config: Any) -> None:
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODELS:
        raise ValueError(f"PagedLlama supports model_type in {sorted(SUPPORTED_MODELS)} only, the config has "
                         f"model_type={kind!r}")
    for field, want in _FIELDS.items():
        got = getattr(config, field, want)
        if field == "rope_type":  # transformers keeps it inside rope_parameters
            rope = getattr(config, "rope_parameters", None) or {}
            got = rope.get("rope_type", "default")
        if got != want:
            raise ValueError(f"PagedLlama supports {field}={want!r} only, the config has {got!r}")
    heads = config.num_attention_heads
    kv_heads = config.num_key_value_heads or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 2 or heads % kv_heads:
        raise ValueError("PagedLlama needs an even head_dim and num_attention_heads a multiple of "
                         f"num_key_value_heads, got {head_dim}, {heads}, {kv_heads}")
    check_layer_types(getattr(config, "layer_types", None), getattr(config, "sliding_window", None),
                      config.num_hidden_layers)


def check_layer_types(layer_types: Any, sliding_window: Any, num_layers: int) -> None:
    """A config's ``layer_types`` (``None``, or one of ``LAYER_KINDS`` per layer) and ``sliding_window``
    (``None``, or the tokens a sliding layer sees: an int >= 1, needed when a layer slides)."""
    if layer_types is not None:
        if (isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, Sequence)
                or len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_KINDS)):
            raise ValueError(f"layer_types must list one of {LAYER_KINDS} for each of the {num_layers} "
                             f"layers, got {layer_types!r}")
    slides = sliding_window is not None if layer_types is None else SLIDING in layer_types
    if slides and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                   or sliding_window < 1):
        raise ValueError(f"sliding_window must be an int >= 1 for sliding_attention layers, got "
                         f"{sliding_window!r}")


def check_hf_model(hf_model: Any) -> None:
    check_hf_config(getattr(hf_model, "config", None))
    want = SUPPORTED_MODELS[hf_model.config.model_type]
    got = type(hf_model).__name__
    if got != want:
        raise ValueError(f"PagedLlama.from_hf loads a {want} (a causal LM with its head), got a {got}")


def check_weights(missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        raise ValueError(f"not a Llama state_dict: missing {missing[:4]}, unexpected {unexpected[:4]}")


def check_model_dtype(dtype: object) -> None:
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"PagedLlama runs in {', '.join(map(str, MODEL_DTYPES))} (what attention takes), "
                         f"got {dtype} (pass dtype=...)")


def token_list(name: str, tokens: Any, vocab_size: int) -> list[int]:
    """``tokens`` (ints, numpy ints, a 1-D integer tensor or numpy array) as ints in ``[0, vocab_size)``."""
    if isinstance(tokens, (torch.Tensor, np.ndarray)):
        kind = str(tokens.dtype).removeprefix("torch.")
        if tokens.ndim != 1 or not kind.startswith(("int", "uint")):
            raise ValueError(f"{name} must be a 1-D integer tensor or array, got {kind} {list(tokens.shape)}")
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise ValueError(f"{name} must be a list of token ids, got {type(tokens).__name__}")
    out = [as_int(name, token) for token in tokens]
    for token in out:
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name}: token id {token} is outside the vocabulary [0, {vocab_size})")
    return out


def check_step(model: Any, cache: Any, seq_ids: Any, prompts: Sequence[Any], attention: str
               ) -> tuple[list[Any], list[list[int]]]:
    check_attention(attention, head_dim=model.shape.head_dim, device=model.device)
    check_model_dtype(model.dtype)
    shape = model.shape
    dtype = cache.dtype
    if dtype in FP8_DTYPES:  # fp8: the model's K/V, quantized on write
        dtype = model.dtype
    got = (cache.num_layers, cache.kv_heads, cache.head_dim, dtype, cache.device)
    want = (shape.num_layers, shape.num_kv_heads, shape.head_dim, model.dtype, model.device)
    if got != want:
        raise ValueError(f"cache (layers, kv_heads, head_dim, dtype, device) = {got} does not match the "
                         f"model's {want}")
    seq_ids = list(seq_ids)
    prompts = [token_list(f"tokens of sequence {i}", p, shape.vocab_size) for i, p in enumerate(prompts)]
    if len(seq_ids) != len(prompts):
        raise ValueError(f"got {len(seq_ids)} seq_ids but {len(prompts)} token lists")
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
    if not seq_ids:
        raise ValueError("a step needs at least one sequence")
    if not all(prompts):
        raise ValueError("every prompt must hold at least one token")
    for seq_id in seq_ids:
        if seq_id not in cache.seq_lens:
            raise KeyError(f"sequence {seq_id!r} is not in the cache (add_sequence it first)")
    return seq_ids, prompts


def check_kv_cache_dtype(dtype: object, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for ``PagedLlama.new_cache``'s ``kv_cache_dtype``: the model's own for ``None`` or
    that dtype (no quantization), else an fp8 format."""
    if dtype is None or dtype is model_dtype:  # torch dtypes are singletons
        return model_dtype
    if not isinstance(dtype, torch.dtype) or dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be None or the model's dtype {model_dtype} (no quantization), "
                         f"or one of {FP8_DTYPES}, got {dtype!r}")
    return dtype


def check_attention(attention: object, block_size: int = 1, head_dim: int = 1,
                    device: torch.device | str = "cpu") -> None:
    """``attention`` one of the three paths, and what its kernel takes: Triton's ``block_size`` and
    ``head_dim`` limits; the CPU kernel's device, ``head_dim`` limit and a C compiler that builds it."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    if attention == "cpu":
        from pagedlib.kernels import cpu_varlen  # builds the kernel on first use

        if torch.device(device).type != "cpu":
            raise ValueError(f"attention='cpu' runs on the CPU; the model is on {device}")
        limit = cpu_varlen.MAX_CPU_BLOCK_SIZE
        if block_size > limit:
            raise ValueError(f"block_size must be at most {limit} for the CPU kernel, got {block_size}")
        if head_dim > cpu_varlen.MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be at most {cpu_varlen.MAX_HEAD_DIM} for the CPU kernel, the "
                             f"model has {head_dim}")
        available, why = cpu_varlen.cpu_kernel_available()
        if not available:
            raise RuntimeError(why)
    if attention != "triton":
        return
    if block_size > 128 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two from 1 to 128 for the Triton kernel, "
                         f"got {block_size}")
    from pagedlib.kernels.triton_decode import MAX_HEAD_DIM  # imports triton: only when asked for

    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be at most {MAX_HEAD_DIM} for the Triton kernel, "
                         f"the model has {head_dim}")


def check_generate(engine: Any, prompts: object, max_new_tokens: object) -> int:
    """``max_new_tokens`` as an int, once ``prompts`` is a sequence and ``engine`` has no request pending."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, minimum=1)
    if engine.scheduler.has_unfinished:
        raise ValueError("the engine still has unfinished requests (from add_request): step() them to "
                         "completion first")
    return max_new_tokens


def check_host(config: Any) -> None:
    """An ``EngineConfig``'s host tier settings: a policy and a write mode the tier has, swapping only into
    a tier (the connector it builds checks the rest against the cache)."""
    from pagedlib.kv_transfer.connectors import WRITES
    from pagedlib.kv_transfer.policies import POLICIES

    if config.host_policy not in POLICIES:
        raise ValueError(f"host_policy must be one of {tuple(POLICIES)}, got {config.host_policy!r}")
    if config.host_write not in WRITES:
        raise ValueError(f"host_write must be one of {WRITES}, got {config.host_write!r}")
    if config.preemption not in ("recompute", "swap"):
        raise ValueError(f"preemption must be 'recompute' or 'swap', got {config.preemption!r}")
    if config.preemption == "swap" and not config.host_blocks:
        raise ValueError("preemption='swap' needs a host tier to swap into: set host_blocks")


def check_token_budget(budget: object, threshold: object) -> tuple[int | None, int | None]:
    """``(max_num_batched_tokens, long_prefill_token_threshold)`` as ints (``None``: whole prompts)."""
    if budget is None and threshold is not None:
        raise ValueError("long_prefill_token_threshold needs max_num_batched_tokens (a token budget)")
    if budget is not None:
        budget = as_int("max_num_batched_tokens", budget, minimum=1)
    if threshold is not None:
        threshold = as_int("long_prefill_token_threshold", threshold, minimum=1)
    return budget, threshold


def check_prompt(engine: Any, name: str, prompt: Any, max_new_tokens: object) -> tuple[list[int], int]:
    """``prompt`` as token ids (refused if empty) and ``max_new_tokens`` as an int."""
    tokens = token_list(name, prompt, engine.model.shape.vocab_size)
    if not tokens:
        raise ValueError(f"{name} is empty: a prompt needs at least one token")
    return tokens, as_int("max_new_tokens", max_new_tokens, minimum=1)


def check_fits(engine: Any, name: str, request: Any) -> None:
    """Refuse ``request`` if ``engine``'s pool could never hold its K/V at their peak (``Request.max_kv_len``:
    the prompt and every new token but the last), running alone (the watermark holds only while another
    request runs): ``Scheduler.blocks_alone``, every KV-cache group's blocks together."""
    num_blocks = engine.cache.num_blocks
    need = engine.scheduler.blocks_alone(request)
    if need > num_blocks:
        groups = len(engine.cache.groups)
        tables = f" in {groups} KV-cache groups' tables" if groups > 1 else ""
        raise ValueError(f"{name} ({request.prompt_len} tokens) with max_new_tokens={request.output_len} "
                         f"needs {request.max_kv_len} token slots (the prompt and every new "
                         f"token but the last), {need} blocks of {engine.cache.block_size}{tables}, more "
                         f"than the pool of {num_blocks} blocks can ever hold")


def check_idle(engine: Any) -> None:
    """Refuse a call to ``engine`` from a second thread (``engine._generating``: the thread inside
    ``generate``), or from inside a step (``engine._in_step``): a cheap check, not a lock."""
    if engine._generating not in (None, threading.get_ident()):
        raise RuntimeError("another thread is inside this engine's generate(): an Engine "
                           "is single-threaded (give each thread its own engine, or "
                           "serialise the calls)")
    if engine._in_step:
        raise RuntimeError("the engine is inside step() (a call from within the step, or from another "
                           "thread): an Engine is single-threaded; call it again once step() returns")


def check_instance(name: str, value: object, cls: type, hint: str) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a ``cls`` (``hint``: what to pass instead)."""
    if not isinstance(value, cls):
        raise ValueError(f"{name} must be a {cls.__name__} ({hint}), got {type(value).__name__}")


def check_engine_model(model: Any, config: Any, connector: object = None) -> None:
    """What an ``Engine`` asks of its model: a dtype the engine runs, a ``head_dim`` (and a device) its
    attention takes; no host tier or connector over a cache of KV-cache groups (they serve one
    full-attention group)."""
    check_model_dtype(model.dtype)
    check_attention(config.attention, config.block_size, model.shape.head_dim, model.device)
    groups = model.shape.kv_groups
    if config.hybrid_kv_cache and (len(groups) > 1 or groups[0].window is not None):
        for argument, given in (("host_blocks", config.host_blocks), ("connector", connector is not None)):
            if given:
                raise ValueError(f"{argument}= with a model whose layers form KV-cache groups "
                                 f"({'; '.join(map(str, groups))}): a host tier or connector serves one "
                                 f"full-attention group only; hybrid_kv_cache=False keeps one table for "
                                 f"every layer")


def check_known_request(requests: dict, req_id: object) -> Any:
    """The request ``Engine.output`` reads: ``KeyError`` for an id the engine never gave (or forgot)."""
    try:
        return requests[req_id]
    except (KeyError, TypeError):  # TypeError: an unhashable id
        raise KeyError(f"req_id {req_id!r} is not a request of this engine (add_request returns the id; "
                       f"reset() forgets every request)") from None


def check_calibration(x: object, dtype: object, per_kv_head: object) -> None:
    """``kv_scale``'s arguments: a non-empty floating tensor ``[..., kv_heads, head_dim]``, an fp8 format."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2 or x.numel() == 0:
        got = type(x).__name__
        if isinstance(x, torch.Tensor):
            got = f"{x.dtype} {list(x.shape)}"
        raise ValueError(f"x must be a non-empty floating tensor [..., kv_heads, head_dim], got {got}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    if not isinstance(per_kv_head, bool):
        raise ValueError(f"per_kv_head must be a bool, got {per_kv_head!r}")
