"""``EngineConfig``: every setting of an ``Engine`` (nano-vllm's ``Config``, vLLM's ``SchedulerConfig`` and
``CacheConfig`` in one), checked when the engine is made: the sizes, scheduling and host tier settings here,
``attention`` against the model (``checks.check_engine_model``), the prefix cache's settings by the cache.
The defaults are vLLM 0.32.0's where it has the setting; ``vllm_bridge.config_of`` passes each one that
changes a decision to vLLM."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from pagedlib import checks
from pagedlib.util import as_int


@dataclass(frozen=True)
class EngineConfig:
    """An engine's pool, kernels and scheduling rules.

    Args:
        num_blocks, block_size: the KV pool.
        attention: ``"torch"`` (gather, then SDPA), ``"triton"`` (the fused GPU kernels: ``block_size`` a
            power of two up to 128) or ``"cpu"`` (the fused C kernel, built on first use); ``head_dim``
            at most 256.
        enable_prefix_caching: attach a prompt's cached full blocks instead of prefilling them (notebook 06).
        prefix_cache: ``"hash"`` (vLLM's block hashes) or ``"radix"`` (SGLang's tree, notebook 11).
        kv_cache_dtype: ``None`` (the model's dtype) or an fp8 format (notebook 10).
        max_num_seqs: most requests in the running batch.
        max_num_batched_tokens: ``None``: whole prompts; a number: the token budget of a step, with chunked
            prefill (notebook 09), a chunk at most ``long_prefill_token_threshold`` long while more than
            one request is running or waiting.
        watermark: the share of the blocks an admission leaves free while a request runs (vLLM's
            ``SchedulerConfig.watermark``, default 0.0; vLLM V0 kept 0.01, notebook 07).
        full_prompt_must_fit: admit a request only if blocks for its whole current length fit, not just
            its first chunk (vLLM's ``scheduler_reserve_full_isl``, on by default).
        host_blocks: the blocks of a host tier beside the pool (0: none; notebook 13).
        host_policy: how the host tier evicts: ``"lru"`` or ``"arc"`` (vLLM's CPU offloading policies).
        host_write: ``"through"`` (every full block stored once computed, vLLM's offloading connector),
            ``"victim"`` (stored when the prefix cache evicts it) or ``"none"`` (swapped blocks only).
        preemption: ``"recompute"`` (vLLM V1's only mode) or ``"swap"`` (the victim's blocks go to the host
            tier and come back; recomputed when the tier has no room).
        hybrid_kv_cache: a model with sliding-window layers keeps a block table per KV-cache group and gives
            back the blocks its windows have left (notebook 15); ``False``: one table for every layer, every
            block kept (vLLM's ``--disable-hybrid-kv-cache-manager``).
    """

    num_blocks: int
    block_size: int = 16
    attention: str = "torch"
    enable_prefix_caching: bool = False
    prefix_cache: str = "hash"
    kv_cache_dtype: torch.dtype | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    watermark: float = 0.0
    full_prompt_must_fit: bool = True
    host_blocks: int = 0
    host_policy: str = "lru"
    host_write: str = "through"
    preemption: str = "recompute"
    hybrid_kv_cache: bool = True

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        fix("num_blocks", as_int("num_blocks", self.num_blocks, minimum=1))
        fix("block_size", as_int("block_size", self.block_size, minimum=1))
        # the Scheduler checks these too, but only after the cache is allocated; watermark and the ints
        # are normalised here because the bridge sends them as JSON
        if not isinstance(self.hybrid_kv_cache, bool):
            raise ValueError(f"hybrid_kv_cache must be a bool, got {self.hybrid_kv_cache!r}")
        if not isinstance(self.full_prompt_must_fit, bool):
            raise ValueError(f"full_prompt_must_fit must be a bool, got {self.full_prompt_must_fit!r}")
        fix("max_num_seqs", as_int("max_num_seqs", self.max_num_seqs, minimum=1))
        budget, cap = checks.check_token_budget(self.max_num_batched_tokens,
                                                self.long_prefill_token_threshold)
        fix("max_num_batched_tokens", budget)
        fix("long_prefill_token_threshold", cap)
        mark = self.watermark
        if not isinstance(mark, numbers.Real) or isinstance(mark, bool) or not 0 <= mark < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {mark!r}")
        fix("watermark", float(mark))
        fix("host_blocks", as_int("host_blocks", self.host_blocks, minimum=0))
        checks.check_host(self)

    @property
    def capacity(self) -> int:
        """Tokens the pool holds."""
        return self.num_blocks * self.block_size

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt and new tokens) the engine takes: its K/V, all but the last token's,
        fill the pool at most. ``vllm_bridge`` gives vLLM the same limit."""
        return self.capacity + 1

    @property
    def watermark_blocks(self) -> int:
        """Blocks an admission leaves free while a request runs (vLLM: ``int(watermark * num_blocks)``)."""
        return int(self.watermark * self.num_blocks)
