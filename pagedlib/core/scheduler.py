"""The step scheduler: continuous batching over a ``PagedKVCache`` under a token budget per step, like
vLLM V1's ``Scheduler`` and nano-vllm's. It decides what each step computes and **allocates** for it:
blocks, slots, prefix-cache hits, all before the model runs, which only reads the plan (``StepPlan.batch``).
With no budget (``max_num_batched_tokens=None``) a prompt runs whole in one step (notebooks 07, 08); with
one, prompts are cut into chunks (notebook 09). One thread.

Over a cache of several KV-cache groups (notebook 15) a request needs blocks in every group, and a sliding-
window group fewer as its blocks leave the window: admission, growth and preemption count them per group
as vLLM 0.32.0's ``KVCacheManager.allocate_slots`` does."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedlib.core import _scheduler_checks as checks
from pagedlib.core.blocks import Reservation, held
from pagedlib.core.cache import Batch, PagedKVCache
from pagedlib.core.connector import ConnectorMeta, KVConnector
from pagedlib.core.prefix_cache import BlockKey
from pagedlib.core.radix_cache import RadixCache
from pagedlib.core.request import Request, Status
from pagedlib.util import ceil_div


@dataclass
class StepCounts:
    """What a step's admissions found and lost, for the statistics (``EngineStats``, ``sim``)."""

    cached_tokens: int = 0  # found in the prefix cache
    connector_tokens: int = 0  # supplied by the connector (loaded, not computed: notebooks 13, 14)
    recomputed_tokens: int = 0  # K/V lost to earlier preemptions that this step computes again


@dataclass
class StepPlan:
    """What one step runs: the scheduler's decisions and allocations, before the model runs them."""

    # (request, new tokens) in scheduling order (running requests, then admissions): the forward pass's rows
    work: list[tuple[Request, int]] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)  # rows that feed a request's last sampled token
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # prompts, chunks, readmissions
    # requests whose new tokens reach their last: each samples one token
    sampling: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # lost their blocks; now first in the queue
    blocked: bool = False  # a waiting request was refused for lack of memory
    # admitted request id -> prompt tokens found (in the prefix cache, then through the connector)
    hits: dict[int, int] = field(default_factory=dict)
    # what the forward pass reads, a row per entry of ``work``: slots, tables, lengths, block copies
    batch: Batch = field(default_factory=lambda: Batch([], [], [], [], [], []))
    counts: StepCounts = field(default_factory=StepCounts)
    meta: ConnectorMeta | None = None  # the connector's transfers for the step, built as schedule() ends

    @property
    def num_tokens(self) -> int:  # new tokens of the step's forward pass
        return sum(n for _, n in self.work)


@dataclass
class Journal:
    """The open step's changes, newest last, to undo it: a ``Reservation``, or (request, its status before
    admission); the blocks it made findable before their K/V are written; the prefix cache's (queried,
    hit) counters before its lookups."""

    changes: list[Reservation | tuple[Request, Status]] = field(default_factory=list)
    registered: set[int] = field(default_factory=set)
    lookups: tuple[int, int] = (0, 0)


