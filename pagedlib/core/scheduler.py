"""The step scheduler: continuous batching over a ``PagedKVCache`` under a token budget per step, like
vLLM V1's ``Scheduler`` and nano-vllm's. With no budget (``max_num_batched_tokens=None``) a prompt runs
whole in one step (notebooks 07, 08); with one, prompts are cut into chunks (notebook 09). One thread."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedlib.core import _scheduler_checks as checks
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.radix_cache import RadixCache
from pagedlib.core.request import Request, Status
from pagedlib.util import ceil_div


@dataclass
class StepPlan:
    """What one step runs: the scheduler's decisions, before the model runs them."""

    # running requests that feed their last sampled token: one new token each
    decode: list[Request] = field(default_factory=list)
    # (request, new tokens): a prompt, a chunk of one, or a readmitted request's tokens
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    # requests that lost their blocks this step; now first in the queue
    preempted: list[Request] = field(default_factory=list)
    # a waiting request was refused for lack of memory
    blocked: bool = False
    # tokens this step's admissions found in the prefix cache
    cached_tokens: int = 0
    # K/V lost to earlier preemptions that this step's admissions compute again
    recomputed_tokens: int = 0

    @property
    def work(self) -> list[tuple[Request, int]]:
        """(request, new tokens) in the order of the forward pass: decodes first."""
        return [(request, 1) for request in self.decode] + self.prefill

    @property
    def num_tokens(self) -> int:  # new tokens of the step's forward pass
        return sum(n for _, n in self.work)

    @property
    def sampling(self) -> list[Request]:
        """The requests whose new tokens reach their last: each samples one (read before ``update``)."""
        return [request for request, n in self.work if n == request.num_uncomputed_tokens]


