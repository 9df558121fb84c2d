"""vLLM's own hybrid KV-cache manager (0.32.0) driven without a model: the oracle of notebook 15's block
table per group.

``vllm_hybrid_run(groups, ops, block_size=..., num_blocks=...)`` builds vLLM's ``KVCacheManager`` over one
block pool for ``groups`` (``pagedlib.core.groups.KVGroup``: a ``FullAttentionSpec`` per full group, a
``SlidingWindowSpec`` per window group; two groups or more give vLLM's ``HybridKVCacheCoordinator``),
replays ``ops`` (``Add``, ``Allocate``, ``Preempt``, ``Free``) and returns, after each op, a ``HybridState``:
every live request's table in every group, the prefix-cache hit found on admission, and the free blocks.
``replay_schedule`` turns a run's schedule (``bridge.StepRecord`` s, from ``Engine`` or from vLLM) into ops
and returns the manager's own ``StepRecord`` s for it, which ``bridge.differences`` compares with the run's:
vLLM's tables for the engine's schedule, with no model in vLLM. Replaying what vLLM itself served on the tiny
hybrid model gives back its blocks step for step (``tests/test_vllm_hybrid.py``).

The manager runs in a child process (``python -m pagedlib.vllm.hybrid``, started by ``bridge.ask_vllm``):
importing ``vllm.v1.core.kv_cache_manager`` takes seconds, loads some 3,500 modules, sets
``TORCHINDUCTOR_COMPILE_THREADS`` and three more variables in the importing process and turns vLLM's Triton
use off there, so the caller's process never imports it.

Block ids: the pool has ``num_blocks + 1`` blocks, as the bridge builds vLLM's (``num_gpu_blocks_override``):
vLLM's block 0 is its null block, so vLLM's block ``b`` is reported as ``b - 1`` (pagedlib's ids
``0 .. num_blocks - 1``) and the null block, which stands in a window group's table for a block given back,
as ``NULL_BLOCK`` (-1).

The replay calls the manager in the order vLLM's ``Scheduler`` does (``vllm/v1/core/sched/scheduler.py``,
0.32.0, line numbers of the installed file):

- ``Add``: ``Request(name, prompt, ..., block_hasher=get_request_block_hasher(block_size, sha256))`` after
  ``init_none_hash(sha256)``, as ``EngineCore`` sets them up (``vllm/v1/engine/core.py`` 232-240; sha256 is
  ``CacheConfig.prefix_caching_hash_algo``'s default). Nothing is allocated.
- ``Allocate(name, budget, token)``: one step of that request. ``new_step_starts()`` (632); a request with no
  computed tokens (new or preempted) is looked up first, ``get_computed_blocks`` (960-966, through
  ``_get_local_prefix_cache_hit`` 558-567) with ``request.shared_prefix_boundary`` set from its answer, and
  admitted by ``allocate_slots(request, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
  full_sequence_must_fit=..., has_scheduled_reqs=...)`` (1256-1275); ``n = min(budget, num_tokens -
  hit)`` (1129); then ``num_computed_tokens = hit`` (1369). A running request gets ``allocate_slots(request,
  n)`` (778-782), ``n = min(budget, num_tokens - num_computed_tokens)`` (703-712). If the manager answers
  ``None`` nothing more happens (the scheduler would preempt or wait; ``Preempt`` does the first). Else the
  step is taken: ``num_computed_tokens += n`` and ``num_in_flight_tokens += n`` (1629-1630), then
  ``num_in_flight_tokens -= n`` (2082) and, if the step computed the last known token, ``token`` is appended
  as the sampled one (``append_output_token_ids``, 2502), which hashes any block it fills.
- ``Preempt(name)``: ``free`` and ``num_computed_tokens = 0`` (``_preempt_request`` 1571-1593).
- ``Free(name)``: ``free`` (``_free_request_blocks`` 2766-2771), the request forgotten.

A window group gives blocks back inside ``allocate_slots`` (``vllm/v1/core/kv_cache_manager.py`` 555-559:
``remove_skipped_blocks`` on the tokens computed before the step, before it allocates), so a prompt computed
in one step holds every block of it until its next step, and an ``Allocate`` the manager refuses may still
give window blocks back.

``retention_interval`` is vLLM's ``prefix_cache_retention_interval`` (``vllm/config/cache.py`` 159). ``0``,
the default of ``vllm serve`` and ``LLM``, caches a window group's blocks sparsely: only the window's blocks
before the prompt's last block boundary (its "replay boundary", ``num_prompt_tokens - 1`` aligned down) and
before a shared-prefix junction the lookup found (``SlidingWindowManager.reachable_block_mask``). ``None``
(``KVCacheConfig``'s own default) caches every full block, as a full group does. The hybrid hit is the
longest prefix every group serves (``HybridKVCacheCoordinator.find_longest_cache_hit``), so under ``0`` a
prompt that leaves a cached one before that one's kept window hits 0 tokens, though its full group alone
would serve the shared blocks (the trap of vLLM issue #45238, there with Mamba checkpoints). The lookup
pins that shared prefix (``shared_prefix_boundary``), so the prompt's own window there is kept and a third
prompt sharing it hits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedlib.child import serve
from pagedlib.core.groups import FULL, LAYER_KINDS, NULL_BLOCK, SLIDING, KVGroup
from pagedlib.util import as_int, refuse
from pagedlib.vllm.bridge import Arrival, StepRecord, ask_vllm

CHILD_MODULE = "pagedlib.vllm.hybrid"    # the child (``python -m``): this file
SERVE_RETENTION = 0       # vLLM 0.32.0's ``CacheConfig.prefix_cache_retention_interval`` default


@dataclass(frozen=True)
class Add:
    """A request arrives with ``prompt`` (token ids); it holds no block until its first ``Allocate``."""

    name: str
    prompt: list[int]


@dataclass(frozen=True)
class Allocate:
    """One step of request ``name``: slots for at most ``budget`` new tokens (a new or preempted request is
    looked up in the prefix cache first, and its hit is not scheduled). ``token``: the token sampled if the
    step computes the request's last known token (then required), appended to it as vLLM's scheduler does."""

    name: str
    budget: int
    token: int | None = None


@dataclass(frozen=True)
class Preempt:
    """Request ``name`` gives every block back and starts again from no computed token (looked up anew)."""

    name: str


@dataclass(frozen=True)
class Free:
    """Request ``name`` finished: its blocks go back to the pool (cached ones stay findable)."""

    name: str


Op = Add | Allocate | Preempt | Free


@dataclass
class HybridState:
    """The manager after one op. ``tables``: per live request, its table in each group (pagedlib's block
    ids, ``NULL_BLOCK`` for a block given back or never held); ``hit``: the tokens the prefix cache served
    (an ``Allocate`` that looked the request up, else None); ``group_hits``: with it, what each group alone
    would serve (``find_longest_cache_hit_per_group``; ``hit`` is at most their minimum); ``scheduled``:
    the tokens the step computed (0 if refused or no ``Allocate``); ``allocated``: False if
    ``allocate_slots`` refused the step; ``free_blocks``: the pool's free blocks (cached ones included, the
    null block not); ``cached_free_blocks``: of those, the ones a lookup can find."""

    tables: dict[str, list[list[int]]] = field(default_factory=dict)
    hit: int | None = None
    group_hits: list[int] | None = None
    scheduled: int = 0
    allocated: bool = True
    free_blocks: int = 0
    cached_free_blocks: int = 0

    def held(self, name: str) -> list[int]:
        """Blocks request ``name`` holds per group, null entries apart."""
        return [sum(block != NULL_BLOCK for block in table) for table in self.tables[name]]


def vllm_hybrid_run(groups: Sequence[KVGroup], ops: Sequence[Op], *, block_size: int, num_blocks: int,
                    enable_prefix_caching: bool = True, retention_interval: int | None = SERVE_RETENTION,
                    full_sequence_must_fit: bool = True, max_model_len: int | None = None,
                    max_num_batched_tokens: int = 2048, timeout: float = 300.0) -> list[HybridState]:
    """The ``HybridState`` after each of ``ops``, replayed on a fresh vLLM ``KVCacheManager`` (module
    docstring) over ``groups`` and a pool of ``num_blocks`` blocks of ``block_size`` tokens.

    ``retention_interval``: vLLM's ``prefix_cache_retention_interval`` (0: what vLLM serves with; None:
    every full block cached). ``full_sequence_must_fit``: vLLM's ``scheduler_reserve_full_isl`` (admit only
    if the whole request fits). ``max_model_len``: default, the pool's tokens. ``max_num_batched_tokens``:
    vLLM's budget, which sizes a window group's admission cap (``max_in_flight_tokens``).
    ``ValueError`` (nothing run) for bad settings or ops; ``RuntimeError`` where vLLM is missing or fails."""
    return vllm_hybrid_runs([dict(groups=groups, ops=ops, block_size=block_size, num_blocks=num_blocks,
                                  enable_prefix_caching=enable_prefix_caching,
                                  retention_interval=retention_interval,
                                  full_sequence_must_fit=full_sequence_must_fit, max_model_len=max_model_len,
                                  max_num_batched_tokens=max_num_batched_tokens)], timeout)[0]


def vllm_hybrid_runs(runs: Sequence[dict[str, Any]], timeout: float = 300.0) -> list[list[HybridState]]:
    """``vllm_hybrid_run`` for each of ``runs`` (its keyword arguments, ``groups`` and ``ops`` included), each
    on a fresh manager, all in one child process (vLLM's import takes most of the time)."""
    jobs = [_job(number, **run) for number, run in enumerate(runs)]
    answer = ask_vllm(CHILD_MODULE, jobs, "ops", "vLLM's KV-cache manager", timeout)
    return [[HybridState(**state) for state in run] for run in answer]


def schedule_ops(workload: Sequence[Arrival], records: Sequence[StepRecord],
                 tokens: dict[str, list[int]]) -> tuple[list[Op], list[int]]:
    """The ops that replay a run's schedule (``records``, from either engine, and the ``tokens`` each request
    generated) on the manager, and after each step the number of ops it ends at. Per step: the arrivals
    (``Add``); the preemptions (``Preempt``: first, where vLLM preempts inside its loop, once a running
    request's allocation fails, so freed blocks may queue in another order); one ``Allocate`` per request in
    the order of ``record.scheduled`` (vLLM's: running requests, then admitted ones), the tokens it computed
    as its budget; ``Free`` for the finished."""
    pending = sorted(workload, key=lambda arrival: arrival.step)
    known = {arrival.name: len(arrival.prompt) for arrival in workload}      # tokens each request holds
    computed: dict[str, int] = {}
    ops: list[Op] = []
    ends = []
    for step, record in enumerate(records):
        while pending and pending[0].step <= step:
            arrival = pending.pop(0)
            ops.append(Add(arrival.name, list(arrival.prompt)))
        for name in record.preempted:
            ops.append(Preempt(name))
            computed[name] = 0
        for name, n in record.scheduled.items():
            computed[name] = record.hits.get(name, computed.get(name, 0)) + n
            token = None
            if computed[name] == known[name]:          # the step samples the request's next token
                token = tokens[name][known[name] - len(_prompt(workload, name))]
                known[name] += 1
            ops.append(Allocate(name, n, token))
        ops += [Free(name) for name in record.finished]
        ends.append(len(ops))
    return ops, ends


def _prompt(workload: Sequence[Arrival], name: str) -> list[int]:
    return next(arrival.prompt for arrival in workload if arrival.name == name)


def replay_schedule(groups: Sequence[KVGroup], workload: Sequence[Arrival], records: Sequence[StepRecord],
                    tokens: dict[str, list[int]], **settings: Any) -> list[StepRecord]:
    """vLLM's manager stepped through a run's schedule (``schedule_ops``): per step a ``StepRecord`` with
    its requests' tables per group (``group_blocks``; ``blocks`` is group 0's), the hits it found, and its
    free blocks; ``scheduled``, ``preempted`` and ``finished`` copied from ``records``. ``bridge.differences``
    compares it with ``records``. ``settings``: ``vllm_hybrid_run``'s (``block_size`` and ``num_blocks``
    at least)."""
    ops, ends = schedule_ops(workload, records, tokens)
    states = vllm_hybrid_run(groups, ops, **settings)
    out = []
    start = 0
    for record, end in zip(records, ends):
        hits = {op.name: state.hit for op, state in zip(ops[start:end], states[start:end])
                if isinstance(op, Allocate) and state.hit is not None and state.allocated}
        last = states[end - 1] if end else HybridState()
        held = {name: tables for name, tables in last.tables.items() if any(tables)}
        out.append(StepRecord(scheduled=dict(record.scheduled), hits=hits,
                              blocks={name: tables[0] for name, tables in held.items()},
                              group_blocks=held if len(groups) > 1 else {}, free_blocks=last.free_blocks,
                              cached_free_blocks=last.cached_free_blocks, preempted=list(record.preempted),
                              finished=list(record.finished)))
        start = end
    return out


def _job(number: int, groups: Sequence[KVGroup], ops: Sequence[Op], block_size: int, num_blocks: int,
         enable_prefix_caching: bool = True, retention_interval: int | None = SERVE_RETENTION,
         full_sequence_must_fit: bool = True, max_model_len: int | None = None,
         max_num_batched_tokens: int = 2048) -> dict[str, Any]:
    """Run ``number``'s settings checked and made JSON (``ValueError`` naming the argument)."""
    block_size = as_int("block_size", block_size, minimum=1)
    num_blocks = as_int("num_blocks", num_blocks, minimum=1)
    max_model_len = num_blocks * block_size if max_model_len is None else max_model_len
    as_int("max_model_len", max_model_len, minimum=1)
    as_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
    if retention_interval is not None:
        as_int("retention_interval", retention_interval, minimum=0)
        refuse((retention_interval % block_size, f"retention_interval={retention_interval} must be a "
                                                  f"multiple of block_size={block_size} (vLLM's rule)"))
    if not groups:
        raise ValueError("groups must hold at least one KVGroup")
    specs = []
    for group in groups:
        if not isinstance(group, KVGroup):
            raise TypeError(f"groups must hold KVGroup objects, got {type(group).__name__}")
        refuse((group.kind not in LAYER_KINDS, f"groups: kind {group.kind!r} is not one of {LAYER_KINDS}"),
               (group.kind == SLIDING and (group.window is None or group.window < 1),
                f"groups: a {SLIDING} group needs a window >= 1, got {group.window!r}"),
               (group.kind == FULL and group.window is not None,
                f"groups: a {FULL} group has no window, got {group.window!r}"))
        specs.append({"kind": group.kind, "window": group.window, "layers": list(group.layers)})
    return {"groups": specs, "ops": _checked_ops(number, ops), "block_size": block_size,
            "num_blocks": num_blocks, "enable_prefix_caching": bool(enable_prefix_caching),
            "retention_interval": retention_interval, "full_sequence_must_fit": bool(full_sequence_must_fit),
            "max_model_len": max_model_len, "max_num_batched_tokens": max_num_batched_tokens}


def _checked_ops(number: int, ops: Sequence[Op]) -> list[dict[str, Any]]:
    """``ops`` as JSON, each naming a live request (added and not freed), new names for ``Add``."""
    live: set[str] = set()
    out = []
    for i, op in enumerate(ops):
        where = f"run {number} op {i} ({type(op).__name__})"
        if not isinstance(op, (Add, Allocate, Preempt, Free)):
            raise TypeError(f"{where}: ops must be Add, Allocate, Preempt or Free, got {type(op).__name__}")
        if isinstance(op, Add):
            refuse((op.name in live, f"{where}: request {op.name!r} is live already"),
                   (not op.prompt, f"{where}: request {op.name!r} has an empty prompt"))
            for token in op.prompt:
                as_int(f"{where}: prompt token", token, minimum=0)
            live.add(op.name)
        elif op.name not in live:
            raise ValueError(f"{where}: request {op.name!r} is not live (never added, or freed)")
        if isinstance(op, Allocate):
            as_int(f"{where}: budget", op.budget, minimum=1)
            if op.token is not None:
                as_int(f"{where}: token", op.token, minimum=0)
        if isinstance(op, Free):
            live.discard(op.name)
        out.append({"op": type(op).__name__, **asdict(op)})
    return out


# ---- the child's side ------------------------------------------------------------------------------------

def build_manager(job: dict[str, Any]) -> tuple[Any, Any]:
    """Run in the child: vLLM's ``KVCacheManager`` for ``job`` (as ``Scheduler.__init__`` builds it, 328-346)
    and the block hasher its requests carry."""
    import torch
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    block_size = job["block_size"]
    specs = []
    for group in job["groups"]:        # the manager reads block size and window only: the shape is nominal
        shape = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        spec = (FullAttentionSpec(**shape) if group["kind"] == FULL
                else SlidingWindowSpec(**shape, sliding_window=group["window"]))
        specs.append(KVCacheGroupSpec([f"model.layers.{layer}.self_attn" for layer in group["layers"]], spec))
    config = KVCacheConfig(num_blocks=job["num_blocks"] + 1, kv_cache_tensors=[], kv_cache_groups=specs,
                           prefix_cache_retention_interval=job["retention_interval"])
    manager = KVCacheManager(config, max_model_len=job["max_model_len"],
                             max_in_flight_tokens=job["max_num_batched_tokens"],
                             enable_caching=job["enable_prefix_caching"], scheduler_block_size=block_size,
                             hash_block_size=block_size)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return manager, get_request_block_hasher(block_size, hash_fn)


def replay(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Run in the child: the state after each of ``job``'s ops (module docstring: the scheduler's order)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    manager, hasher = build_manager(job)
    requests: dict[str, Any] = {}
    states = []
    for i, op in enumerate(job["ops"]):
        state: dict[str, Any] = {"hit": None, "scheduled": 0, "allocated": True}
        if op["op"] == "Add":
            requests[op["name"]] = Request(op["name"], list(op["prompt"]), SamplingParams(max_tokens=1 << 30),
                                           None, block_hasher=hasher)
        elif op["op"] == "Allocate":
            state.update(_allocate(manager, requests, op, job, i))
        elif op["op"] == "Preempt":
            request = requests[op["name"]]
            manager.free(request)
            request.status, request.num_computed_tokens = RequestStatus.PREEMPTED, 0
            request.num_preemptions += 1
        else:
            manager.free(requests.pop(op["name"]))
        states.append(state | _snapshot(manager, requests))
    return states


def _allocate(manager: Any, requests: dict[str, Any], op: dict[str, Any], job: dict[str, Any],
              i: int) -> dict[str, Any]:
    """Run in the child: one ``Allocate`` (module docstring), its ``hit``, ``scheduled`` and ``allocated``."""
    from vllm.v1.request import RequestStatus

    request = requests[op["name"]]
    manager.new_step_starts()
    answer: dict[str, Any] = {}
    if request.num_computed_tokens == 0:                     # new or preempted: look it up, then admit
        answer["group_hits"] = _group_hits(manager, request)
        blocks, hit, request.shared_prefix_boundary = manager.get_computed_blocks(request)
        answer["hit"] = hit
        n = min(op["budget"], request.num_tokens - hit)
        new = manager.allocate_slots(request, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                     full_sequence_must_fit=job["full_sequence_must_fit"],
                                     has_scheduled_reqs=any(other.status == RequestStatus.RUNNING
                                                            for other in requests.values()))
        if new is not None:
            request.status, request.num_computed_tokens = RequestStatus.RUNNING, hit
    else:
        n = min(op["budget"], request.num_tokens - request.num_computed_tokens)
        new = manager.allocate_slots(request, n)
    if new is None:
        return answer | {"allocated": False}
    request.num_computed_tokens += n
    request.num_in_flight_tokens += n
    request.num_in_flight_tokens -= n                        # the step's output returns (synchronous engine)
    if request.num_computed_tokens == request.num_tokens:    # the step computed the last known token
        if op["token"] is None:
            raise ValueError(f"op {i} (Allocate {request.request_id!r}) computes the request's last known "
                             f"token: give the token sampled there (token=)")
        request.append_output_token_ids(op["token"])
    return answer | {"scheduled": n}


def _group_hits(manager: Any, request: Any) -> list[int]:
    """Run in the child: the tokens each group alone would serve ``request`` (a read-only lookup the
    scheduler does not make: ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``, capped at
    ``num_tokens - 1`` as ``get_computed_blocks`` caps the hybrid one)."""
    groups = manager.num_kv_cache_groups
    if not manager.prefix_cache_lookup_enabled(request):
        return [0] * groups
    if groups == 1:
        return [manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)[1]]
    return list(manager.coordinator.find_longest_cache_hit_per_group(request.block_hashes,
                                                                      request.num_tokens - 1)[1])


def _snapshot(manager: Any, requests: dict[str, Any]) -> dict[str, Any]:
    """Run in the child: every live request's tables (pagedlib's ids) and the pool's free blocks."""
    pool = manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    tables = {name: [[NULL_BLOCK if block.is_null else block.block_id - 1 for block in group]
                     for group in manager.coordinator.get_blocks(name)] for name in requests}
    return {"tables": tables, "free_blocks": pool.get_num_free_blocks(),
            "cached_free_blocks": sum(block.block_hash is not None for block in free)}


def answer(jobs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Run in the child: each run's states (``serve`` keeps whatever vLLM prints out of the answer)."""
    return [replay(job) for job in jobs]


if __name__ == "__main__":
    serve(answer)
