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
- ``python -m pagedlib.bench serving`` prints the policy comparison table (``--json FILE``).

A request's life, in steps: admitted -> one prefill (writes the K/V of its prompt and samples the first
output token) -> one decode per step (writes the K/V of the last sampled token, samples the next) ->
finished once ``output_len`` tokens are sampled. Its K/V peak at ``prompt_len + output_len - 1`` tokens:
the last sampled token is never fed back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from pagedlib.checks import as_int, ceil_div
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.scheduler import CATEGORIES, Request, Scheduler, StepPlan, check_policy
from pagedlib.sim.workloads import fake_token_ids

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


