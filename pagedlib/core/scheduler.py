"""The step-level scheduler (notebooks 07 and 08): requests, reservation policies and continuous batching
over a ``PagedKVCache``."""

from __future__ import annotations

import numbers
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from pagedlib.checks import as_int, ceil_div
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.window import release_outside_window

POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")

#: Where every slot counted by ``simulate`` goes, the paper's Figure 2 categories: ``token`` holds a
#: token's K/V; ``reservation`` is set aside for a token the request will still write; ``internal`` is set
#: aside but will never be written; ``external`` is free while a request waits although enough slots are
#: free in total (no hole is large enough); ``other`` is free while a request waits and too little in
#: total (or held back by the paged policy's watermark).
CATEGORIES = ("token", "reservation", "internal", "external", "other")


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