class Scheduler:
    """Continuous batching over ``cache``: running requests first, in admission order, then waiting ones in
    arrival order, while ``max_num_seqs``, the token budget and the blocks allow, with vLLM 0.32.0's rules:

    - ``full_prompt_must_fit`` (vLLM's ``scheduler_reserve_full_isl``, on by default): a request is admitted
      only if blocks for its whole current length fit, not just for its first chunk;
    - ``watermark``: the share of the blocks an admission leaves free, applied only while a request runs
      (vLLM's default 0.0; V0 kept 1%);
    - ``long_prefill_token_threshold``: the most tokens of one request a step takes, applied only while
      more than one request is running or waiting.

    Beyond its pool it knows one thing, a ``connector`` (``core.connector``; notebooks 13, 14): an admission
    asks it for the tokens after the prefix cache's hit and reserves blocks for what it offers; a preempted
    request is shown to it before its blocks go; ``schedule`` ends with the connector's meta for the step.
    The scheduler never reads or writes K/V: the engine runs the connector's copies around the forward pass.

    ``schedule`` makes a plan and takes its blocks; the caller runs it, then ``update``s (the step ran) or
    ``undo``es it (the step failed). Only one plan is open at a time; ``add`` is allowed while it is (the
    request waits for the next step), ``finish`` and ``abort`` are not."""

    def __init__(self, cache: PagedKVCache, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 watermark: float = 0.0, max_model_len: int = 2048,
                 full_prompt_must_fit: bool = True, connector: KVConnector | None = None) -> None:
        limits = checks.scheduler(cache, max_num_seqs, max_num_batched_tokens,
                                  long_prefill_token_threshold, watermark, max_model_len,
                                  full_prompt_must_fit, connector)
        if connector is not None:
            connector.bind(cache)
        self.connector = connector
        # the step's limits; chunk_cap: the most tokens of one request a step takes
        self.max_num_seqs, self.max_num_batched_tokens, self.chunk_cap, self.max_model_len = limits
        self.full_prompt_must_fit = full_prompt_must_fit
        self.cache = cache
        self.block_size = cache.block_size
        self.watermark_blocks = int(float(watermark) * cache.num_blocks)
        self.kv_budget_blocks = cache.num_blocks  # blocks the requests may fill: all of the cache's
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: preempt from the end
        self.requests: dict[int, Request] = {}  # every unfinished request, by id
        self.plan: StepPlan | None = None  # the plan made and not yet updated or undone
        self.journal = Journal()  # the open plan's changes
        self.cap: int | None = None  # this step's chunk cap

    def blocks_alone(self, request: Request) -> int:
        """Blocks ``request`` needs to run alone: the most it ever holds, every group together."""
        return self.blocks_of(request.max_kv_len, capped=True)

    def blocks_of(self, num_tokens: int, capped: bool, found: int = 0) -> int:
        """Blocks a new sequence of ``num_tokens`` tokens takes beyond the ``found`` cached ones of each
        group, every group together. ``capped``: a window group's at most what it can hold at once (its
        window, a step's tokens, a block more), the cap of vLLM 0.32.0's full-sequence admission test
        (``SlidingWindowSpec.max_admission_blocks_per_request``)."""
        blocks = ceil_div(num_tokens, self.block_size)
        step = self.max_num_batched_tokens  # the most tokens a step computes (vLLM's max_in_flight_tokens)
        if step is None:
            step = self.max_model_len
        total = 0
        for window in self.cache.manager.windows:
            if window is not None and capped:
                cap = ceil_div(min(window - 1 + step, self.max_model_len), self.block_size) + 1
                total += max(0, min(blocks, cap) - found)
            else:
                total += blocks - found
        return total

    check = checks.new_request  # ValueError unless the request is new, fits the model and, alone, the cache

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)
        self.requests[request.req_id] = request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> StepPlan:
        """Plan one step and take its blocks: running requests take their next tokens (preempting the newest
        while blocks are short); then, unless one was preempted, waiting requests are admitted; last, the
        connector's meta. If anything raises, the step's allocations and admissions are undone first (its
        preemptions stay)."""
        checks.no_open_plan(self)
        plan = StepPlan()
        if len(self.cache.groups) > 1:
            plan.batch.group_slots = [[] for _ in self.cache.groups]
            plan.batch.group_tables = [[] for _ in self.cache.groups]
        self.journal = Journal()
        if self.cache.prefix_cache is not None:
            prefix_cache = self.cache.prefix_cache
            self.journal.lookups = (prefix_cache.queried_tokens, prefix_cache.hit_tokens)
        self.cap = None  # vLLM: with one request eligible, nobody is left to starve
        if len(self.running) + len(self.waiting) > 1:
            self.cap = self.chunk_cap
        try:
            self.schedule_running(plan)
            if plan.preempted:
                plan.blocked = bool(self.waiting)
            else:
                self.schedule_waiting(plan)
            if self.connector is not None:
                plan.meta = self.connector.build_connector_meta(plan)
        except BaseException:
            self.rollback()
            raise
        self.plan = plan
        return plan

    def schedule_running(self, plan: StepPlan) -> None:
        """Give each running request, oldest first, its next tokens and their slots."""
        for request in list(self.running):
            n = self.chunk_size(plan, request.num_uncomputed_tokens)
            if n == 0 or request.status is not Status.RUNNING:
                break
            self.give_back(request)
            # the newest requests lose their blocks until this one's fit (it may be the newest)
            while self.blocks_for(request, n) > self.cache.num_free_blocks:
                plan.preempted.append(self.preempt())
                if request.status is not Status.RUNNING:
                    if self.cache.manager.has_window:
                        self.journal.changes.pop()  # its give-back: nothing of it is left to undo
                    return
            if request.num_uncomputed_tokens == 1 and request.output_tokens:  # then n is 1
                plan.decode.append(request)
            else:
                plan.prefill.append((request, n))
            self.allocate(plan, request, n)

    def give_back(self, request: Request) -> None:
        """``request``'s window groups give back the blocks wholly before its window before anything is
        counted, even if it or others are then preempted, as vLLM's ``allocate_slots`` frees them first (the
        order the pool's free queue then holds them in is vLLM's)."""
        if self.cache.manager.has_window:
            record = Reservation()
            self.cache.manager.give_back(request.req_id, record)
            self.journal.changes.append(record)

    def chunk_size(self, plan: StepPlan, uncomputed: int) -> int:
        """How many of ``uncomputed`` tokens fit in what the step's budget and the chunk cap leave."""
        n = uncomputed
        if self.max_num_batched_tokens is not None:
            n = min(n, self.max_num_batched_tokens - plan.num_tokens)
        if self.cap is not None:
            n = min(n, self.cap)
        return n

    def blocks_for(self, request: Request, n: int) -> int:
        """New blocks ``request`` takes to store ``n`` more tokens, less those its window groups give back
        first (vLLM's ``allocate_slots``: ``remove_skipped_blocks``, then ``get_num_blocks_to_allocate``)."""
        manager = self.cache.manager
        return manager.num_new_blocks(request.req_id, n) - manager.num_given_back(request.req_id)

    def allocate(self, plan: StepPlan, request: Request, n: int) -> None:
        """Reserve slots for ``n`` more tokens of ``request``: a row of the plan and of its batch. The blocks
        they fill become findable at once (vLLM registers a block when it schedules it)."""
        token_ids = None  # unknown for a simulated request (notebook 07's requests have lengths only)
        if request.prompt_tokens is not None:
            token_ids = request.next_token_ids(n)
        record = self.reserve(request, n, token_ids)
        plan.work.append((request, n))
        if n == request.num_uncomputed_tokens:
            plan.sampling.append(request)
        batch = plan.batch  # the row, with the table and length after this step
        batch.seq_ids.append(request.req_id)
        batch.token_ids.append(token_ids)
        batch.slots += record.slots
        batch.block_tables.append(list(self.cache.tables[request.req_id]))
        batch.seq_lens.append(self.cache.seq_lens[request.req_id])
        batch.copies += record.copies
        if batch.group_slots is not None and batch.group_tables is not None:  # several groups
            for g, tables in enumerate(self.cache.group_tables):
                batch.group_slots[g] += record.group_slots[g]
                batch.group_tables[g].append(list(tables[request.req_id]))

    def reserve(self, request: Request, n: int, token_ids: list[int] | None) -> Reservation:
        """Reserve ``n`` tokens of ``request`` after those it holds, in the journal."""
        record = self.cache.manager.reserve([request.req_id], [n], token_ids)
        self.journal.changes.append(record)
        self.journal.registered.update(record.registered)
        return record

    def preempt(self) -> Request:
        """Free the newest running request's blocks and queue it first again: its K/V will be computed
        again (less what the prefix cache or the connector, shown the blocks first, still supply)."""
        request = self.running[-1]
        if self.connector is not None:
            self.connector.handle_preemption(request, list(self.cache.tables[request.req_id]))
        request.lost_tokens = request.num_computed_tokens
        self.requeue(request, Status.PREEMPTED)
        return request

    def schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in arrival order while ``max_num_seqs``, the token budget and the
        blocks allow."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            if not self.admit(plan, self.waiting[0]):
                break

    def admit(self, plan: StepPlan, request: Request) -> bool:
        """Admit ``request`` with its first chunk, or say it must wait (no tokens left in the step, or too
        few blocks: ``plan.blocked``)."""
        checks.admissible(self, request)
        found, found_tokens, external = self.cached_prefix(request)
        n = self.chunk_size(plan, request.num_tokens - found_tokens)
        if n <= 0:
            return False
        if not self.fits(request, found, found_tokens + n):
            plan.blocked = True
            return False
        self.journal.changes.append((request, request.status))
        self.waiting.popleft()
        self.running.append(request)
        request.status = Status.RUNNING
        request.num_computed_tokens = self.attach(plan, request, external)
        self.count_found(plan, request, external)
        n = self.chunk_size(plan, request.num_uncomputed_tokens)
        plan.prefill.append((request, n))
        self.allocate(plan, request, n)
        return True

    def count_found(self, plan: StepPlan, request: Request, external: int) -> None:
        """Count what ``request``'s admission found: the tokens the prefix cache held, the ``external``
        ones the connector supplies (not num_computed_tokens: a window's attach counts skipped tokens too),
        and the lost tokens it computes again."""
        held = self.cache.seq_lens[request.req_id]
        plan.hits[request.req_id] = held
        plan.counts.cached_tokens += held - external
        plan.counts.connector_tokens += external
        plan.counts.recomputed_tokens += max(0, request.lost_tokens - held)

    def cached_prefix(self, request: Request) -> tuple[list[list[int]], int, int]:
        """The cached blocks ``attach`` will find for ``request`` in each KV-cache group (``find_cached``),
        the tokens found in all (the radix cache also copies part of a block, into one of the new blocks),
        and those the connector supplies after the blocks (vLLM's ``get_num_new_matched_tokens``, asked
        with the prefix cache's hit)."""
        prefix_cache = self.cache.prefix_cache
        found = [[] for _ in self.cache.groups]
        if prefix_cache is not None:
            found = self.cache.manager.find_cached(request.token_ids, self.prompt_keys(request))
        hit = len(found[0]) * self.block_size  # every group's list is as long
        external = 0
        if self.connector is not None:
            external = self.connector.get_num_new_matched_tokens(request, hit)
            checks.offered(external, request.num_tokens - 1 - hit)
        tokens = hit + external
        if isinstance(prefix_cache, RadixCache) and not external:
            tokens += prefix_cache.partial_match(request.token_ids, found[0], self.journal.registered)[1]
        return found, tokens, external

    def prompt_keys(self, request: Request) -> list[BlockKey] | None:
        """The block keys a hash-cache lookup walks for ``request``, made once per request (vLLM hashes a
        request's blocks as its tokens arrive); none for the radix tree, which walks token ids."""
        if isinstance(self.cache.prefix_cache, RadixCache):
            return None
        return request.block_keys(self.block_size, (request.num_tokens - 1) // self.block_size)

    def admission_tokens(self, request: Request) -> int:
        """The tokens ``full_prompt_must_fit`` counts for ``request``: its whole current length, outputs of a
        preempted one included, at most ``max_model_len``."""
        return min(request.num_tokens, self.max_model_len)

    def fits(self, request: Request, found: list[list[int]], num_tokens: int) -> bool:
        """vLLM 0.32.0's admission tests (``KVCacheManager.allocate_slots``): the blocks a sequence of
        ``num_tokens`` (the first chunk) takes beside the cached ones ``found`` in each group (a found block
        nobody holds leaves the free ones when attached), plus the watermark while anything runs, must be
        free; and with ``full_prompt_must_fit``, those of its whole current length, outputs of a preempted
        one included (a window group's capped at what it can hold at once). Every group's blocks count."""
        revived = sum(self.cache.ref_count(block) == 0 for blocks in found for block in held(blocks))
        tests = [self.blocks_of(num_tokens, capped=False, found=len(found[0]))]
        if self.full_prompt_must_fit:
            tests.append(self.blocks_of(self.admission_tokens(request), capped=True, found=len(found[0])))
        need = max(tests) + revived
        if self.running:
            need += self.watermark_blocks
        return need <= self.cache.num_free_blocks

    def attach(self, plan: StepPlan, request: Request, external: int) -> int:
        """Start ``request``'s sequence with the blocks the prefix cache finds, then blocks for the
        ``external`` tokens the connector loads before the forward pass: the tokens found."""
        manager = self.cache.manager
        if self.cache.prefix_cache is None:
            manager.add_sequence(request.req_id)
        else:
            manager.add_sequence(request.req_id, request.token_ids, self.prompt_keys(request))
        if external:
            start = self.cache.seq_lens[request.req_id]
            self.reserve(request, external, request.token_ids[start:start + external])
        if self.connector is not None:
            blocks = list(self.cache.tables[request.req_id])
            self.connector.update_state_after_alloc(request, blocks, external)
        if not external and self.cache.prefix_cache is not None:
            plan.batch.copies += manager.share_partial_block(request.req_id, request.token_ids,
                                                             self.journal.registered)
        return self.cache.seq_lens[request.req_id]

    def requeue(self, request: Request, status: Status) -> None:
        """Free ``request``'s blocks and queue it first again with ``status``, nothing computed: a
        preemption, or the undoing of an admission (perhaps interrupted before its sequence was added)."""
        self.free(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.num_computed_tokens = 0
        request.status = status

    def undo(self, plan: StepPlan) -> None:
        """The step of ``plan`` failed (its forward pass raised): every allocation, registration and admission
        it made is undone, so no block without its K/V can be found; its preemptions stay (the K/V those
        freed may be overwritten already). The next ``schedule`` plans the step again."""
        checks.open_plan(self, plan)
        self.rollback()
        self.plan = None

    def rollback(self) -> None:
        """Undo the journal, newest change first, and its admissions' lookups in the statistics."""
        changes = self.journal.changes
        while changes:
            entry = changes.pop()
            if isinstance(entry, Reservation):
                self.cache.manager.undo(entry)
            else:
                self.requeue(*entry)  # as it was
        if self.cache.prefix_cache is not None:
            self.cache.prefix_cache.queried_tokens, self.cache.prefix_cache.hit_tokens = self.journal.lookups

    def update(self, plan: StepPlan, sampled: list[int]) -> list[Request]:
        """The step of ``plan`` ran: ``sampled`` holds one token per row of ``plan.work``. Its K/V are written
        (the reservations are committed); count the computed tokens, append the tokens of the requests that
        sample, and finish those that have all their tokens (freeing their blocks). Returns the finished
        requests. A plan is taken once, and only the latest."""
        checks.open_plan(self, plan)
        sampled = checks.sampled(sampled, len(plan.work))
        for entry in self.journal.changes:
            if isinstance(entry, Reservation):
                self.cache.manager.commit(entry)
        self.journal = Journal()
        self.plan = None
        finished = []
        for (request, n), token in zip(plan.work, sampled):
            if n == request.num_uncomputed_tokens:
                request.output_tokens.append(token)
            request.num_computed_tokens += n
            if len(request.output_tokens) == request.output_len:
                self.finish(request)
                finished.append(request)
        return finished

    def finish(self, request: Request) -> None:
        """Forget ``request``: a running one gives its blocks back, a waiting one leaves the queue, and the
        connector forgets it. Between steps only (no plan open)."""
        checks.no_open_plan(self)
        checks.unfinished(self, request)
        if request.status is Status.RUNNING:
            self.free(request)
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        request.status = Status.FINISHED
        del self.requests[request.req_id]

    def abort(self, req_id: int) -> Request:
        """Drop request ``req_id`` whatever its state (waiting, running, preempted), freeing its blocks;
        between steps only (no plan open)."""
        request = checks.live_request(self, req_id)
        self.finish(request)
        return request

    def free(self, request: Request) -> None:
        """Give ``request``'s memory back."""
        if request.req_id in self.cache.seq_lens:
            self.cache.manager.free_sequence(request.req_id)