class Scheduler:
    """Continuous batching over ``cache``: running requests first, oldest first, then waiting ones in
    arrival order, while ``max_num_seqs``, the token budget and the blocks allow. Admission keeps
    ``watermark`` of the blocks free for the running requests to grow into."""

    def __init__(self, cache: PagedKVCache, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 watermark: float = 0.01, max_model_len: int = 2048) -> None:
        limits = checks.scheduler(cache, max_num_seqs, max_num_batched_tokens,
                                  long_prefill_token_threshold, watermark, max_model_len)
        # the step's limits; chunk_cap: the most tokens of one prompt a step takes
        self.max_num_seqs, self.max_num_batched_tokens, self.chunk_cap, self.max_model_len = limits
        self.cache = cache
        self.block_size = cache.block_size
        self.watermark_blocks = int(float(watermark) * cache.num_blocks)
        self.kv_budget_blocks = cache.num_blocks  # blocks the requests may fill: all of the cache's
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: preempt from the end
        self.requests: dict[int, Request] = {}  # every unfinished request, by id

    def blocks_alone(self, request: Request) -> int:
        """Blocks ``request`` needs to run alone: the most it ever holds, plus the watermark."""
        return ceil_div(request.max_kv_len, self.block_size) + self.watermark_blocks

    def check(self, request: Request) -> None:
        """``ValueError`` unless ``request`` is new, fits the model and, alone, the cache."""
        checks.new_request(self, request)

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.append(request)
        self.requests[request.req_id] = request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> StepPlan:
        """Plan one step: running requests take their next tokens (preempting the newest while blocks are
        short); then, unless one was preempted, waiting requests are admitted."""
        plan = StepPlan()
        pending = self.schedule_running(plan)
        if plan.preempted:
            plan.blocked = bool(self.waiting)
        else:
            self.schedule_waiting(plan, pending)
        return plan

    def schedule_running(self, plan: StepPlan) -> int:
        """Give each running request, oldest first, its next tokens. Returns the new blocks they take."""
        pending = 0
        for request in list(self.running):
            n = self.chunk_size(plan, request.num_uncomputed_tokens)
            if n == 0 or request.status is not Status.RUNNING:
                break
            new = self.blocks_for(request, n)
            # the newest requests lose their blocks until this one's fit (it may be the newest)
            while new + pending > self.cache.num_free_blocks:
                plan.preempted.append(self.preempt())
                if request.status is not Status.RUNNING:
                    return pending
            pending += new
            if request.num_uncomputed_tokens == 1 and request.output_tokens:  # then n is 1
                plan.decode.append(request)
            else:
                plan.prefill.append((request, n))
        return pending

    def chunk_size(self, plan: StepPlan, uncomputed: int) -> int:
        """How many of ``uncomputed`` tokens fit in what the step's budget and the chunk cap leave."""
        n = uncomputed
        if self.max_num_batched_tokens is not None:
            n = min(n, self.max_num_batched_tokens - plan.num_tokens)
        if self.chunk_cap is not None:
            n = min(n, self.chunk_cap)
        return n

    def blocks_for(self, request: Request, n: int) -> int:
        """New blocks ``request`` takes to store ``n`` more tokens."""
        held = self.cache.seq_lens[request.req_id]
        return ceil_div(held + n, self.block_size) - ceil_div(held, self.block_size)

    def preempt(self) -> Request:
        """Free the newest running request's blocks and queue it first again: its K/V will be
        computed again (less what the prefix cache still finds)."""
        request = self.running[-1]
        request.lost_tokens = request.num_computed_tokens
        self.requeue(request, Status.PREEMPTED)
        return request

    def schedule_waiting(self, plan: StepPlan, pending: int) -> None:
        """Admit waiting requests in arrival order while ``max_num_seqs``, the token budget and the
        blocks allow. If anything raises, this step's admissions are undone first."""
        admitted: list[tuple[Request, Status]] = []
        try:
            while self.waiting and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                status = request.status
                new = self.admit(plan, request, pending)
                if new is None:
                    break
                pending += new
                admitted.append((request, status))
        except BaseException:
            for request, status in reversed(admitted):
                self.requeue(request, status)  # as it was
            raise

    def admit(self, plan: StepPlan, request: Request, pending: int) -> int | None:
        """Admit ``request`` with its first chunk: the new blocks it takes, or ``None`` if it must wait
        (no tokens left in the step, or too few blocks: ``plan.blocked``)."""
        found, found_tokens = self.cached_prefix(request)
        n = self.chunk_size(plan, request.num_tokens - found_tokens)
        if n <= 0:
            return None
        new = self.admission_blocks(request, found, found_tokens + n, pending)
        if new is None:
            plan.blocked = True
            return None
        request.num_computed_tokens = self.attach(request)
        self.running.append(self.waiting.popleft())
        request.status = Status.RUNNING
        # found by the prefix cache (not num_computed_tokens: a window's attach counts skipped tokens too)
        held = self.cache.seq_lens[request.req_id]
        plan.cached_tokens += held
        plan.recomputed_tokens += max(0, request.lost_tokens - held)
        plan.prefill.append((request, self.chunk_size(plan, request.num_uncomputed_tokens)))
        return new

    def cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """The cached blocks ``add_sequence`` will attach for ``request``, and the tokens it will find
        (the radix cache also copies part of a block, into one of the new blocks). Changes nothing."""
        prefix_cache = self.cache.prefix_cache
        if prefix_cache is None:
            return [], 0
        token_ids = request.token_ids
        found = prefix_cache.peek(token_ids)
        tokens = len(found) * self.block_size
        if isinstance(prefix_cache, RadixCache):
            tokens += prefix_cache.partial_match(token_ids, found)[1]
        return found, tokens

    def admission_blocks(self, request: Request, found: list[int], num_tokens: int,
                         pending: int) -> int | None:
        """New blocks a sequence of ``num_tokens`` takes beside the cached ``found``, or ``None`` if fewer
        than the watermark would stay free after ``pending`` (a found block nobody holds leaves the free
        ones when attached)."""
        revived = sum(self.cache.ref_count(block) == 0 for block in found)
        new = ceil_div(num_tokens, self.block_size) - len(found)
        left = self.cache.num_free_blocks - pending - new - revived
        if left < self.watermark_blocks:
            return None
        return new

    def attach(self, request: Request) -> int:
        """Start ``request``'s sequence with the blocks the prefix cache finds: the tokens found."""
        token_ids = None
        if self.cache.prefix_cache is not None:
            token_ids = request.token_ids
        return self.cache.add_sequence(request.req_id, token_ids)

    def requeue(self, request: Request, status: Status) -> None:
        """Free ``request``'s blocks and queue it first again with ``status``, nothing computed: a
        preemption, or the undoing of an admission."""
        self.free(request)
        self.running.remove(request)
        self.waiting.appendleft(request)
        request.num_computed_tokens = 0
        request.status = status

    def update(self, plan: StepPlan, sampled: list[int]) -> list[Request]:
        """The step ran: ``sampled`` holds one token per entry of ``plan.work`` (the model's rows). Count
        the computed tokens, append the tokens of the requests that sample, and finish those that have
        all their tokens (freeing their blocks). Returns the finished requests."""
        work = plan.work
        checks.sampled(sampled, len(work))
        finished = []
        for (request, n), token in zip(work, sampled):
            if request.status is not Status.RUNNING:
                continue  # aborted since the plan was made
            if n == request.num_uncomputed_tokens:
                request.output_tokens.append(token)
            request.num_computed_tokens += n
            if len(request.output_tokens) == request.output_len:
                self.finish(request)
                finished.append(request)
        return finished

    def finish(self, request: Request) -> None:
        """Forget ``request``: a running one gives its blocks back, a waiting one leaves the queue."""
        if request.status is Status.RUNNING:
            self.free(request)
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        del self.requests[request.req_id]

    def abort(self, req_id: int) -> Request:
        """Drop request ``req_id`` whatever its state (waiting, running, preempted), freeing its blocks."""
        request = checks.live_request(self, req_id)
        self.finish(request)
        return request

    def free(self, request: Request) -> None:
        """Give ``request``'s memory back."""
        self.cache.free_sequence(request.req_id)

