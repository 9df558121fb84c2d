"""Argument checks of the serving simulation and its workloads: each error names the argument given."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Iterable

import numpy as np

from pagedlib.core.cache import UnknownSequenceError
from pagedlib.core.request import Request
from pagedlib.sim.budgets import POLICIES
from pagedlib.util import as_int, refuse

MAX_REQUESTS = 10**6       # a workload's length (one Request object each)
MAX_MODEL_LEN = 2**40      # lengths stay far inside int64
MAX_ARRIVAL = 2**53        # arrival steps stay exact in float64
MAX_SLOTS = 2**31 - 1      # slot addresses of the budget fit int32 (the pool pictures, the cache's tables)


def check_simulate(requests: Iterable[Request], policy: object, kv_budget_blocks: object, block_size: object,
                   max_num_seqs: object, enable_prefix_caching: object, sliding_window: object = None,
                   max_num_batched_tokens: object = None) -> tuple[list, int, int, int]:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
    if sliding_window is not None and policy != "paged":
        raise ValueError("sliding_window needs the paged policy (a slab cannot give back its front)")
    if max_num_batched_tokens is not None and (policy != "paged" or sliding_window is not None):
        raise ValueError("chunked prefill (max_num_batched_tokens) needs the 'paged' policy and no "
                         "sliding_window")
    requests = list(requests)
    bad = [type(r).__name__ for r in requests if not isinstance(r, Request)]
    if bad:
        raise ValueError(f"requests must hold Request objects, got {bad[0]}")
    if len({r.req_id for r in requests}) != len(requests):
        raise ValueError("requests must have distinct req_id values")
    budget = as_int("kv_budget_blocks", kv_budget_blocks, minimum=1)
    block_size = as_int("block_size", block_size, minimum=1)
    max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
    if budget * block_size > MAX_SLOTS:
        raise ValueError(f"kv_budget_blocks * block_size must be <= 2**31 - 1, got {budget * block_size}")
    missing = [r.req_id for r in requests if r.prompt_tokens is None]
    if enable_prefix_caching and missing:
        raise ValueError(f"enable_prefix_caching needs requests with prompt_tokens; requests {missing[:8]} "
                         "have none (shared_prompt_like makes some)")
    return requests, budget, block_size, max_num_seqs


def check_length_model(model: object) -> None:
    for name in ("prompt_mean", "prompt_sigma", "output_mean", "output_sigma"):
        value = getattr(model, name)
        low = 0 if name.endswith("sigma") else 1
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not low <= value < math.inf:
            raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")


def check_workload(num_requests: object, seed: object, rate: object, max_model_len: object) -> tuple:
    n = as_int("num_requests", num_requests, minimum=0, maximum=MAX_REQUESTS)
    seed = as_int("seed", seed, minimum=0)
    max_model_len = as_int("max_model_len", max_model_len, minimum=2, maximum=MAX_MODEL_LEN)
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not rate > 0:
        raise ValueError(f"rate must be a positive number of requests per step (or math.inf), got {rate!r}")
    return n, seed, float(rate), max_model_len


def check_arrivals(arrivals: np.ndarray, rate: float) -> None:
    if len(arrivals) and not arrivals[-1] < MAX_ARRIVAL:
        raise ValueError(f"rate = {rate!r} is too small: the arrivals run past step 2**53")


def check_shared(num_requests: object, system_len: object, num_system_prompts: object, vocab_size: object,
                 token_base: int) -> tuple[int, int, int]:
    system_len = as_int("system_len", system_len, minimum=1, maximum=2046)  # a user turn and an output left
    n = as_int("num_requests", num_requests, minimum=0, maximum=MAX_REQUESTS)
    k = as_int("num_system_prompts", num_system_prompts, minimum=1)
    if n and k > n:
        raise ValueError(f"num_system_prompts must be <= num_requests = {n} (each request uses one), got {k}")
    k = min(k, max(n, 1))  # with no request, no system prompt is drawn beyond one
    vocab_size = as_int("vocab_size", vocab_size, minimum=2, maximum=token_base)
    return system_len, k, vocab_size


def check_sizes(**sizes: object) -> tuple[int, ...]:
    """Each named size as an int >= 1 (``num_*`` counts, ``*_len`` lengths, ``vocab_size``), in order."""
    return tuple(as_int(name, value, minimum=1, maximum=MAX_REQUESTS if name.startswith("num") else
                        MAX_MODEL_LEN) for name, value in sizes.items())


def check_leading_blocks(cache, seq_id: Hashable, n: object) -> int:
    """``n`` as an int the blocks of ``seq_id`` allow: full blocks held by it alone, no prefix caching."""
    if seq_id not in cache.seq_lens:
        raise UnknownSequenceError(seq_id, cache.seq_lens)
    shared = [block for block in cache.tables[seq_id] if cache.ref_counts[block] > 1]
    refuse((cache.prefix_cache is not None, "release_leading_blocks needs a cache without prefix caching "
                                            "(enable_prefix_caching=False)"),
           (shared, f"release_leading_blocks needs blocks held by sequence {seq_id!r} alone; blocks {shared} "
                    f"are shared (fork)"))
    return as_int("n", n, minimum=0, maximum=cache.seq_lens[seq_id] // cache.block_size)
