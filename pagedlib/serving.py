"""Serving under a KV-memory budget (notebook 07): workloads, a step-level scheduler over a real
``PagedKVCache``, and the memory-waste breakdown of the vLLM paper (Kwon et al., SOSP 2023, Figure 2).

- ``Request`` and three seeded workloads: ``sharegpt_like`` (long prompts and outputs), ``alpaca_like``
  (short ones) and ``shared_prompt_like`` (one of a few system prompts in front of every prompt).
- ``FirstFit``: contiguous slabs in a pool of slots, the allocator of the reservation policies.
- ``Scheduler``: every ``step()`` decides which running requests decode, which are preempted, and which
  waiting ones are admitted (prefilled), under one of four policies over the same budget:

  ``paged``           blocks on demand from the cache's free stack, as vLLM does
  ``reserve-max``     a slab of ``max_model_len`` slots per request (the paper's Orca (Max))
  ``reserve-pow2``    prompt + output length rounded up to a power of two (Orca (Pow2))
  ``reserve-oracle``  exactly the slots the request will fill (Orca (Oracle))

- ``simulate``: drives a ``Scheduler`` through a workload, writing tiny fake K/V into the cache, and
  accounts for the memory every step -> ``SimResult``.
- ``python -m pagedlib.serving`` prints the policy comparison table (``--json FILE``).

A request's life, in steps: admitted -> one prefill (writes the K/V of its prompt and samples the first
output token) -> one decode per step (writes the K/V of the last sampled token, samples the next) ->
finished once ``output_len`` tokens are sampled. Its K/V peak at ``prompt_len + output_len - 1`` tokens:
the last sampled token is never fed back.
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedlib.cache import PagedKVCache
from pagedlib.checks import as_int, ceil_div
from pagedlib.window import release_outside_window

__all__ = [
    "ALPACA", "CATEGORIES", "POLICIES", "SHAREGPT", "FirstFit", "LengthModel", "Occupancy", "Request",
    "RequestResult",
    "PAPER_FIGURE13", "PAPER_FIGURE2", "Scheduler", "SimResult", "StepPlan", "alpaca_like", "cached_prefix",
    "fake_token_ids", "main", "sharegpt_like", "shared_prompt_like", "simulate", "synthetic_workload",
    "write_fake_kv",
]

POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")

#: Where every slot counted by ``simulate`` goes, the paper's Figure 2 categories: ``token`` holds a
#: token's K/V; ``reservation`` is set aside for a token the request will still write; ``internal`` is set
#: aside but will never be written; ``external`` is free while a request waits although enough slots are
#: free in total (no hole is large enough); ``other`` is free while a request waits and too little in
#: total (or held back by the paged policy's watermark).
CATEGORIES = ("token", "reservation", "internal", "external", "other")


#: The vLLM paper's Figure 2 (Kwon et al., SOSP 2023), "average percentage of memory wastes ... during
#: the experiment in §6.2", as printed on its bars. Its last category is "External frag. & Others"; Orca
#: (Oracle) has no internal-fragmentation segment, and vLLM's bar only names its token states.
PAPER_FIGURE2 = {
    "reserve-max": {"token": 0.204, "reservation": 0.133, "internal": 0.573, "external": 0.089},
    "reserve-pow2": {"token": 0.268, "reservation": 0.179, "internal": 0.136, "external": 0.416},
    "reserve-oracle": {"token": 0.382, "reservation": 0.252, "external": 0.366},
    "paged": {"token": 0.963},
}

#: The paper's Figure 13a: average number of batched requests serving OPT-13B on the ShareGPT trace at
#: 2 requests/s (vLLM "2.2x more requests at the same time than Orca (Oracle) and 4.3x more than Orca (Max)").
PAPER_FIGURE13 = {"reserve-max": 7.00, "reserve-pow2": 9.81, "reserve-oracle": 13.62, "paged": 30.42}


def check_policy(policy: object) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return str(policy)


# ------------------------------------------------------------------------------------------------------
# requests and workloads


@dataclass(frozen=True)
class Request:
    """One request: it arrives at step ``arrival`` with ``prompt_len`` tokens and generates
    ``output_len`` tokens (at least 1). ``prompt_tokens``, when given, are its token ids (prefix
    caching needs them)."""

    req_id: int
    arrival: int
    prompt_len: int
    output_len: int
    prompt_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("req_id", 0), ("arrival", 0), ("prompt_len", 1), ("output_len", 1)):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum=minimum))
        if self.prompt_tokens is not None:
            tokens = tuple(as_int("prompt_tokens[i]", t, minimum=0) for t in self.prompt_tokens)
            if len(tokens) != self.prompt_len:
                raise ValueError(f"prompt_tokens must hold prompt_len = {self.prompt_len} ids, "
                                 f"got {len(tokens)}")
            object.__setattr__(self, "prompt_tokens", tokens)

    @property
    def max_kv_len(self) -> int:
        """Slots the request ever fills: its prompt and every output token but the last."""
        return self.prompt_len + self.output_len - 1


@dataclass(frozen=True)
class LengthModel:
    """Log-normal prompt and output lengths (tokens): ``*_mean`` is the mean before rounding and clipping
    to the model's context, ``*_sigma`` the spread of the logarithm."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float


