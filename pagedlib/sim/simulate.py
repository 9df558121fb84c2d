"""The serving simulation of notebooks 07 and 09: ``simulate`` runs the real ``Scheduler`` (or the slab and
sliding-window ones built on it) on a real ``PagedKVCache`` (tiny fake K/V), sorts every slot, every step,
into the vLLM paper's Figure 2 categories, and times each request's tokens in steps or modelled seconds."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler, StepPlan
from pagedlib.sim._checks import check_simulate
from pagedlib.sim.budgets import SlabScheduler
from pagedlib.sim.window import WindowScheduler
from pagedlib.sim.workloads import fake_output_token
from pagedlib.util import ceil_div

#: Where a slot goes (the vLLM paper's Figure 2 categories, defined in notebook 07 and ``slot_breakdown``).
CATEGORIES = ("token", "reservation", "internal", "external", "other")
#: ``SimResult.series``'s columns, one entry per step (``tokens``: new ones; ``context``: K/V tokens read).
SERIES = ("step", "running", "waiting", "preempted", *CATEGORIES, "free", "tokens", "context")


class RequestResult(NamedTuple):
    """How one request went, in simulation steps."""

    req_id: int
    arrival: int
    first_scheduled: int
    finished: int
    generated: int
    final_kv_len: int  # K/V positions written by its last step (sliding-window releases included)
    preemptions: int
    token_steps: tuple[int, ...] = ()  # the step that sampled each of its tokens


class StepCost(NamedTuple):
    """Modelled seconds of one engine step: ``fixed + per_token * new tokens + per_context * K/V tokens read``
    (each scheduled request reads its whole cache once)."""

    fixed: float
    per_token: float
    per_context: float


@dataclass
class Occupancy:
    """The pool at every step: ``owner[t, slot]`` the request holding a slot (-1: free), ``filled[t, slot]``
    whether it holds a token. Slots are ``block * block_size + offset`` (paged) or slab addresses."""

    steps: np.ndarray     # [T] step numbers
    owner: np.ndarray     # [T, slots] int32
    filled: np.ndarray    # [T, slots] bool


@dataclass
class SimResult:
    """What ``simulate`` measured. Fractions are of the slot-steps in use or stranded (``CATEGORIES``)."""

    policy: str
    block_size: int
    kv_budget_blocks: int
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
    series: dict[str, np.ndarray]         # SERIES -> one entry per step
    requests: list[RequestResult]
    occupancy: Occupancy | None = None
    prefill_tokens: int = 0               # K/V computed by prefills (recomputes included, cache hits not)
    cached_tokens: int = 0                # tokens found in the prefix cache at admission (not computed)

    @property
    def saturated_running(self) -> float:
        """Mean running requests over the steps at which a request waited (0.0 if none did)."""
        busy = self.series["waiting"] > 0
        return float(self.series["running"][busy].mean()) if busy.any() else 0.0

    def latencies(self, cost: StepCost | None = None) -> dict[str, np.ndarray]:
        """``ttft`` per request (from the start of its arrival step to the end of the step that sampled its
        first token) and every ``itl`` (between a request's consecutive tokens, ended at ``itl_at``), in
        steps or, under ``cost``, modelled seconds."""
        s = self.series
        took = np.ones(len(s["step"])) if cost is None else \
            cost.fixed + cost.per_token * s["tokens"] + cost.per_context * s["context"]
        end = dict(zip(s["step"].tolist(), np.cumsum(took).tolist()))           # step -> clock at its end
        start = {k: t - d for (k, t), d in zip(end.items(), took.tolist())}
        ttft = [end[r.token_steps[0]] - start[r.arrival] for r in self.requests]
        pairs = [(a, b) for r in self.requests for a, b in itertools.pairwise(end[k] for k in r.token_steps)]
        return {"ttft": np.array(ttft), "itl": np.array([b - a for a, b in pairs]),
                "itl_at": np.array([b for _, b in pairs])}  # when the later token of each gap came

    def row(self) -> dict[str, Any]:
        """The scalar results, rounded for a table or JSON."""
        row: dict[str, Any] = dict(
            policy=self.policy, block_size=self.block_size, budget_blocks=self.kv_budget_blocks,
            kv_util=round(self.kv_utilization, 4), **{k: round(v, 4) for k, v in self.breakdown.items()},
            mean_running=round(self.mean_running, 2), saturated_running=round(self.saturated_running, 2),
            peak_running=self.peak_running, preemptions=self.preemptions, recomputed=self.recomputed_tokens,
            steps=self.steps, latency=round(self.mean_latency, 1), generated=self.tokens_generated,
            prefill=self.prefill_tokens, cached=self.cached_tokens, leaked=self.leaked_blocks)
        if self.prefix_cache_hit_rate is not None:
            row["hit_rate"] = round(self.prefix_cache_hit_rate, 4)
        return row


def held_slots(sched: Scheduler, request: Request) -> int:
    """Slots set aside for a running request: its slab, or its blocks."""
    if isinstance(sched, SlabScheduler):
        return sched.slots.slabs[request.req_id][1]
    return len(sched.cache.tables[request.req_id]) * sched.block_size


def slot_breakdown(sched: Scheduler, blocked: bool, window_start: dict[int, int]) -> dict[str, int]:
    """Every slot of the budget in use or stranded, by ``CATEGORIES``, after a step's writes; free slots only
    while a request waits (``blocked``): ``external`` if its slab fits in them. A shared block counts once.
    ``window_start``: request id -> position of the first token its cache holds (a sliding window's)."""
    out = dict.fromkeys(CATEGORIES, 0)
    seen: set[int] = set()  # blocks counted for an earlier holder
    slab = isinstance(sched, SlabScheduler)
    for request in sched.running:
        held = sched.cache.seq_lens[request.req_id]
        first = window_start[request.req_id]
        size = held_slots(sched, request)
        future = max(0, min(first + size, request.max_kv_len) - (first + held))  # slots it will still write
        table = []
        if not slab:
            table = sched.cache.tables[request.req_id]
        out["token"] += held - sched.block_size * sum(block in seen for block in table)
        seen.update(table)
        out["reservation"] += future
        out["internal"] += size - held - future
    if blocked:
        free = free_slots(sched)
        fits = slab and sched.waiting and free >= sched.reservation(sched.waiting[0])
        out["external" if fits else "other"] += free
    return out


def free_slots(sched: Scheduler) -> int:
    if isinstance(sched, SlabScheduler):
        return sched.slots.free_slots
    return sched.cache.num_free_blocks * sched.block_size


def write_fake_kv(sched: Scheduler, plan: StepPlan) -> None:
    """Write the plan's K/V into the slots it reserved: K = the token's position, V = its request id (1 layer,
    1 head, head_dim 1), so a test can read back what went where. What a model's forward pass does."""
    if not plan.work:
        return
    cache = sched.cache
    cache.pool.copy_blocks(plan.batch.copies)
    positions, owners = [], []
    for request, n in plan.work:  # a row starts after the tokens already computed (or found)
        positions += range(request.num_computed_tokens, request.num_computed_tokens + n)
        owners += [request.req_id] * n
    k = torch.tensor(positions, dtype=cache.dtype).view(1, -1, 1, 1)  # [layers, tokens, heads, dim]
    v = torch.tensor(owners, dtype=cache.dtype).view(1, -1, 1, 1)
    cache.pool.write([slot for slots in plan.batch.slots for slot in slots], k, v)


def sim_step(sched: Scheduler) -> tuple[StepPlan, list[Request]]:
    """One step of a simulated engine: plan it, write its fake K/V, sample made-up tokens. Returns the plan
    and the requests that finished."""
    plan = sched.schedule()
    write_fake_kv(sched, plan)
    sampled = [fake_output_token(request) for request, _ in plan.work]
    return plan, sched.update(plan, sampled)


def new_scheduler(requests: Sequence[Request], policy: str, kv_budget_blocks: int, block_size: int = 16, *,
                  max_num_seqs: int = 256, watermark: float = 0.01, max_model_len: int = 2048,
                  sliding_window: int | None = None, enable_prefix_caching: bool = False,
                  prefix_cache: str = "hash", max_num_batched_tokens: int | None = None,
                  long_prefill_token_threshold: int | None = None) -> Scheduler:
    """The scheduler ``simulate`` runs, with its cache, every request checked against it (nothing queued):
    a ``SlabScheduler`` for a reservation policy, a ``WindowScheduler`` for a ``sliding_window``, else the
    paged ``Scheduler`` (``max_num_batched_tokens``: its token budget; ``None``: whole prompts)."""
    requests, budget, block_size, max_num_seqs = check_simulate(
        requests, policy, kv_budget_blocks, block_size, max_num_seqs, enable_prefix_caching, sliding_window,
        max_num_batched_tokens)
    max_num_seqs = min(max_num_seqs, max(1, len(requests)))  # no more can run: the cap must not size memory
    num_blocks = budget
    if policy != "paged":
        num_blocks += max_num_seqs  # a slab's tokens can straddle one block more
    cache = PagedKVCache(num_blocks, 1, block_size, 1, 1, enable_prefix_caching=enable_prefix_caching,
                         prefix_cache=prefix_cache)
    options = dict(max_num_seqs=max_num_seqs, watermark=watermark, max_model_len=max_model_len)
    if policy != "paged":
        sched: Scheduler = SlabScheduler(cache, policy, kv_budget_blocks=budget, **options)
    elif sliding_window is not None:
        sched = WindowScheduler(cache, sliding_window, **options)
    else:
        sched = Scheduler(cache, max_num_batched_tokens=max_num_batched_tokens,
                          long_prefill_token_threshold=long_prefill_token_threshold, **options)
    for request in requests:
        sched.check(request)
    return sched


def simulate(requests: Sequence[Request], policy: str, kv_budget_blocks: int, block_size: int = 16, *,
             record_occupancy: bool = False, progress: bool = False, **options: Any) -> SimResult:
    """Serve ``requests`` under ``policy``, ``kv_budget_blocks`` blocks of ``block_size`` tokens, until every
    request has all its tokens. ``options``: ``new_scheduler``'s. ``record_occupancy`` keeps a picture of the
    pool at every step (steps x slots of memory: small runs only); ``progress`` shows a tqdm bar."""
    requests = list(requests)
    sched = new_scheduler(requests, policy, kv_budget_blocks, block_size, **options)
    return serve(sched, requests, record_occupancy, progress)


def _pool_picture(sched: Scheduler) -> tuple[np.ndarray, np.ndarray]:
    """``owner`` (int32, -1 free) and ``filled`` (bool) for each slot of the budget, now."""
    bs = sched.block_size
    slots = sched.kv_budget_blocks * bs
    owner = np.full(slots, -1, dtype=np.int32)
    filled = np.zeros(slots, dtype=bool)
    for request in sched.running:
        if isinstance(sched, SlabScheduler):
            start, size = sched.slots.slabs[request.req_id]
            at = np.arange(start, start + size)
        else:  # its blocks' slots, in token order
            blocks = np.array(sched.cache.tables[request.req_id], dtype=np.int64)
            at = (blocks[:, None] * bs + np.arange(bs)).ravel()
        owner[at] = request.req_id
        filled[at[:sched.cache.seq_lens[request.req_id]]] = True
    return owner, filled


@dataclass
class _Totals:
    """What ``serve`` adds up over the plans."""

    preemptions: int = 0
    recomputed_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0

    def add(self, plan: StepPlan) -> None:
        self.preemptions += len(plan.preempted)
        self.recomputed_tokens += plan.counts.recomputed_tokens
        self.prefill_tokens += sum(n for _, n in plan.prefill)
        self.cached_tokens += plan.counts.cached_tokens


def serve(sched: Scheduler, requests: list[Request], occupancy: bool = False, progress: bool = False
          ) -> SimResult:
    """Serve ``requests`` (copies: a request carries its run's state) by arrival with a scheduler from
    ``new_scheduler`` until every one has finished."""
    from tqdm.auto import tqdm

    fresh = sorted((replace(request) for request in requests), key=lambda r: (r.arrival, r.req_id))
    arrivals = deque(fresh)
    rows, done, pictures = [], [], []
    first: dict[int, int] = {}  # req_id -> step of its first prefill
    preempted: Counter[int] = Counter()
    sampled_at: defaultdict[int, list[int]] = defaultdict(list)  # req_id -> the steps that sampled its tokens
    totals = _Totals()
    step = 0
    with tqdm(total=len(requests), disable=not progress, desc=_policy(sched), unit="req") as bar:
        while arrivals or sched.has_unfinished:
            if not sched.has_unfinished:
                step = max(step, arrivals[0].arrival)  # idle: jump to the next arrival
            while arrivals and arrivals[0].arrival <= step:
                sched.add(arrivals.popleft())
            plan = sched.schedule()
            totals.add(plan)
            rows.append(_run_step(sched, plan, step))
            for request, _ in plan.prefill:
                first.setdefault(request.req_id, step)
            preempted.update(request.req_id for request in plan.preempted)
            for request in plan.sampling:
                sampled_at[request.req_id].append(step)
            if occupancy:
                pictures.append((step, *_pool_picture(sched)))
            for r in sched.update(plan, [fake_output_token(request) for request, _ in plan.work]):
                token_steps = tuple(sampled_at.pop(r.req_id))
                done.append(RequestResult(r.req_id, r.arrival, first[r.req_id], step, r.output_len,
                                          r.num_computed_tokens, preempted[r.req_id], token_steps))
                bar.update()
            step += 1
    if isinstance(sched, WindowScheduler):
        totals.prefill_tokens += sched.skipped_tokens  # computed, though never stored
    return _result(sched, rows, done, pictures, totals)


def _run_step(sched: Scheduler, plan: StepPlan, step: int) -> dict[str, int]:
    """Write the plan's fake K/V; the step's row of ``SimResult.series``."""
    window_start = {}  # req_id -> position of the first token its cache holds
    scheduled = {request.req_id: n for request, n in plan.work}  # the cache holds their slots already
    for request in sched.running:
        stored = sched.cache.seq_lens[request.req_id] - scheduled.get(request.req_id, 0)
        window_start[request.req_id] = request.num_computed_tokens - stored
    write_fake_kv(sched, plan)
    context = sum(sched.cache.seq_lens[request.req_id] for request, _ in plan.work)
    return {"step": step, "running": len(sched.running), "waiting": len(sched.waiting),
            "preempted": len(plan.preempted), **slot_breakdown(sched, plan.blocked, window_start),
            "free": free_slots(sched), "tokens": plan.num_tokens, "context": context}


def _policy(sched: Scheduler) -> str:
    if isinstance(sched, SlabScheduler):
        return sched.policy
    return "paged"


def _result(sched: Scheduler, rows: list[dict], done: list[RequestResult], pictures: list,
            totals: _Totals) -> SimResult:
    series = {k: np.array([row[k] for row in rows], dtype=np.int64) for k in SERIES}
    slot_steps = {k: int(series[k].sum()) for k in CATEGORIES}
    breakdown = {k: v / max(1, sum(slot_steps.values())) for k, v in slot_steps.items()}
    leaked = sched.cache.num_used_blocks
    if isinstance(sched, SlabScheduler):
        leaked += ceil_div(sched.slots.used_slots, sched.block_size)
    running = series["running"]
    mean_running = float(running.mean()) if len(running) else 0.0
    mean_latency = float(np.mean([r.finished - r.arrival + 1 for r in done])) if done else 0.0
    hit_rate = None
    if sched.cache.prefix_cache is not None:
        hit_rate = sched.cache.prefix_cache_stats()["hit_rate"]
    occupancy = None
    if pictures:
        occupancy = Occupancy(*map(np.stack, zip(*pictures)))
    return SimResult(
        policy=_policy(sched), block_size=sched.block_size, kv_budget_blocks=sched.kv_budget_blocks,
        steps=len(running), kv_utilization=breakdown["token"], breakdown=breakdown,
        mean_running=mean_running, peak_running=int(running.max(initial=0)),
        preemptions=totals.preemptions, recomputed_tokens=totals.recomputed_tokens,
        tokens_generated=sum(r.generated for r in done), mean_latency=mean_latency,
        leaked_blocks=leaked, series=series, requests=sorted(done), occupancy=occupancy,
        prefill_tokens=totals.prefill_tokens, cached_tokens=totals.cached_tokens,
        prefix_cache_hit_rate=hit_rate)
