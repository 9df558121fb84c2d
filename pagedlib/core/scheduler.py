"""The step schedulers: continuous batching over a ``PagedKVCache`` under a KV budget, like nano-vllm's
``Scheduler.schedule`` (notebooks 07, 08: whole prompts), and under a token budget with chunked prefill, like
vLLM V1's (notebook 09). One thread; a ``step()`` that raises leaves no request half-moved."""

from __future__ import annotations

import itertools
import numbers
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedlib.core.budgets import PagedBudget, SlabBudget, check_policy
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.window import release_outside_window
from pagedlib.util import as_int, ceil_div, refuse


@dataclass
class StepPlan:
    """``n`` K/V to write per ``(request, n)`` in ``prefill``, one per ``decode`` request, each samples a
    token but the prefill chunks in ``partial`` (their prompt goes on next step); ``preempted``: lost their
    K/V, now first in the queue; ``blocked``: a request waits for memory."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocked: bool = False
    partial: set[int] = field(default_factory=set)  # req ids

    @property
    def scheduled(self) -> list[Request]:  # the requests that sample a token this step
        return self.decode + [r for r, _ in self.prefill if r.req_id not in self.partial]

    @property
    def num_tokens(self) -> int:  # new tokens of the step's one forward pass
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    """Continuous batching over ``cache``. A slab budget needs ``kv_budget_blocks + max_num_seqs`` cache
    blocks (a slab can straddle one more); prefix caching needs ``token_ids(request, n)``: its first n ids."""

    def __init__(self, cache: PagedKVCache, *, policy: str = "paged", max_num_seqs: int = 256,
                 watermark: float = 0.01, max_model_len: int = 2048, kv_budget_blocks: int | None = None,
                 sliding_window: int | None = None,
                 token_ids: Callable[[Request, int], Sequence[int]] | None = None) -> None:
        (self.policy, self.max_num_seqs, self.max_model_len, self.kv_budget_blocks, self.sliding_window,
         self.token_ids) = _check_scheduler(cache, policy, max_num_seqs, max_model_len, kv_budget_blocks,
                                            watermark, sliding_window, token_ids)
        self.cache, self.block_size = cache, cache.block_size
        self.budget = (PagedBudget(cache, watermark, self.sliding_window) if policy == "paged" else
                       SlabBudget(policy, self.kv_budget_blocks, self.block_size, self.max_model_len))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # in admission order: preempt from the end
        self.generated: dict[int, int] = {}     # req_id -> tokens sampled so far
        self.window_start: dict[int, int] = {}  # req_id -> position of the cache's first token
        self.num_preemptions = self.recomputed_tokens = 0  # K/V lost to preemptions, less those found again
        self.prefill_tokens = self.cached_tokens = 0       # K/V computed by prefills; found at admission

    def check(self, request: Request) -> None:
        """``ValueError`` unless ``request`` is new, fits the model and, alone, the budget."""
        if not isinstance(r := request, Request):
            raise ValueError(f"request must be a Request, got {type(r).__name__}")
        need = self.budget.blocks_alone(r)
        refuse((r.req_id in self.generated, f"request id {r.req_id} is already queued or running"),
               (r.prompt_len + r.output_len > self.max_model_len, f"request {r.req_id}: prompt_len + "
                f"output_len = {r.prompt_len} + {r.output_len} > max_model_len = {self.max_model_len}"),
               (need > self.kv_budget_blocks, f"request {r.req_id} needs {need} blocks, more than the budget "
                                              f"of {self.kv_budget_blocks}: it could never run"))

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)
        self.generated[request.req_id] = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepPlan:
        """Plan one step: free what sliding windows no longer see, give every running request a decode slot
        (preempting while memory is short), then, unless someone was preempted, admit waiting requests."""
        if done := [r.req_id for r in self.running if self.generated[r.req_id] >= r.output_len]:
            raise RuntimeError(f"requests {done} have all their tokens: call finish() for them first")
        for r in self.running if self.sliding_window else []:
            self.window_start[r.req_id] += release_outside_window(self.cache, r.req_id, self.sliding_window)
        plan = StepPlan(preempted=self.preempt_for_decode())
        plan.decode = list(self.running)
        plan.prefill, plan.blocked = ([], bool(self.waiting)) if plan.preempted else self.admit()
        for r in plan.scheduled:
            self.generated[r.req_id] += 1
        return plan

    def preempt_for_decode(self) -> list[Request]:
        """Preempt the most recently admitted requests until the free blocks cover this step's decode: each
        victim's K/V are freed (it will be recomputed) and it waits at the front of the queue."""
        victims = []
        while self.budget.decode_blocks(self.running) > self.cache.num_free_blocks:
            victim = self.running[-1]
            lost = self.cache.seq_lens[victim.req_id]
            self.cache.free_sequence(victim.req_id)
            self.recomputed_tokens += lost + self.window_start.pop(victim.req_id)
            self.waiting.appendleft(self.running.pop())
            victims.append(victim)
        self.num_preemptions += len(victims)
        return victims

    def admit(self) -> tuple[list[tuple[Request, int]], bool]:
        """Admit waiting requests in arrival order while ``max_num_seqs`` and the budget allow (with prefix
        caching, attaching the blocks found): the prefills, and whether a request was refused for memory."""
        reserved, admitted, blocked = [], [], False  # admitted: (request, tokens, first stored, found)
        pending = self.budget.decode_blocks(self.running)  # blocks this step's decode will take
        try:
            for request in itertools.islice(self.waiting, self.max_num_seqs - len(self.running)):
                tokens = request.prompt_len + self.generated[request.req_id]  # more after a preemption
                ids = self.token_ids(request, tokens) if self.token_ids else None
                found = self.cache.prefix_cache.peek(ids) if ids is not None else []
                start = self.first_stored(tokens)
                if blocked := (new := self.budget.reserve(request, tokens - start, found, pending)) is None:
                    break
                pending += new
                reserved.append(request)
                admitted.append((request, tokens, start, self.cache.add_sequence(request.req_id, ids)))
        except BaseException:  # undo this step's admissions: no request has moved yet
            for request, *_ in admitted:
                self.cache.free_sequence(request.req_id)
            for request in reserved:
                self.budget.release(request)
            raise
        return [self._move_to_running(*a) for a in admitted], blocked

    def first_stored(self, tokens: int) -> int:
        """Where a prefill of ``tokens`` starts storing K/V: under a sliding window, at the first block the
        window still sees (a real engine computes the rest too, in chunks, freeing blocks as it goes)."""
        w, bs = self.sliding_window, self.block_size
        return 0 if w is None else max(0, tokens - w) // bs * bs

    def finish(self, request: Request) -> None:
        """Retire a running request and give its memory back."""
        if request not in self.running:
            raise ValueError(f"request {getattr(request, 'req_id', request)!r} is not running")
        self.cache.free_sequence(request.req_id)
        self.budget.release(request)
        self.running.remove(request)
        del self.window_start[request.req_id], self.generated[request.req_id]

    def _move_to_running(self, request: Request, tokens: int, start: int, cached: int) -> tuple[Request, int]:
        self.running.append(self.waiting.popleft())
        self.window_start[request.req_id] = start
        self.cached_tokens += cached
        self.prefill_tokens += tokens - cached
        if self.generated[request.req_id]:  # readmitted: what was found need not be recomputed
            self.recomputed_tokens -= cached
        return request, tokens - start - cached


