"""The step scheduler: continuous batching over a ``PagedKVCache`` under a token budget per step, like
vLLM V1's ``Scheduler`` and nano-vllm's. With no budget (``max_num_batched_tokens=None``) a prompt runs
whole in one step (notebooks 07, 08); with one, prompts are cut into chunks (notebook 09). One thread."""

from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass, field

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.radix_cache import RadixCache
from pagedlib.core.request import Request, Status
from pagedlib.util import as_int, ceil_div, refuse


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
        decodes = [(request, 1) for request in self.decode]
        return decodes + self.prefill

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
        _check_scheduler(cache, watermark, long_prefill_token_threshold, max_num_batched_tokens)
        self.cache = cache
        self.block_size = cache.block_size
        self.max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
        self.max_model_len = as_int("max_model_len", max_model_len, minimum=2)
        self.max_num_batched_tokens = _optional_int("max_num_batched_tokens",
                                                    max_num_batched_tokens)
        self.chunk_cap = _optional_int("long_prefill_token_threshold",
                                       long_prefill_token_threshold)
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
        if not isinstance(request, Request):
            raise ValueError(f"request must be a Request, got {type(request).__name__}")
        if request.req_id in self.requests:
            raise ValueError(f"request id {request.req_id} is already queued or running")
        if request.status is not Status.WAITING or request.output_tokens:
            raise ValueError(f"request {request.req_id} has run before: pass a new Request")
        if self.cache.prefix_cache is not None and request.prompt_tokens is None:
            raise ValueError(f"request {request.req_id} has no prompt_tokens: prefix caching "
                             f"looks its blocks up by them")
        total = request.prompt_len + request.output_len
        if total > self.max_model_len:
            raise ValueError(f"request {request.req_id}: prompt_len + output_len = {total} > "
                             f"max_model_len = {self.max_model_len}")
        need = self.blocks_alone(request)
        if need > self.kv_budget_blocks:
            raise ValueError(f"request {request.req_id} needs {need} blocks, more than the "
                             f"budget of {self.kv_budget_blocks}: it could never run")

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
            while self.blocks_for(request, n) + pending > self.cache.num_free_blocks:
                plan.preempted.append(self.preempt())
                if request.status is not Status.RUNNING:
                    return pending
            pending += self.blocks_for(request, n)
            if n == 1 and request.num_uncomputed_tokens == 1 and request.output_tokens:
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
        self.free(request)
        self.running.pop()
        request.lost_tokens = request.num_computed_tokens
        request.num_computed_tokens = 0
        request.status = Status.PREEMPTED
        self.waiting.appendleft(request)
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
                self.unadmit(request, status)
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
        held = self.cache.seq_lens[request.req_id]  # found by the prefix cache
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

    def unadmit(self, request: Request, status: Status) -> None:
        """Undo ``admit``: free what it attached and queue ``request`` first again, as it was."""
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
        if len(sampled) != len(work):
            raise ValueError(f"sampled must hold {len(work)} tokens, got {len(sampled)}")
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
        self.free(request)
        self.running.remove(request)
        request.status = Status.FINISHED
        del self.requests[request.req_id]

    def abort(self, req_id: int) -> Request:
        """Drop request ``req_id`` whatever its state (waiting, running, preempted), freeing its blocks."""
        request = self.requests.get(req_id)
        if request is None:
            raise ValueError(f"req_id {req_id!r} is not a waiting or running request")
        if request.status is Status.RUNNING:
            self.finish(request)
            return request
        self.waiting.remove(request)
        request.status = Status.FINISHED
        del self.requests[req_id]
        return request

    def free(self, request: Request) -> None:
        """Give ``request``'s memory back."""
        self.cache.free_sequence(request.req_id)


def _optional_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    return as_int(name, value, minimum=1)


def _check_scheduler(cache: object, watermark: object, threshold: object, budget: object) -> None:
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if cache.seq_lens:
        raise ValueError(f"cache must be empty: it holds sequences {list(cache.seq_lens)[:8]}")
    fraction = isinstance(watermark, numbers.Real) and not isinstance(watermark, bool)
    if not fraction or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
    refuse((threshold is not None and budget is None,
            "long_prefill_token_threshold needs max_num_batched_tokens (a token budget)"))
