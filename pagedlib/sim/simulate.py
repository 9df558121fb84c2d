"""The serving simulation of notebooks 07 and 09: ``simulate`` runs the real ``Scheduler`` (or, with a token
budget, ``ChunkedScheduler``) on a real ``PagedKVCache`` (tiny fake K/V), sorts every slot, every step, into
the vLLM paper's Figure 2 categories, and times each request's tokens in steps or modelled seconds."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedlib.core.budgets import SlabBudget
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.scheduler import ChunkedScheduler, Request, Scheduler, StepPlan
from pagedlib.sim._checks import check_simulate
from pagedlib.sim.workloads import fake_token_ids
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


def held_slots(sched: Scheduler, r: Request) -> int:
    """Slots set aside for a running request: its blocks, or its slab."""
    if isinstance(sched.budget, SlabBudget):
        return sched.budget.slabs[r.req_id][1]
    return len(sched.cache.tables[r.req_id]) * sched.block_size


def slot_breakdown(sched: Scheduler, blocked: bool) -> dict[str, int]:
    """Every slot of the budget in use or stranded, by ``CATEGORIES``, after a step's writes; free slots only
    while a request waits (``blocked``): ``external`` if its slab fits in them. A shared block counts once."""
    out, seen, slab = dict.fromkeys(CATEGORIES, 0), set(), isinstance(sched.budget, SlabBudget)
    for r in sched.running:
        held, first, size = sched.cache.seq_lens[r.req_id], sched.window_start[r.req_id], held_slots(sched, r)
        future = max(0, min(first + size, r.max_kv_len) - (first + held))  # slots it will still write
        table = [] if slab else sched.cache.tables[r.req_id]
        out["token"] += held - sched.block_size * sum(b in seen for b in table)  # counted for a holder before
        seen.update(table)
        out["reservation"] += future
        out["internal"] += size - held - future
    if blocked:
        free = free_slots(sched)
        fits = slab and sched.waiting and free >= sched.budget.reservation(sched.waiting[0])
        out["external" if fits else "other"] += free
    return out


def free_slots(sched: Scheduler) -> int:
    b = sched.budget
    return b.free_slots if isinstance(b, SlabBudget) else sched.cache.num_free_blocks * sched.block_size


def write_fake_kv(sched: Scheduler, plan: StepPlan) -> None:
    """Write the plan's K/V: K = the token's position, V = its request id (1 layer, 1 head, head_dim 1), so a
    test can read back what went where; a prefill starts after the tokens the prefix cache found."""
    cache, caching = sched.cache, sched.cache.prefix_cache is not None
    for r, n in plan.prefill:
        start = sched.window_start[r.req_id] + cache.seq_lens[r.req_id]
        k = torch.arange(start, start + n, dtype=cache.dtype).view(1, n, 1, 1)
        ids = fake_token_ids(r, start + n, start) if caching else None
        cache.append_tokens(r.req_id, k, torch.full_like(k, r.req_id), token_ids=ids)
    if plan.decode:
        ids = [r.req_id for r in plan.decode]
        pos = [sched.window_start[i] + cache.seq_lens[i] for i in ids]
        tokens = [fake_token_ids(r, p + 1, p)[0] for r, p in zip(plan.decode, pos)] if caching else None
        k = torch.tensor(pos, dtype=cache.dtype).view(1, -1, 1, 1)
        cache.append_batch(ids, k, torch.tensor(ids, dtype=cache.dtype).view(1, -1, 1, 1), token_ids=tokens)


def new_scheduler(requests: Sequence[Request], policy: str, kv_budget_blocks: int, block_size: int = 16, *,
                  max_num_seqs: int = 256, watermark: float = 0.01, max_model_len: int = 2048,
                  sliding_window: int | None = None, enable_prefix_caching: bool = False,
                  prefix_cache: str = "hash", max_num_batched_tokens: int | None = None,
                  long_prefill_token_threshold: int | None = None) -> Scheduler:
    """The scheduler ``simulate`` runs, with its cache, every request checked against it (nothing queued);
    ``max_num_batched_tokens``: a ``ChunkedScheduler`` with that token budget (and chunk cap)."""
    requests, budget, block_size, max_num_seqs = check_simulate(
        requests, policy, kv_budget_blocks, block_size, max_num_seqs, enable_prefix_caching)
    max_num_seqs = min(max_num_seqs, max(1, len(requests)))  # no more can run: the cap must not size memory
    extra = 0 if policy == "paged" else max_num_seqs  # a slab's tokens can straddle one block more
    cache = PagedKVCache(budget + extra, 1, block_size, 1, 1, enable_prefix_caching=enable_prefix_caching,
                         prefix_cache=prefix_cache)
    chunked = {} if max_num_batched_tokens is None else {
        "max_num_batched_tokens": max_num_batched_tokens,
        "long_prefill_token_threshold": long_prefill_token_threshold}
    sched = (ChunkedScheduler if chunked else Scheduler)(
        cache, policy=policy, max_num_seqs=max_num_seqs, watermark=watermark, max_model_len=max_model_len,
        kv_budget_blocks=budget, sliding_window=sliding_window,
        token_ids=fake_token_ids if enable_prefix_caching else None, **chunked)
    for r in requests:
        sched.check(r)
    return sched


def simulate(requests: Sequence[Request], policy: str, kv_budget_blocks: int, block_size: int = 16, *,
             record_occupancy: bool = False, progress: bool = False, **options: Any) -> SimResult:
    """Serve ``requests`` under ``policy``, ``kv_budget_blocks`` blocks of ``block_size`` tokens, until every
    request has all its tokens. ``options``: ``new_scheduler``'s. ``record_occupancy`` keeps a picture of the
    pool at every step (steps x slots of memory: small runs only); ``progress`` shows a tqdm bar."""
    requests = list(requests)
    sched = new_scheduler(requests, policy, kv_budget_blocks, block_size, **options)
    return serve(sched, requests, record_occupancy, progress)


def _pool_picture(s: Scheduler) -> tuple[np.ndarray, np.ndarray]:
    """``owner`` (int32, -1 free) and ``filled`` (bool) for each slot of the budget, now."""
    bs, slots = s.block_size, s.kv_budget_blocks * s.block_size
    owner, filled = np.full(slots, -1, dtype=np.int32), np.zeros(slots, dtype=bool)
    for r in s.running:
        if isinstance(s.budget, SlabBudget):
            start, size = s.budget.slabs[r.req_id]
            at = np.arange(start, start + size)
        else:  # its blocks' slots, in token order
            at = (np.array(s.cache.tables[r.req_id], dtype=np.int64)[:, None] * bs + np.arange(bs)).ravel()
        owner[at], filled[at[:s.cache.seq_lens[r.req_id]]] = r.req_id, True
    return owner, filled


def serve(sched: Scheduler, requests: list[Request], occupancy: bool = False, progress: bool = False
          ) -> SimResult:
    """Serve ``requests`` by arrival with a scheduler from ``new_scheduler`` until every one has finished."""
    from tqdm.auto import tqdm
    rows, first, preempted, done, pictures, sampled = [], {}, Counter(), [], [], defaultdict(list)
    arrivals, step = deque(sorted(requests, key=lambda r: (r.arrival, r.req_id))), 0
    with tqdm(total=len(requests), disable=not progress, desc=sched.policy, unit="req") as bar:
        while arrivals or sched.has_unfinished:
            if not sched.has_unfinished:
                step = max(step, arrivals[0].arrival)  # idle: jump to the next arrival
            while arrivals and arrivals[0].arrival <= step:
                sched.add(arrivals.popleft())
            plan = sched.step()
            write_fake_kv(sched, plan)
            first.update((r.req_id, step) for r, _ in plan.prefill if r.req_id not in first)
            preempted.update(r.req_id for r in plan.preempted)
            for r in plan.scheduled:
                sampled[r.req_id].append(step)
            context = sum(sched.cache.seq_lens[r.req_id] for r in plan.decode + [r for r, _ in plan.prefill])
            rows.append({"step": step, "running": len(sched.running), "waiting": len(sched.waiting),
                         "preempted": len(plan.preempted), **slot_breakdown(sched, plan.blocked),
                         "free": free_slots(sched), "tokens": plan.num_tokens, "context": context})
            if occupancy:
                pictures.append((step, *_pool_picture(sched)))
            for r in [r for r in plan.scheduled if sched.generated[r.req_id] == r.output_len]:
                kv_len = sched.window_start[r.req_id] + sched.cache.seq_lens[r.req_id]
                done.append(RequestResult(r.req_id, r.arrival, first[r.req_id], step, r.output_len, kv_len,
                                          preempted[r.req_id], tuple(sampled.pop(r.req_id))))
                sched.finish(r)
                bar.update()
            step += 1
    return _result(sched, rows, done, pictures)


def _result(sched: Scheduler, rows: list[dict], done: list[RequestResult], pictures: list) -> SimResult:
    series = {k: np.array([row[k] for row in rows], dtype=np.int64) for k in SERIES}
    totals = {k: int(series[k].sum()) for k in CATEGORIES}
    breakdown = {k: v / max(1, sum(totals.values())) for k, v in totals.items()}
    slabs = ceil_div(sched.budget.used_slots, sched.block_size) if isinstance(sched.budget, SlabBudget) else 0
    running = series["running"]
    return SimResult(
        policy=sched.policy, block_size=sched.block_size, kv_budget_blocks=sched.kv_budget_blocks,
        steps=len(running), kv_utilization=breakdown["token"], breakdown=breakdown,
        mean_running=float(running.mean()) if len(running) else 0.0, peak_running=int(running.max(initial=0)),
        preemptions=sched.num_preemptions, recomputed_tokens=sched.recomputed_tokens,
        tokens_generated=sum(r.generated for r in done),
        mean_latency=float(np.mean([r.finished - r.arrival + 1 for r in done])) if done else 0.0,
        leaked_blocks=sched.cache.num_used_blocks + slabs, series=series, requests=sorted(done),
        occupancy=Occupancy(*map(np.stack, zip(*pictures))) if pictures else None,
        prefill_tokens=sched.prefill_tokens, cached_tokens=sched.cached_tokens,
        prefix_cache_hit_rate=sched.cache.prefix_cache_stats()["hit_rate"] if sched.token_ids else None)