class ChunkedScheduler(Scheduler):
    """vLLM V1's plan: no prefill and decode phases, a budget of ``max_num_batched_tokens`` new tokens per
    step. Running requests come first (one token to decode, or their prompt's next chunk), then waiting ones
    in arrival order; no chunk is longer than ``long_prefill_token_threshold``. A request preempted while
    partly prefilled loses its chunks and starts again. ``Scheduler``'s other options; ``paged`` only."""

    def __init__(self, cache: PagedKVCache, *, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int | None = None, **options: Any) -> None:
        super().__init__(cache, **options)
        self.max_num_batched_tokens, self.chunk_cap = _check_chunked(
            self, max_num_batched_tokens, long_prefill_token_threshold)

    def todo(self, request: Request) -> int:
        """Tokens of ``request`` whose K/V are not stored: 1 while it decodes, else the prompt's rest."""
        stored = self.cache.seq_lens.get(request.req_id, 0)
        return request.prompt_len + self.generated[request.req_id] - stored

    def step(self) -> StepPlan:
        """Plan one step: each running request, oldest first, takes its next tokens while the token budget
        lasts, preempting the newest while blocks are short; then, if nobody was preempted, waiting requests
        are admitted with their first chunk while tokens, ``max_num_seqs`` and blocks allow."""
        if done := [r.req_id for r in self.running if self.generated[r.req_id] >= r.output_len]:
            raise RuntimeError(f"requests {done} have all their tokens: call finish() for them first")
        plan, pending, gone = StepPlan(), 0, set()  # pending: blocks this step's chunks take; gone: preempted
        for r in list(self.running):
            n = min(self.todo(r), self.max_num_batched_tokens - plan.num_tokens, self.chunk_cap)
            while r.req_id not in gone and self.blocks_for(r, n) + pending > self.cache.num_free_blocks:
                plan.preempted.append(victim := self.preempt_newest())
                gone.add(victim.req_id)
            if n == 0 or r.req_id in gone:
                break
            pending += self.blocks_for(r, n)
            self.schedule(plan, r, n)
        if not plan.preempted:
            self.admit_chunks(plan, pending)
        return plan

    def blocks_for(self, request: Request, n: int) -> int:
        """New blocks ``request`` takes to store ``n`` more tokens."""
        held = self.cache.seq_lens[request.req_id]
        return ceil_div(held + n, self.block_size) - ceil_div(held, self.block_size)

    def preempt_newest(self) -> Request:
        """Free the newest running request's K/V (prompt chunks included) and queue it first again."""
        victim = self.running.pop()
        self.recomputed_tokens += self.cache.seq_lens[victim.req_id]
        self.cache.free_sequence(victim.req_id)
        del self.window_start[victim.req_id]
        self.waiting.appendleft(victim)
        self.num_preemptions += 1
        return victim

    def admit_chunks(self, plan: StepPlan, pending: int) -> None:
        """Admit waiting requests with a first chunk (after the blocks the prefix cache finds) into the
        tokens left; ``plan.blocked`` if the blocks ran out, less the watermark."""
        while self.waiting and plan.num_tokens < self.max_num_batched_tokens and \
                len(self.running) < self.max_num_seqs:
            r, bs = self.waiting[0], self.block_size
            ids = self.token_ids(r, self.todo(r)) if self.token_ids else None
            found = self.cache.prefix_cache.peek(ids) if ids is not None else []
            n = min(self.todo(r) - len(found) * bs, self.max_num_batched_tokens - plan.num_tokens,
                    self.chunk_cap)
            if (new := self.budget.reserve(r, len(found) * bs + n, found, pending)) is None:
                plan.blocked = True
                return
            pending += new
            cached = self.cache.add_sequence(r.req_id, ids)
            self.running.append(self.waiting.popleft())
            self.window_start[r.req_id], self.cached_tokens = 0, self.cached_tokens + cached
            self.recomputed_tokens -= cached if self.generated[r.req_id] else 0
            self.schedule(plan, r, min(n, self.todo(r)))  # the radix cache also finds part of a block

    def schedule(self, plan: StepPlan, request: Request, n: int) -> None:
        """Put ``n`` tokens of ``request`` in ``plan``: it samples a token if they are its last unstored."""
        if n == self.todo(request) == 1 and self.generated[request.req_id]:
            plan.decode.append(request)
        else:
            plan.prefill.append((request, n))
            self.prefill_tokens += n
            if n < self.todo(request):
                plan.partial.add(request.req_id)
        self.generated[request.req_id] += n == self.todo(request)