# The paper's datasets (its Figure 11): ShareGPT prompts and outputs average 161.31 and 337.99 tokens,
# Alpaca's 19.31 and 58.45. Log-normal: positive, right-skewed, long-tailed, the shape of its histograms.
# The sigmas are our choice (the paper gives means only); ShareGPT's pre-clipping means are set so that,
# once prompt + output is clipped to 2,048 tokens, the means come out at the paper's (within sampling noise).
SHAREGPT = LengthModel(prompt_mean=162, prompt_sigma=1.0, output_mean=353, output_sigma=1.0)
ALPACA = LengthModel(prompt_mean=19.31, prompt_sigma=0.6, output_mean=58.45, output_sigma=0.8)


def _check_rate(rate: object) -> float:
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not rate > 0:
        raise ValueError(f"rate must be a positive number of requests per step (or math.inf), got {rate!r}")
    return float(rate)


def _lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, high: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma^2))] = mean
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, high).astype(np.int64)


def synthetic_workload(num_requests: int, model: LengthModel, *, seed: int = 0, rate: float = 1.0,
                       max_model_len: int = 2048) -> list[Request]:
    """``num_requests`` requests with lengths drawn from ``model`` (``prompt + output <= max_model_len``)
    and Poisson arrivals, ``rate`` requests per step on average (``math.inf``: all at step 0)."""
    n = as_int("num_requests", num_requests, minimum=0)
    max_model_len = as_int("max_model_len", max_model_len, minimum=2)
    rate = _check_rate(rate)
    rng = np.random.default_rng(as_int("seed", seed, minimum=0))
    prompts = _lengths(rng, n, model.prompt_mean, model.prompt_sigma, max_model_len - 1)
    outputs = _lengths(rng, n, model.output_mean, model.output_sigma, max_model_len)
    outputs = np.minimum(outputs, max_model_len - prompts)
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1 / rate, n)
    arrivals = np.floor(np.cumsum(gaps)).astype(np.int64)
    return [Request(i, int(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def sharegpt_like(num_requests: int, seed: int = 0, *, rate: float = 1.0,
                  max_model_len: int = 2048) -> list[Request]:
    """Conversations: long prompts (mean ~161 tokens) and long outputs (mean ~338), as ShareGPT."""
    return synthetic_workload(num_requests, SHAREGPT, seed=seed, rate=rate, max_model_len=max_model_len)


def alpaca_like(num_requests: int, seed: int = 0, *, rate: float = 1.0,
                max_model_len: int = 2048) -> list[Request]:
    """Instructions: short prompts (mean ~19 tokens) and short outputs (mean ~58), as Alpaca."""
    return synthetic_workload(num_requests, ALPACA, seed=seed, rate=rate, max_model_len=max_model_len)


def shared_prompt_like(num_requests: int, seed: int = 0, *, system_len: int = 341,
                       num_system_prompts: int = 2, rate: float = 1.0,
                       vocab_size: int = 32000) -> list[Request]:
    """Alpaca-like user turns, each behind one of ``num_system_prompts`` system prompts of ``system_len``
    tokens (the workload prefix caching is for; 341 is the paper's 5-shot translation prefix, §6.4).
    Requests carry their token ids: the system prompt's, then random ones for the user turn."""
    system_len = as_int("system_len", system_len, minimum=1)
    k = as_int("num_system_prompts", num_system_prompts, minimum=1)
    vocab_size = as_int("vocab_size", vocab_size, minimum=2)
    base = alpaca_like(num_requests, seed, rate=rate, max_model_len=2048 - system_len)
    rng = np.random.default_rng([as_int("seed", seed, minimum=0), 1])
    systems = [tuple(int(t) for t in rng.integers(0, vocab_size, system_len)) for _ in range(k)]
    out = []
    for r in base:
        user = tuple(int(t) for t in rng.integers(0, vocab_size, r.prompt_len))
        tokens = systems[int(rng.integers(k))] + user
        out.append(Request(r.req_id, r.arrival, len(tokens), r.output_len, tokens))
    return out


#: Made-up token ids of simulated outputs start here, above any vocabulary a workload draws prompts from.
OUTPUT_TOKEN_BASE = 1 << 40


def fake_token_ids(request: Request, stop: int, start: int = 0) -> list[int]:
    """Token ids of positions ``start .. stop-1`` of a simulated request: its prompt's
    (``prompt_tokens``), then made-up ids for its outputs, distinct per request and position and the same
    on every call, so a preempted request finds its own blocks again when it is readmitted."""
    if request.prompt_tokens is None:
        raise ValueError(f"request {request.req_id} has no prompt_tokens (prefix caching needs them)")
    p, base = request.prompt_len, OUTPUT_TOKEN_BASE * (request.req_id + 1)
    return list(request.prompt_tokens[start:stop]) + [base + i for i in range(max(start, p) - p, stop - p)]


# ------------------------------------------------------------------------------------------------------
# contiguous reservations


class FirstFit:
    """Contiguous slabs in a pool of ``capacity`` slots; each goes to the lowest address where it fits.

    This is how a server that gives every request one contiguous KV buffer uses its memory: freed slabs
    leave holes between live ones, and a request can be refused while enough slots are free in total
    (external fragmentation).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = as_int("capacity", capacity, minimum=1)
        self.slabs: dict[Hashable, tuple[int, int]] = {}  # key -> (start, size)

    def holes(self) -> list[tuple[int, int]]:
        """The free runs ``(start, size)``, in address order."""
        holes, cursor = [], 0
        for start, size in sorted(self.slabs.values()):
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + size
        if cursor < self.capacity:
            holes.append((cursor, self.capacity - cursor))
        return holes

    def allocate(self, key: Hashable, size: int) -> int | None:
        """Place a slab of ``size`` slots in the first hole that holds it: its start, or ``None``."""
        size = as_int("size", size, minimum=1)
        if key in self.slabs:
            raise ValueError(f"{key!r} already holds a slab")
        for start, room in self.holes():
            if room >= size:
                self.slabs[key] = (start, size)
                return start
        return None

    def free(self, key: Hashable) -> None:
        del self.slabs[key]

    @property
    def used_slots(self) -> int:
        return sum(size for _, size in self.slabs.values())

    @property
    def free_slots(self) -> int:
        return self.capacity - self.used_slots


# ------------------------------------------------------------------------------------------------------
# the scheduler


@dataclass
class StepPlan:
    """What one step runs. The runner writes ``tokens`` K/V for each ``prefill`` entry (the prompt, or
    prompt + generated tokens when a preempted request is recomputed; with prefix caching only those after
    the ``cache.seq_lens[req_id]`` tokens found in the cache) and one for each ``decode`` request;
    every scheduled request samples one token. ``preempted`` requests lost their memory this step and wait
    at the front of the queue; ``blocked`` says a waiting request was refused for lack of memory."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocked: bool = False

    @property
    def scheduled(self) -> list[Request]:
        return self.decode + [r for r, _ in self.prefill]


def cached_prefix(cache: PagedKVCache, token_ids: Sequence[int]) -> list[int]:
    """The blocks ``cache.add_sequence(seq_id, token_ids)`` would attach, found without attaching them
    or counting a lookup in the cache's statistics: the admission check asks before it commits.

    ``PrefixCache.peek``: the longest run of full leading blocks (at most ``len(token_ids) - 1`` tokens)
    whose keys, parent key + token ids, are registered."""
    return [] if cache.prefix_cache is None else cache.prefix_cache.peek(token_ids)


class Scheduler:
    """Continuous batching over a ``PagedKVCache``: requests join and leave the batch every step.

    Each ``step()``: (1) with a sliding window, running requests give back the blocks their newest token
    can no longer see; (2) every running request gets one decode slot; under ``"paged"``, if the free
    blocks cannot cover the requests whose last block is full, the most recently admitted request is
    preempted (its blocks freed, itself back at the front of the queue, to be recomputed) until they can;
    (3) unless something was preempted, waiting requests are admitted in arrival order while
    ``max_num_seqs`` and memory allow: under ``"paged"`` the prompt's blocks must leave ``watermark`` of
    the budget free, under a reservation policy a contiguous slab must fit (``FirstFit``).

    Prefix caching (a ``cache`` built with ``enable_prefix_caching=True``, ``"paged"`` only, no sliding
    window): at admission the request's tokens (``token_ids(request, n)``: its first ``n`` token ids, the
    prompt and, after a preemption, the tokens it generated) are looked up, the blocks found are attached,
    and only the rest is prefilled. The memory check counts only the blocks the request really needs:
    new blocks for the uncached tokens, plus the found blocks that sit free in the cache's queue (taking
    them removes them from the free count), as vLLM's ``KVCacheManager.allocate_slots`` does.

    The runner executes the plan (writes K/V through ``cache``), then calls ``finish`` for requests that
    are done. Under ``"paged"`` the budget is the cache itself; under a reservation policy it is
    ``kv_budget_blocks * block_size`` slots of slabs, and the cache only stores the tokens (it needs
    ``max_num_seqs`` blocks more than the budget: a slab's tokens can straddle one extra block).
    """

    def __init__(self, cache: PagedKVCache, *, policy: str = "paged", max_num_seqs: int = 256,
                 watermark: float = 0.01, max_model_len: int = 2048, kv_budget_blocks: int | None = None,
                 sliding_window: int | None = None,
                 token_ids: Callable[[Request, int], Sequence[int]] | None = None) -> None:
        self.policy = check_policy(policy)
        if not isinstance(cache, PagedKVCache):
            raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if cache.seq_lens:
            raise ValueError(f"cache must be empty: it holds sequences {list(cache.seq_lens)[:8]}")
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
        self.max_model_len = as_int("max_model_len", max_model_len, minimum=2)
        self.kv_budget_blocks = self._check_budget(kv_budget_blocks)
        if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.watermark_blocks = int(float(watermark) * self.kv_budget_blocks) if policy == "paged" else 0
        if sliding_window is not None:
            sliding_window = as_int("sliding_window", sliding_window, minimum=1)
            if policy != "paged":
                raise ValueError("sliding_window needs the paged policy (a slab cannot give back its front)")
        self.sliding_window = sliding_window
        self.token_ids = self._check_prefix_caching(token_ids)
        self.slabs = None if policy == "paged" else FirstFit(self.kv_budget_blocks * self.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []                 # in admission order: preempt from the end
        self.generated: dict[int, int] = {}              # req_id -> tokens sampled so far
        self.window_start: dict[int, int] = {}           # req_id -> position of the cache's first token
        self.num_preemptions = 0
        self.recomputed_tokens = 0                       # K/V lost to preemptions, less those found again
        self.prefill_tokens = 0                          # K/V computed by prefills (recomputes included)
        self.cached_tokens = 0                           # tokens found in the prefix cache at admission

    def _check_prefix_caching(self, token_ids: object) -> Callable[[Request, int], Sequence[int]] | None:
        if self.cache.prefix_cache is None:
            return None
        if self.policy != "paged":
            raise ValueError("prefix caching needs the 'paged' policy (a contiguous slab is never shared)")
        if self.sliding_window is not None:
            raise ValueError("sliding_window cannot be combined with prefix caching (a cached block's key "
                             "names the block before it, which the window would free)")
        if not callable(token_ids):
            raise ValueError("a cache with prefix caching needs token_ids(request, n) -> the request's "
                             f"first n token ids, got {token_ids!r}")
        return token_ids  # type: ignore[return-value]

    def _check_budget(self, kv_budget_blocks: int | None) -> int:
        n = self.cache.num_blocks
        if kv_budget_blocks is None:
            kv_budget_blocks = n if self.policy == "paged" else n - self.max_num_seqs
        budget = as_int("kv_budget_blocks", kv_budget_blocks, minimum=1)
        if self.policy == "paged" and budget != n:
            raise ValueError(f"under 'paged' the budget is the cache: kv_budget_blocks must be {n}, "
                             f"got {budget}")
        if self.policy != "paged" and n < budget + self.max_num_seqs:
            raise ValueError(f"the cache stores a reservation policy's tokens and needs kv_budget_blocks + "
                             f"max_num_seqs = {budget + self.max_num_seqs} blocks, it has {n}")
        return budget

    def reservation(self, request: Request) -> int:
        """Slots a reservation policy sets aside for ``request`` when admitting it (under ``"paged"``: the
        slots the request fills by its last step, for comparison)."""
        if self.policy == "reserve-max":
            return self.max_model_len
        if self.policy == "reserve-pow2":  # "if the true output length is 25, it reserves 32"
            return min(self.max_model_len, request.prompt_len + 2 ** (request.output_len - 1).bit_length())
        return request.max_kv_len

    def check(self, request: Request) -> None:
        """``ValueError`` unless ``request`` is new, fits the model and, alone, the budget."""
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if request.req_id in self.generated:
            raise ValueError(f"request id {request.req_id} is already queued or running")
        if request.prompt_len + request.output_len > self.max_model_len:
            raise ValueError(f"request {request.req_id}: prompt_len + output_len = {request.prompt_len} + "
                             f"{request.output_len} > max_model_len = {self.max_model_len}")
        need = ceil_div(request.max_kv_len, self.block_size) + self.watermark_blocks
        if self.slabs is not None:
            need = ceil_div(self.reservation(request), self.block_size)
        if need > self.kv_budget_blocks:
            raise ValueError(f"request {request.req_id} needs {need} blocks, more than the budget of "
                             f"{self.kv_budget_blocks}: it could never run")

    def add(self, request: Request) -> None:
        """Queue a request (checked by ``check``)."""
        self.check(request)
        self.waiting.append(request)
        self.generated[request.req_id] = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepPlan:
        """Plan one step (and count the token each scheduled request will sample)."""
        done = [r.req_id for r in self.running if self.generated[r.req_id] >= r.output_len]
        if done:
            raise RuntimeError(f"requests {done} have all their tokens: call finish() for them first")
        plan = StepPlan()
        self._slide_windows()
        self._preempt_for_decode(plan)
        plan.decode = list(self.running)
        if plan.preempted:
            plan.blocked = bool(self.waiting)
        else:
            self._admit(plan)
        for r in plan.scheduled:
            self.generated[r.req_id] += 1
        return plan

    def finish(self, request: Request) -> None:
        """Retire a running request and give its memory back."""
        if request not in self.running:
            raise ValueError(f"request {getattr(request, 'req_id', request)!r} is not running")
        self.running.remove(request)
        self.cache.free_sequence(request.req_id)
        if self.slabs is not None:
            self.slabs.free(request.req_id)
        self.window_start.pop(request.req_id, None)
        del self.generated[request.req_id]

    def _slide_windows(self) -> None:
        if self.sliding_window is not None:
            for r in self.running:
                released = release_outside_window(self.cache, r.req_id, self.sliding_window)
                self.window_start[r.req_id] += released

    def _blocks_for_decode(self, requests: Iterable[Request]) -> int:
        """Blocks a decode step takes: one per request whose last block is full."""
        if self.slabs is not None:
            return 0  # the slab already covers every token the request will write
        lens, bs = self.cache.seq_lens, self.block_size
        return sum(1 for r in requests if lens[r.req_id] % bs == 0)

    def _preempt_for_decode(self, plan: StepPlan) -> None:
        needed = self._blocks_for_decode(self.running)
        while needed > self.cache.num_free_blocks:
            victim = self.running.pop()  # the most recently admitted
            needed -= self._blocks_for_decode([victim])
            lost = self.window_start.pop(victim.req_id) + self.cache.seq_lens[victim.req_id]
            self.recomputed_tokens += lost
            self.cache.free_sequence(victim.req_id)
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            plan.preempted.append(victim)

    def _admit(self, plan: StepPlan) -> None:
        pending = self._blocks_for_decode(self.running)  # blocks this step's decode will take
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            tokens = request.prompt_len + self.generated[request.req_id]  # > prompt_len after a preemption
            ids = self.token_ids(request, tokens) if self.token_ids else None
            if self.slabs is None:
                found = cached_prefix(self.cache, ids) if ids is not None else []
                new = ceil_div(tokens, self.block_size) - len(found)
                revived = sum(self.cache.ref_counts[b] == 0 for b in found)  # leave the free queue
                if self.cache.num_free_blocks - pending - new - revived < self.watermark_blocks:
                    plan.blocked = True
                    return
                pending += new
            elif self.slabs.allocate(request.req_id, self.reservation(request)) is None:
                plan.blocked = True
                return
            self.waiting.popleft()
            self.running.append(request)
            cached = self._add_sequence(request, ids)
            self.window_start[request.req_id] = 0
            plan.prefill.append((request, tokens - cached))

    def _add_sequence(self, request: Request, ids: Sequence[int] | None) -> int:
        """Register an admitted request in the cache (attaching its cached blocks); tokens found."""
        cached = self.cache.add_sequence(request.req_id, ids)
        self.cached_tokens += cached
        self.prefill_tokens += request.prompt_len + self.generated[request.req_id] - cached
        if self.generated[request.req_id]:  # readmitted: what was found need not be recomputed
            self.recomputed_tokens -= cached
        return cached

    # accounting -----------------------------------------------------------------------------------------

    def held_slots(self, request: Request) -> int:
        """Slots set aside for a running request: its blocks (paged) or its slab."""
        if self.slabs is None:
            return len(self.cache.tables[request.req_id]) * self.block_size
        return self.slabs.slabs[request.req_id][1]

    def free_slots(self) -> int:
        if self.slabs is None:
            return self.cache.num_free_blocks * self.block_size
        return self.slabs.free_slots

    def slot_breakdown(self, blocked: bool) -> dict[str, int]:
        """Every slot of the budget that is in use or stranded, by ``CATEGORIES`` (after a step's writes).

        Free slots count only while a request waits for memory (``blocked``): as ``external`` if a slab
        of its size would fit in the free slots were they contiguous, else as ``other``. A block shared by
        several requests (a prefix-cache hit: always full) counts once, for the first holder.
        """
        out, seen = dict.fromkeys(CATEGORIES, 0), set()
        for r in self.running:
            held = self.cache.seq_lens[r.req_id]
            first = self.window_start[r.req_id]                   # position of the first slot held
            future = max(0, min(first + self.held_slots(r), r.max_kv_len) - (first + held))
            table = self.cache.tables[r.req_id] if self.slabs is None else []
            counted = self.block_size * sum(b in seen for b in table)  # full blocks counted already
            seen.update(table)
            out["token"] += held - counted
            out["reservation"] += future
            out["internal"] += self.held_slots(r) - held - future
        if blocked:
            free = self.free_slots()
            fits = self.slabs is not None and self.waiting and free >= self.reservation(self.waiting[0])
            out["external" if fits else "other"] += free
        return out


# ------------------------------------------------------------------------------------------------------
# the simulation


class RequestResult(NamedTuple):
    """How one request went: steps are simulation steps."""

    req_id: int
    arrival: int
    first_scheduled: int
    finished: int
    generated: int
    final_kv_len: int  # K/V positions written by its last step (sliding-window releases included)
    preemptions: int


@dataclass
class Occupancy:
    """The pool at every recorded step: ``owner[t, slot]`` is the request holding the slot (-1: free) and
    ``filled[t, slot]`` whether it holds a token. Slots are ``block * block_size + offset`` (paged) or slab
    addresses (reservation policies), ``kv_budget_blocks * block_size`` of them."""

    steps: np.ndarray     # [T] step numbers
    owner: np.ndarray     # [T, slots] int32
    filled: np.ndarray    # [T, slots] bool


@dataclass
class SimResult:
    """What ``simulate`` measured. Fractions are of the memory in use or stranded (``CATEGORIES``),
    summed over steps (slot-steps), so a step that holds more memory weighs more."""

    policy: str
    block_size: int
    kv_budget_blocks: int
    num_requests: int
    steps: int                            # steps simulated (idle stretches before an arrival are skipped)
    kv_utilization: float                 # token / all categories
    breakdown: dict[str, float]           # CATEGORIES -> fraction, summing to 1
    mean_running: float
    peak_running: int
    preemptions: int
    recomputed_tokens: int
    tokens_generated: int
    mean_latency: float                   # steps from arrival to the last token, averaged
    leaked_blocks: int
    prefix_cache_hit_rate: float | None   # tokens found / tokens looked up at admission; None: caching off
    series: dict[str, np.ndarray]         # per step: step, running, waiting, CATEGORIES, free (slots)
    requests: list[RequestResult]
    occupancy: Occupancy | None = None
    prefill_tokens: int = 0               # K/V computed by prefills (recomputes included, cache hits not)
    cached_tokens: int = 0                # tokens found in the prefix cache at admission (not computed)

    @property
    def saturated_running(self) -> float:
        """Mean running requests over the steps at which a request was left waiting: how many requests
        the budget holds at once when demand exceeds it (0.0 if nothing ever waited)."""
        busy = self.series["waiting"] > 0
        return float(self.series["running"][busy].mean()) if busy.any() else 0.0

    def row(self) -> dict[str, Any]:
        """The scalar results, rounded for a table or JSON."""
        row: dict[str, Any] = {"policy": self.policy, "block_size": self.block_size,
                               "budget_blocks": self.kv_budget_blocks,
                               "kv_util": round(self.kv_utilization, 4)}
        row.update({k: round(v, 4) for k, v in self.breakdown.items()})
        row.update(mean_running=round(self.mean_running, 2),
                   saturated_running=round(self.saturated_running, 2), peak_running=self.peak_running,
                   preemptions=self.preemptions, recomputed=self.recomputed_tokens, steps=self.steps,
                   latency=round(self.mean_latency, 1), generated=self.tokens_generated,
                   prefill=self.prefill_tokens, cached=self.cached_tokens, leaked=self.leaked_blocks)
        if self.prefix_cache_hit_rate is not None:
            row["hit_rate"] = round(self.prefix_cache_hit_rate, 4)
        return row


class _Recorder:
    """Collects per-step slot accounting and per-request outcomes while ``simulate`` runs."""

    def __init__(self, sched: Scheduler, occupancy: bool) -> None:
        self.sched = sched
        keys = ("step", "running", "waiting", *CATEGORIES, "free")
        self.columns: dict[str, list[int]] = {k: [] for k in keys}
        self.first: dict[int, int] = {}
        self.preempted: dict[int, int] = {}
        self.done: list[RequestResult] = []
        self.occupancy: list[tuple[int, np.ndarray, np.ndarray]] | None = [] if occupancy else None

    def record(self, step: int, plan: StepPlan) -> None:
        s = self.sched
        for r, _ in plan.prefill:
            self.first.setdefault(r.req_id, step)
        for r in plan.preempted:
            self.preempted[r.req_id] = self.preempted.get(r.req_id, 0) + 1
        counts = s.slot_breakdown(plan.blocked)
        values = {"step": step, "running": len(s.running), "waiting": len(s.waiting), "free": s.free_slots()}
        for k, col in self.columns.items():
            col.append(values[k] if k in values else counts[k])
        if self.occupancy is not None:
            self.occupancy.append((step, *_pool_picture(s)))

    def finished(self, r: Request, step: int) -> None:
        s = self.sched
        kv_len = s.window_start[r.req_id] + s.cache.seq_lens[r.req_id]
        self.done.append(RequestResult(r.req_id, r.arrival, self.first[r.req_id], step, s.generated[r.req_id],
                                       kv_len, self.preempted.get(r.req_id, 0)))


def _pool_picture(s: Scheduler) -> tuple[np.ndarray, np.ndarray]:
    """``owner`` (int32, -1 free) and ``filled`` (bool) for each slot of the budget, now."""
    bs, slots = s.block_size, s.kv_budget_blocks * s.block_size
    owner = np.full(slots, -1, dtype=np.int32)
    filled = np.zeros(slots, dtype=bool)
    for r in s.running:
        held = s.cache.seq_lens[r.req_id]
        if s.slabs is not None:
            start, size = s.slabs.slabs[r.req_id]
            owner[start:start + size] = r.req_id
            filled[start:start + held] = True
            continue
        for i, b in enumerate(s.cache.tables[r.req_id]):
            owner[b * bs:(b + 1) * bs] = r.req_id
            filled[b * bs:b * bs + min(bs, held - i * bs)] = True
    return owner, filled


def write_fake_kv(sched: Scheduler, plan: StepPlan) -> None:
    """Write the plan's K/V into the cache: K = the token's position, V = its request id (1 layer, 1 head,
    head_dim 1), so a test can read back what went where. With prefix caching the token ids are
    ``fake_token_ids``' and a prefill starts after the tokens found (a found block keeps the V of the
    request that computed it)."""
    cache, caching = sched.cache, sched.cache.prefix_cache is not None
    for r, n in plan.prefill:
        start = cache.seq_lens[r.req_id]
        k = torch.arange(start, start + n, dtype=cache.dtype).view(1, n, 1, 1)
        ids = fake_token_ids(r, start + n, start) if caching else None
        cache.append_tokens(r.req_id, k, torch.full_like(k, r.req_id), token_ids=ids)
    if plan.decode:
        ids = [r.req_id for r in plan.decode]
        pos = [sched.window_start[i] + cache.seq_lens[i] for i in ids]
        tokens = [fake_token_ids(r, p + 1, p)[0] for r, p in zip(plan.decode, pos)] if caching else None
        k = torch.tensor(pos, dtype=cache.dtype).view(1, -1, 1, 1)
        cache.append_batch(ids, k, torch.tensor(ids, dtype=cache.dtype).view(1, -1, 1, 1), token_ids=tokens)


def _check_workload(requests: Iterable[Request]) -> list[Request]:
    requests = list(requests)
    for r in requests:
        if not isinstance(r, Request):
            raise ValueError(f"requests must hold Request objects, got {type(r).__name__}")
    ids = [r.req_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError("requests must have distinct req_id values")
    return sorted(requests, key=lambda r: (r.arrival, r.req_id))


def simulate(requests: Sequence[Request], policy: str, kv_budget_blocks: int, block_size: int = 16, *,
             max_num_seqs: int = 256, watermark: float = 0.01, max_model_len: int = 2048,
             sliding_window: int | None = None, enable_prefix_caching: bool = False,
             record_occupancy: bool = False, progress: bool = False) -> SimResult:
    """Serve ``requests`` under ``policy`` with ``kv_budget_blocks`` blocks of ``block_size`` tokens, one
    step at a time, until every request has generated its ``output_len`` tokens.

    The K/V are tiny (1 layer, 1 head, ``head_dim`` 1) but go through a real ``PagedKVCache``: the block
    accounting of ``"paged"`` is the cache's own. ``record_occupancy`` keeps a picture of the pool at every
    step (memory grows with steps x slots: small runs only); ``progress`` shows a tqdm bar.
    ``enable_prefix_caching`` (``"paged"`` only, every request with ``prompt_tokens``): full blocks are
    found again by their tokens (notebook 06) and ``prefix_cache_hit_rate`` is reported; outputs get
    made-up token ids (``fake_token_ids``).
    """
    policy = check_policy(policy)
    if not isinstance(enable_prefix_caching, bool):
        raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
    requests = _check_workload(requests)
    budget = as_int("kv_budget_blocks", kv_budget_blocks, minimum=1)
    block_size = as_int("block_size", block_size, minimum=1)
    max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
    if enable_prefix_caching and (missing := [r.req_id for r in requests if r.prompt_tokens is None]):
        raise ValueError(f"enable_prefix_caching needs requests with prompt_tokens; requests {missing[:8]} "
                         "have none (shared_prompt_like makes some)")
    extra = 0 if policy == "paged" else max_num_seqs
    cache = PagedKVCache(budget + extra, 1, block_size, 1, 1, enable_prefix_caching=enable_prefix_caching)
    sched = Scheduler(cache, policy=policy, max_num_seqs=max_num_seqs, watermark=watermark,
                      max_model_len=max_model_len, kv_budget_blocks=budget, sliding_window=sliding_window,
                      token_ids=fake_token_ids if enable_prefix_caching else None)
    for r in requests:  # every request checked before any work
        sched.check(r)
    recorder = _Recorder(sched, record_occupancy)
    _run(sched, requests, recorder, progress)
    return _result(sched, recorder, len(requests))


def _run(sched: Scheduler, requests: list[Request], recorder: _Recorder, progress: bool) -> None:
    from tqdm.auto import tqdm

    arrivals = deque(requests)
    step = 0
    with tqdm(total=len(requests), disable=not progress, desc=sched.policy, unit="req") as bar:
        while arrivals or sched.has_unfinished:
            if not sched.has_unfinished:
                step = max(step, arrivals[0].arrival)  # idle: jump to the next arrival
            while arrivals and arrivals[0].arrival <= step:
                sched.add(arrivals.popleft())
            plan = sched.step()
            write_fake_kv(sched, plan)
            recorder.record(step, plan)
            for r in plan.scheduled:
                if sched.generated[r.req_id] == r.output_len:
                    recorder.finished(r, step)
                    sched.finish(r)
                    bar.update()
            step += 1


def _result(sched: Scheduler, rec: _Recorder, num_requests: int) -> SimResult:
    series = {k: np.asarray(v, dtype=np.int64) for k, v in rec.columns.items()}
    totals = {k: int(series[k].sum()) for k in CATEGORIES}
    denom = sum(totals.values())
    breakdown = {k: (v / denom if denom else 0.0) for k, v in totals.items()}
    slabs_left = ceil_div(sched.slabs.used_slots, sched.block_size) if sched.slabs else 0
    leaked = sched.cache.num_used_blocks + slabs_left
    occupancy = None
    if rec.occupancy is not None and rec.occupancy:
        steps, owners, filled = zip(*rec.occupancy)
        occupancy = Occupancy(np.asarray(steps), np.stack(owners), np.stack(filled))
    running = series["running"]
    return SimResult(
        policy=sched.policy, block_size=sched.block_size, kv_budget_blocks=sched.kv_budget_blocks,
        num_requests=num_requests, steps=len(running), kv_utilization=breakdown["token"], breakdown=breakdown,
        mean_running=float(running.mean()) if len(running) else 0.0,
        peak_running=int(running.max()) if len(running) else 0,
        preemptions=sched.num_preemptions, recomputed_tokens=sched.recomputed_tokens,
        tokens_generated=sum(r.generated for r in rec.done),
        mean_latency=float(np.mean([r.finished - r.arrival + 1 for r in rec.done])) if rec.done else 0.0,
        leaked_blocks=leaked, series=series, requests=sorted(rec.done), occupancy=occupancy,
        prefix_cache_hit_rate=sched.cache.prefix_cache_stats()["hit_rate"] if sched.token_ids else None,
        prefill_tokens=sched.prefill_tokens, cached_tokens=sched.cached_tokens)


# ------------------------------------------------------------------------------------------------------
# command line

COLUMNS = ["policy", "kv_util", *CATEGORIES, "mean_running", "saturated_running", "peak_running",
           "preemptions", "recomputed", "steps", "latency", "leaked"]

WORKLOADS = {"sharegpt": sharegpt_like, "alpaca": alpaca_like, "shared": shared_prompt_like}


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedlib.serving``: every policy on one workload and budget, as a table."""
    p = argparse.ArgumentParser(prog="python -m pagedlib.serving", description=main.__doc__)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per step (Poisson); inf: all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-blocks", type=int, default=983,
                   help="KV budget in blocks (983 x 16 = 15.7K slots: the paper's OPT-13B on one A100-40GB)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="add a row: paged with prefix caching (needs --workload shared)")
    p.add_argument("--json", metavar="FILE", help="also write the rows and settings as JSON")
    args = p.parse_args(argv)
    if args.enable_prefix_caching and args.workload != "shared":
        p.error("--enable-prefix-caching needs --workload shared (requests with token ids)")
    from pagedlib.bench import print_table, write_json

    requests = WORKLOADS[args.workload](args.num_requests, args.seed, rate=args.rate)
    runs = [(policy, False) for policy in args.policies] + [("paged", True)] * args.enable_prefix_caching
    rows = [{**simulate(requests, policy, args.budget_blocks, args.block_size, max_num_seqs=args.max_num_seqs,
                        enable_prefix_caching=caching, progress=True).row(), "prefix_caching": caching}
            for policy, caching in runs]
    title = (f"{args.workload}-like, {args.num_requests} requests, rate {args.rate}/step, seed {args.seed}; "
             f"budget {args.budget_blocks} blocks x {args.block_size} tokens")
    extra = ["prefix_caching", "hit_rate", "prefill", "cached"] if args.enable_prefix_caching else []
    print_table(rows, COLUMNS + extra, title=title)
    if args.json:
        write_json(args.json, {"settings": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
