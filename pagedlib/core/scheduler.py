"""The step scheduler: continuous batching over a ``PagedKVCache`` under a token budget per step, like
vLLM V1's ``Scheduler`` and nano-vllm's. It decides what each step computes and **allocates** for it:
blocks, slots, prefix-cache hits, all before the model runs, which only reads the plan (``StepPlan.batch``).
With no budget (``max_num_batched_tokens=None``) a prompt runs whole in one step (notebooks 07, 08); with
one, prompts are cut into chunks (notebook 09). One thread."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedlib.core import _scheduler_checks as checks
from pagedlib.core.blocks import Reservation
from pagedlib.core.cache import Batch, PagedKVCache
from pagedlib.core.connector import ConnectorMeta, KVConnector
from pagedlib.core.host_tier import HostTier
from pagedlib.core.radix_cache import RadixCache
from pagedlib.core.request import Request, Status
from pagedlib.util import ceil_div


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
    # admitted request id -> prompt tokens found cached (in the prefix cache, then the host tier)
    hits: dict[int, int] = field(default_factory=dict)
    cached_tokens: int = 0  # tokens this step's admissions found in the prefix cache
    recomputed_tokens: int = 0  # K/V lost to earlier preemptions that this step's admissions compute again
    # what the forward pass reads, a row per entry of ``work``: slots, tables, lengths, block copies
    batch: Batch = field(default_factory=lambda: Batch([], [], [], [], [], []))
    # the step's changes in order, to undo it: a Reservation, or (request, its status before admission)
    journal: list[Reservation | tuple[Request, Status]] = field(default_factory=list)
    registered: set[int] = field(default_factory=set)  # blocks made findable, K/V not yet written
    lookups: tuple[int, int] = (0, 0)  # the prefix cache's (queried, hit) tokens before the step's lookups
    host_hit_tokens: int = 0  # tokens this step's admissions found in the host tier (copied back)
    swapped_in: list[Request] = field(default_factory=list)  # readmitted with their swapped blocks
    restored: dict[int, int] = field(default_factory=dict)  # request id -> tokens those blocks gave back
    stored: bool = False  # its computed blocks went to the host tier (``Scheduler.store_computed``)
    connector_tokens: int = 0  # tokens this step's admissions load through the connector (notebook 14)
    meta: ConnectorMeta | None = None  # the connector's loads and saves, once built (``load_external``)

    @property
    def num_tokens(self) -> int:  # new tokens of the step's forward pass
        return sum(n for _, n in self.work)

    @property
    def swapped_in_tokens(self) -> int:  # copied back from the host tier, not recomputed
        return sum(self.restored.values())


class Scheduler:
    """Continuous batching over ``cache``: running requests first, in admission order, then waiting ones in
    arrival order, while ``max_num_seqs``, the token budget and the blocks allow, with vLLM 0.32.0's rules:

    - ``full_prompt_must_fit`` (vLLM's ``scheduler_reserve_full_isl``, on by default): a request is admitted
      only if blocks for its whole current length fit, not just for its first chunk;
    - ``watermark``: the share of the blocks an admission leaves free, applied only while a request runs
      (vLLM's default 0.0; V0 kept 1%);
    - ``long_prefill_token_threshold``: the most tokens of one request a step takes, applied only while
      more than one request is running or waiting.

    With a ``host`` tier (notebook 13) an admission looks the blocks after the prefix cache's hits up there
    too, and copies those found into new blocks; full blocks are stored there as ``host.write`` says; and
    ``preemption="swap"`` copies a victim's blocks there instead of dropping them, falling back to
    recomputation when the tier has no room. With a ``connector`` (notebook 14) an admission asks it for the
    blocks after the prefix cache's hits, reserves blocks for what it offers, and the engine has them loaded
    before the forward pass and the step's full blocks saved after it.

    ``schedule`` makes a plan and takes its blocks; the caller runs it, then ``update``s (the step ran) or
    ``undo``es it (the step failed). Only one plan is open at a time."""

    def __init__(self, cache: PagedKVCache, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 watermark: float = 0.0, max_model_len: int = 2048,
                 full_prompt_must_fit: bool = True, host: HostTier | None = None,
                 preemption: str = "recompute", connector: KVConnector | None = None) -> None:
        limits = checks.scheduler(cache, max_num_seqs, max_num_batched_tokens,
                                  long_prefill_token_threshold, watermark, max_model_len,
                                  full_prompt_must_fit)
        checks.host(cache, host, preemption)
        checks.connector(cache, host, connector)
        self.host = host
        self.connector = connector
        self.preemption = preemption
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
        self.cap: int | None = None  # this step's chunk cap
        if host is not None and host.write == "victim":
            cache.manager.on_evict = self.save_victim

    def blocks_alone(self, request: Request) -> int:
        """Blocks ``request`` needs to run alone: the most it ever holds."""
        return ceil_div(request.max_kv_len, self.block_size)

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
        while blocks are short); then, unless one was preempted, waiting requests are admitted. If anything
        raises, the step's allocations and admissions are undone first (its preemptions stay)."""
        checks.no_open_plan(self)
        plan = StepPlan()
        if self.cache.prefix_cache is not None:
            plan.lookups = (self.cache.prefix_cache.queried_tokens, self.cache.prefix_cache.hit_tokens)
        self.cap = None  # vLLM: with one request eligible, nobody is left to starve
        if len(self.running) + len(self.waiting) > 1:
            self.cap = self.chunk_cap
        try:
            self.schedule_running(plan)
            if plan.preempted:
                plan.blocked = bool(self.waiting)
            else:
                self.schedule_waiting(plan)
        except BaseException:
            self.rollback(plan)
            raise
        self.plan = plan
        return plan

    def schedule_running(self, plan: StepPlan) -> None:
        """Give each running request, oldest first, its next tokens and their slots."""
        for request in list(self.running):
            n = self.chunk_size(plan, request.num_uncomputed_tokens)
            if n == 0 or request.status is not Status.RUNNING:
                break
            # the newest requests lose their blocks until this one's fit (it may be the newest)
            while self.blocks_for(request, n) > self.cache.num_free_blocks:
                plan.preempted.append(self.preempt())
                if request.status is not Status.RUNNING:
                    return
            if request.num_uncomputed_tokens == 1 and request.output_tokens:  # then n is 1
                plan.decode.append(request)
            else:
                plan.prefill.append((request, n))
            self.allocate(plan, request, n)

    def chunk_size(self, plan: StepPlan, uncomputed: int) -> int:
        """How many of ``uncomputed`` tokens fit in what the step's budget and the chunk cap leave."""
        n = uncomputed
        if self.max_num_batched_tokens is not None:
            n = min(n, self.max_num_batched_tokens - plan.num_tokens)
        if self.cap is not None:
            n = min(n, self.cap)
        return n

    def blocks_for(self, request: Request, n: int) -> int:
        """New blocks ``request`` takes to store ``n`` more tokens."""
        held = self.cache.seq_lens[request.req_id]
        return ceil_div(held + n, self.block_size) - ceil_div(held, self.block_size)

    def allocate(self, plan: StepPlan, request: Request, n: int) -> None:
        """Reserve slots for ``n`` more tokens of ``request``: a row of the plan and of its batch. The blocks
        they fill become findable at once (vLLM registers a block when it schedules it)."""
        token_ids = None  # unknown for a simulated request (notebook 07's requests have lengths only)
        if request.prompt_tokens is not None:
            token_ids = request.next_token_ids(n)
        record = self.cache.manager.reserve([request.req_id], [n], token_ids)
        plan.journal.append(record)
        plan.registered.update(record.registered)
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

    def preempt(self) -> Request:
        """Free the newest running request's blocks and queue it first again: its K/V will be
        computed again (less what the prefix cache still finds), or, swapped, copied back."""
        request = self.running[-1]
        if self.preemption == "swap" and self.swap_out(request):
            return request
        if self.host is not None and self.preemption == "swap":
            self.host.swap_fallbacks += 1
        request.lost_tokens = request.num_computed_tokens
        self.requeue(request, Status.PREEMPTED)
        return request

    def swap_out(self, request: Request) -> bool:
        """Copy every block of ``request`` into host slots and free them: ``False`` (nothing changed) if the
        tier cannot make room for them all."""
        host = self.host
        table = self.cache.tables[request.req_id]
        slots = host.cache.take_slots(len(table))
        if slots is None:
            return False
        try:
            host.save(self.cache.pool, table, slots)
        except BaseException:
            host.cache.give_slots(slots)
            raise
        host.swapped_out_blocks += len(slots)
        request.swapped = slots
        tokens = request.num_computed_tokens
        self.requeue(request, Status.PREEMPTED)
        request.num_computed_tokens = request.swapped_tokens = tokens
        return True

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
        found, found_tokens, loads = self.cached_prefix(request, plan)
        n = self.chunk_size(plan, request.num_tokens - found_tokens)
        if n <= 0:
            return False
        num_tokens = found_tokens + n
        if self.full_prompt_must_fit:  # vLLM: the whole current length, outputs of a preempted one included
            num_tokens = max(num_tokens, min(request.num_tokens, self.max_model_len))
        if not self.fits(request, found, num_tokens):
            plan.blocked = True
            return False
        plan.journal.append((request, request.status))
        self.waiting.popleft()
        self.running.append(request)
        request.status = Status.RUNNING
        request.num_computed_tokens = self.attach(plan, request, loads)
        self.count_found(plan, request, loads)
        n = self.chunk_size(plan, request.num_uncomputed_tokens)
        plan.prefill.append((request, n))
        self.allocate(plan, request, n)
        return True

    def count_found(self, plan: StepPlan, request: Request, loads: list) -> None:
        """Count what ``request``'s admission found: the tokens the prefix cache held, then the host tier's
        ``loads`` (not num_computed_tokens: a window's attach counts skipped tokens too, a swapped request's
        its own blocks copied back), and the lost tokens it computes again."""
        held = self.cache.seq_lens[request.req_id] - plan.restored.get(request.req_id, 0)
        external = len(loads) * self.block_size  # from the host tier or the connector
        plan.hits[request.req_id] = held
        plan.cached_tokens += held - external
        if self.connector is not None:
            plan.connector_tokens += external
        else:
            plan.host_hit_tokens += external
        plan.recomputed_tokens += max(0, request.lost_tokens - held)

    def cached_prefix(self, request: Request, plan: StepPlan) -> tuple[list[int], int, list]:
        """The cached blocks ``attach`` will find for ``request``, the tokens they hold (the radix cache
        also copies part of a block, into one of the new blocks), and the host tier's keys of the full blocks
        after them it will copy back. A swapped request finds its own tokens after the prefix cache's hits.
        Changes nothing."""
        prefix_cache = self.cache.prefix_cache
        found: list[int] = []
        if prefix_cache is not None:
            found = prefix_cache.peek(request.token_ids)
        if request.swapped is not None:
            return found, max(len(found) * self.block_size, request.swapped_tokens), []
        if self.connector is not None:
            loads = self.connector_prefix(request, len(found))
        else:
            loads = self.host_prefix(request, len(found))
        tokens = (len(found) + len(loads)) * self.block_size
        if isinstance(prefix_cache, RadixCache) and not loads:
            tokens += prefix_cache.partial_match(request.token_ids, found, plan.registered)[1]
        return found, tokens, loads

    def host_prefix(self, request: Request, start: int) -> list:
        """The keys of the full blocks from block ``start`` on that the host tier holds, to the first miss
        (at most up to the block holding the last prompt token: it is computed for its logits)."""
        host = self.host
        if host is None or host.write == "none" or request.prompt_tokens is None:
            return []
        token_ids = request.token_ids
        keys = host.block_keys(request.req_id, token_ids, (len(token_ids) - 1) // self.block_size,
                               self.block_size)[start:]
        return keys[:host.cache.peek(keys)]

    def connector_prefix(self, request: Request, start: int) -> list[int]:
        """The indices of the full blocks from block ``start`` on that the connector can load (vLLM's
        ``get_num_new_matched_tokens``, asked with the prefix cache's hit)."""
        offered = self.connector.get_num_new_matched_tokens(request, start * self.block_size)
        most = max(0, (request.num_tokens - 1) // self.block_size - start)
        checks.offered(offered, self.block_size, most)
        return list(range(start, start + offered // self.block_size))

    def fits(self, request: Request, found: list[int], num_tokens: int) -> bool:
        """vLLM 0.32.0's admission test (``KVCacheManager.allocate_slots``): the blocks a sequence of
        ``num_tokens`` takes beside the cached ``found`` (a found block nobody holds leaves the free ones when
        attached), plus the watermark while anything runs, must be free."""
        revived = sum(self.cache.ref_count(block) == 0 for block in found)
        need = ceil_div(num_tokens, self.block_size) - len(found) + revived
        if self.running:
            need += self.watermark_blocks
        return need <= self.cache.num_free_blocks

    def attach(self, plan: StepPlan, request: Request, loads: list) -> int:
        """Start ``request``'s sequence with the blocks the prefix cache finds, then the host tier's
        ``loads`` (or its swapped blocks) copied into new blocks: the tokens found."""
        manager = self.cache.manager
        if self.cache.prefix_cache is None:
            manager.add_sequence(request.req_id)
        else:
            manager.add_sequence(request.req_id, request.token_ids)
        if request.swapped is not None:  # the blocks after the prefix cache's hits come back from the host
            start = self.cache.seq_lens[request.req_id]
            if start < request.swapped_tokens:
                slots = request.swapped[start // self.block_size:]
                self.copy_in(plan, request, request.swapped_tokens - start, slots)
                self.host.swapped_in_blocks += len(slots)
                plan.restored[request.req_id] = request.swapped_tokens - start
            plan.swapped_in.append(request)
            return self.cache.seq_lens[request.req_id]
        host = self.host
        if host is not None and host.write != "none" and request.prompt_tokens is not None:
            # host_prefix's lookup, counted once admitted: the full blocks after the prefix cache's hits
            found = self.cache.seq_lens[request.req_id] // self.block_size
            asked = (request.num_tokens - 1) // self.block_size - found
            host.cache.count(max(0, asked), len(loads))
        if self.connector is not None:  # notebook 14: blocks for its loads now, loaded before the pass
            self.reserve_found(plan, request, len(loads) * self.block_size)
            self.connector.update_state_after_alloc(request, list(self.cache.tables[request.req_id]),
                                                    len(loads) * self.block_size)
        elif loads:
            slots = host.cache.load(request.req_id, loads)  # pinned: the blocks the copy-in evicts are others
            try:
                self.copy_in(plan, request, len(loads) * self.block_size, slots)
            finally:
                host.cache.release(loads)
            host.loaded_blocks += len(loads)
        if not loads and self.cache.prefix_cache is not None:
            plan.batch.copies += manager.share_partial_block(request.req_id, request.token_ids,
                                                             plan.registered)
        return self.cache.seq_lens[request.req_id]

    def copy_in(self, plan: StepPlan, request: Request, n: int, slots: list[int]) -> None:
        """Reserve ``n`` tokens of ``request`` after those it holds and copy host ``slots`` into their blocks
        (the reservation, in the journal, is undone with the step)."""
        start = self.reserve_found(plan, request, n)
        table = self.cache.tables[request.req_id]
        self.host.load(self.cache.pool, slots, table[start // self.block_size:ceil_div(start + n,
                                                                                         self.block_size)])

    def reserve_found(self, plan: StepPlan, request: Request, n: int) -> int:
        """Reserve ``n`` found tokens of ``request`` after those it holds, their K/V to be copied in (the
        reservation, in the journal, is undone with the step): where they start."""
        start = self.cache.seq_lens[request.req_id]
        if n:
            record = self.cache.manager.reserve([request.req_id], [n], request.token_ids[start:start + n])
            plan.journal.append(record)
            plan.registered.update(record.registered)
        return start

    def load_external(self, plan: StepPlan) -> None:
        """Before the forward pass: the connector's meta for the step (vLLM builds it as ``schedule`` ends),
        and its loads into their blocks. ``connector.LoadFailed`` if one cannot be loaded."""
        if self.connector is not None and plan.meta is None:
            plan.meta = self.connector.build_connector_meta(plan)
            self.connector.start_load_kv(self.cache.pool, plan.meta)

    def save_external(self, plan: StepPlan) -> None:
        """After the forward pass: the connector saves the blocks the step filled."""
        if self.connector is not None and plan.meta is not None:
            self.connector.wait_for_save(self.cache.pool, plan.meta)

    def requeue(self, request: Request, status: Status) -> None:
        """Free ``request``'s blocks and queue it first again with ``status``, nothing computed: a
        preemption, or the undoing of an admission (perhaps interrupted before its sequence was added)."""
        self.free(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.num_computed_tokens = 0
        if request.swapped is not None:  # an undone readmission: its blocks are still in the host tier
            request.num_computed_tokens = request.swapped_tokens
        request.status = status

    def undo(self, plan: StepPlan) -> None:
        """The step of ``plan`` failed (its forward pass raised): every allocation, registration and admission
        it made is undone, so no block without its K/V can be found; its preemptions stay (the K/V those
        freed may be overwritten already). The next ``schedule`` plans the step again."""
        checks.open_plan(self, plan)
        self.rollback(plan)
        self.plan = None

    def rollback(self, plan: StepPlan) -> None:
        """Undo ``plan``'s journal, newest change first, and its admissions' lookups in the statistics."""
        while plan.journal:
            entry = plan.journal.pop()
            if isinstance(entry, Reservation):
                self.cache.manager.undo(entry)
            else:
                self.requeue(*entry)  # as it was
        if self.cache.prefix_cache is not None:
            self.cache.prefix_cache.queried_tokens, self.cache.prefix_cache.hit_tokens = plan.lookups

    def update(self, plan: StepPlan, sampled: list[int]) -> list[Request]:
        """The step of ``plan`` ran: ``sampled`` holds one token per row of ``plan.work``. Its K/V are written
        (the reservations are committed); count the computed tokens, append the tokens of the requests that
        sample, and finish those that have all their tokens (freeing their blocks). Returns the finished
        requests. A plan is taken once, and only the latest."""
        checks.open_plan(self, plan)
        sampled = checks.sampled(sampled, len(plan.work))
        self.host_done(plan)  # notebook 13: the step's new blocks stored, swapped-in blocks' slots freed
        for entry in plan.journal:
            if isinstance(entry, Reservation):
                self.cache.manager.commit(entry)
        plan.journal.clear()
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

    def store_computed(self, plan: StepPlan) -> None:
        """The step's K/V are written: each block a request filled goes to the host tier (write-through),
        or is remembered as the content of its device block (victim, stored when evicted). Once a plan; the
        engine calls it before ``update``, where the step can still be undone if a copy is interrupted."""
        host = self.host
        if host is None or host.write == "none" or plan.stored:
            return
        plan.stored = True
        for request, n in plan.work:
            if request.prompt_tokens is None:
                continue
            first = request.num_computed_tokens // self.block_size
            last = (request.num_computed_tokens + n) // self.block_size
            if last == first:
                continue
            table = self.cache.tables[request.req_id]
            keys = host.block_keys(request.req_id, request.token_ids, last, self.block_size)
            if host.write == "through":
                host.store(request.req_id, self.cache.pool, keys[first:], table[first:last])
            else:
                for index in range(last):
                    host.device_keys[table[index]] = keys[index]

    def host_done(self, plan: StepPlan) -> None:
        """The step of ``plan`` ran: its new blocks go to the host tier, and the requests swapped back in
        give their host slots up."""
        self.store_computed(plan)
        for request in plan.swapped_in:
            self.host.cache.give_slots(request.swapped)
            request.swapped = None

    def save_victim(self, block: int) -> None:
        """The prefix cache evicts ``block`` for new content: its K/V go to the host tier first."""
        key = self.host.device_keys.pop(block, None)
        if key is not None:
            self.host.store("evictions", self.cache.pool, [key], [block])
            self.host.cache.finish("evictions")  # an insertion, nothing more

    def finish(self, request: Request) -> None:
        """Forget ``request``: a running one gives its blocks back, a waiting one leaves the queue (a
        swapped one its host slots)."""
        checks.unfinished(self, request)
        if request.status is Status.RUNNING:
            self.free(request)
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if request.swapped is not None:
            self.host.cache.give_slots(request.swapped)
            request.swapped = None
        if self.host is not None:
            self.host.forget(request.req_id)
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