def _check_chunked(sched: Scheduler, budget: object, threshold: object) -> tuple[int, int]:
    refuse((sched.policy != "paged" or sched.sliding_window is not None,
            "chunked prefill (max_num_batched_tokens) needs the 'paged' policy and no sliding_window"))
    budget = as_int("max_num_batched_tokens", budget, minimum=1)
    cap = budget if threshold is None else threshold
    return budget, as_int("long_prefill_token_threshold", cap, minimum=1)


def _check_scheduler(cache: object, policy: object, max_num_seqs: object, max_model_len: object,
                     kv_budget_blocks: object, watermark: object, window: object, token_ids: object) -> tuple:
    policy = check_policy(policy)
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if cache.seq_lens:
        raise ValueError(f"cache must be empty: it holds sequences {list(cache.seq_lens)[:8]}")
    n, paged = cache.num_blocks, policy == "paged"
    max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
    max_model_len = as_int("max_model_len", max_model_len, minimum=2)
    budget = (n if paged else n - max_num_seqs) if kv_budget_blocks is None else kv_budget_blocks
    budget = as_int("kv_budget_blocks", budget, minimum=1)
    refuse((paged and budget != n, f"under 'paged' the budget is the cache: kv_budget_blocks must be {n}, "
                                   f"got {budget}"),
           (not paged and n < budget + max_num_seqs, "the cache stores a reservation policy's tokens and "
            f"needs kv_budget_blocks + max_num_seqs = {budget + max_num_seqs} blocks, it has {n}"))
    if isinstance(watermark, bool) or not isinstance(watermark, numbers.Real) or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
    window = None if window is None else as_int("sliding_window", window, minimum=1)
    if window is not None and not paged:
        raise ValueError("sliding_window needs the paged policy (a slab cannot give back its front)")
    if cache.prefix_cache is None:
        return policy, max_num_seqs, max_model_len, budget, window, None
    refuse((not paged, "prefix caching needs the 'paged' policy (a contiguous slab is never shared)"),
           (window is not None, "sliding_window cannot be combined with prefix caching (a cached block's key "
                                "names the block before it, which the window would free)"),
           (not callable(token_ids), "a cache with prefix caching needs token_ids(request, n) -> the "
                                     f"request's first n token ids, got {token_ids!r}"))
    return policy, max_num_seqs, max_model_len, budget, window, token_ids
