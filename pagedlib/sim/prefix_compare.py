"""The two prefix caches side by side (notebook 11): the same requests through the same scheduler and pool,
once with vLLM's chained block hashes and once with SGLang's radix tree."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.prefix_cache import PrefixCache, chained_keys
from pagedlib.core.request import Request
from pagedlib.sim import workloads as wl
from pagedlib.sim.simulate import new_scheduler, serve

DESIGNS = ("hash", "radix")

#: name -> seed -> requests: the five workloads of notebook 11, small enough for a laptop
WORKLOADS: dict[str, Callable[[int], list[Request]]] = {
    "system prompt": lambda seed: wl.shared_prompt_like(60, seed, system_len=341, num_system_prompts=2),
    "multi-turn chat": lambda seed: wl.multi_turn_like(12, 5, seed),
    "few-shot": lambda seed: wl.few_shot_like(60, seed),
    "tree of thought": lambda seed: wl.branching_like(8, 6, seed),
    "unique documents": lambda seed: wl.unique_documents_like(20, seed),
}


def run_design(requests: Sequence[Request], design: str, budget_blocks: int, block_size: int,
               max_num_seqs: int = 32) -> tuple[dict, PagedKVCache]:
    """Serve ``requests`` with prefix cache ``design`` (``"hash"`` or ``"radix"``) in ``budget_blocks``
    blocks of ``block_size`` tokens. Returns the row of the side-by-side table and the cache afterwards."""
    sched = new_scheduler(requests, "paged", budget_blocks, block_size, max_num_seqs=max_num_seqs,
                          enable_prefix_caching=True, prefix_cache=design)
    result = serve(sched, list(requests))
    stats = sched.cache.prefix_cache_stats()
    held = budget_blocks - int(result.series["free"].min()) // block_size  # blocks running requests held
    return {"design": design, "block_size": block_size, "hit_rate": round(stats["hit_rate"], 3),
            "prefill_tokens": result.prefill_tokens, "peak_blocks": held, "evicted": stats["evicted_blocks"],
            "mean_running": round(result.mean_running, 1), "preemptions": result.preemptions}, sched.cache


def side_by_side(block_sizes: Sequence[int] = (1, 16, 64), budget_tokens: int = 8192, seed: int = 0,
                 workloads: Sequence[str] | None = None) -> list[dict]:
    """One row per workload, block size and design, each pool holding ``budget_tokens`` tokens."""
    rows = []
    for name in workloads or WORKLOADS:
        requests = WORKLOADS[name](seed)
        for bs in block_sizes:
            rows += [{"workload": name, **run_design(requests, d, budget_tokens // bs, bs)[0]}
                     for d in DESIGNS]
    return rows


def lookup_cost_us(cache: PagedKVCache, requests: Sequence[Request], repeat: int = 3) -> float:
    """Microseconds one prefix lookup of a request's prompt takes in ``cache``'s prefix cache (the best of
    ``repeat`` passes over every request, averaged per request). The hash cache is given the prompt's block
    keys, made beforehand as a scheduler's request makes them, once (``key_cost_us`` times that). A
    timing: never assert it."""
    prompts = [list(r.prompt_tokens or ()) for r in requests]
    keys: list = [None] * len(prompts)
    if isinstance(cache.prefix_cache, PrefixCache):
        keys = [_prompt_keys(p, cache.block_size) for p in prompts]
    return _best_us(lambda: [cache.prefix_cache.peek(p, k) for p, k in zip(prompts, keys)],  # type: ignore
                    repeat) / max(1, len(prompts))


def key_cost_us(requests: Sequence[Request], block_size: int, repeat: int = 3) -> float:
    """Microseconds to make the block keys a lookup of a request's prompt walks (a SHA-256 digest per full
    block), as a hash cache's request does once; averaged per request, the best of ``repeat`` passes. A
    timing."""
    prompts = [list(r.prompt_tokens or ()) for r in requests]
    return _best_us(lambda: [_prompt_keys(p, block_size) for p in prompts], repeat) / max(1, len(prompts))


def _prompt_keys(prompt: list[int], block_size: int) -> list:
    """The keys a lookup of ``prompt`` may walk: its full blocks before its last token's."""
    return list(chained_keys(prompt, block_size, (len(prompt) - 1) // block_size))


def _best_us(work: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best * 1e6
