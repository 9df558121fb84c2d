"""``Engine``: greedy generation for many prompts at once through the paged cache (notebook 08).

nano-vllm's ``LLMEngine`` in small: the **scheduler** plans each step (whole prompts, notebook 07, or a token
budget with chunked prefill, notebook 09), the **model** runs it in one forward pass over the flattened new
tokens, the **engine** picks each next token (``argmax``) and hands the tokens back to the scheduler, which
appends them to their requests and finishes those that are done."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

from pagedlib import checks
from pagedlib.config import EngineConfig
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.connector import KVConnector, LoadFailed
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler, StepPlan
from pagedlib.kv_transfer.connectors import HostConnector
from pagedlib.kv_transfer.host_tier import HostTier
from pagedlib.model import PagedLlama
from pagedlib.stats import EngineStats

# generate() shows a progress bar from this many new tokens on (progress=None)
PROGRESS_MIN_TOKENS = 4096


class StepOutput(NamedTuple):
    """What one ``Engine.step`` did, by request id (a request may be prefilled and finished)."""

    prefilled: list[int]    # ran a prompt or a chunk of one (readmitted: prompt and generated tokens)
    decoded: list[int]      # ran their last sampled token
    preempted: list[int]    # lost their blocks; back at the front of the queue
    finished: list[int]     # all their tokens generated; blocks returned
    scheduled: dict[int, int]  # request id -> tokens the forward pass computed for it, in its order
    hits: dict[int, int]    # admitted request id -> prompt tokens found in the prefix cache


class Engine:
    """Continuous batching with greedy decoding on a ``PagedLlama`` and a ``PagedKVCache``. Single-threaded.

    Args:
        model: the decoder (its dtype and device are the cache's).
        num_blocks, ...: the settings of ``EngineConfig`` (checked as the engine is made), kept as
            ``engine.config``.
        connector: a ``KVConnector`` (notebook 14) the scheduler asks for blocks after the prefix cache's,
            and the step saves its full blocks through: a ``StoreConnector`` shares them with other engines.
            ``host_blocks`` (notebook 13) builds one of its own instead, a ``HostConnector``.
    """

    def __init__(self, model: PagedLlama, num_blocks: int, block_size: int = 16,
                 attention: str = "torch", enable_prefix_caching: bool = False, *,
                 connector: KVConnector | None = None, **settings: Any) -> None:
        checks.check_instance("model", model, PagedLlama, "Engine.from_hf takes a transformers model")
        self.config = EngineConfig(num_blocks, block_size, attention, enable_prefix_caching, **settings)
        checks.check_engine_model(model, self.config, connector)
        if connector is not None:
            checks.check_instance("connector", connector, KVConnector, "a StoreConnector or HostConnector")
            if self.config.host_blocks:
                raise ValueError("a host tier and a connector at once (host_blocks=, connector=): pass the "
                                 "tier as a HostConnector")
        self.model = model
        self.connector = connector
        self.cache = self._new_cache()
        self.scheduler = self._new_scheduler()
        self.requests: dict[int, Request] = {}  # add_request's requests, by id, for output()
        self.stats = EngineStats()
        self._next_id = 0
        self._generating: int | None = None  # the thread inside generate()
        self._in_step = False  # True inside step()

    @classmethod
    def from_hf(cls, hf_model: Any, *args: Any, **kwargs: Any) -> Engine:
        """An engine on the weights of a transformers model ``PagedLlama.from_hf`` takes (``args``,
        ``kwargs``: those of ``Engine`` after ``model``, ``num_blocks`` first)."""
        return cls(PagedLlama.from_hf(hf_model), *args, **kwargs)

    def _new_cache(self) -> PagedKVCache:
        config = self.config
        return self.model.new_cache(config.num_blocks, config.block_size,
                                    enable_prefix_caching=config.enable_prefix_caching,
                                    kv_cache_dtype=config.kv_cache_dtype, prefix_cache=config.prefix_cache,
                                    hybrid_kv_cache=config.hybrid_kv_cache)

    def _new_scheduler(self) -> Scheduler:
        config = self.config
        if config.host_blocks:  # notebook 13's host tier: a connector of the engine's own, made afresh
            tier = HostTier(self.cache.pool, config.host_blocks, config.host_policy)
            self.connector = HostConnector(tier, config.host_write, swap=config.preemption == "swap")
        elif self.connector is not None:
            self.connector.reset()  # no request of the last scheduler's is left
        return Scheduler(self.cache, max_num_seqs=config.max_num_seqs,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         long_prefill_token_threshold=config.long_prefill_token_threshold,
                         watermark=config.watermark, max_model_len=config.max_model_len,
                         full_prompt_must_fit=config.full_prompt_must_fit, connector=self.connector)

    @property
    def host(self) -> HostTier | None:
        """The host tier (``host_blocks``), or ``None``: its ``stats()`` say what moved."""
        if self.config.host_blocks:
            return self.connector.tier
        return None

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue one prompt (checked first); returns its request id for ``output``."""
        checks.check_idle(self)
        request = self._request("prompt", prompt, max_new_tokens)
        self.scheduler.add(request)
        self.requests[request.req_id] = request
        self._next_id += 1
        return request.req_id

    def abort(self, req_id: int) -> None:
        """Stop request ``req_id`` whatever its state (waiting, running, preempted), freeing its blocks;
        ``output`` still gives the tokens it generated."""
        checks.check_idle(self)
        self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        """One scheduler step, one forward pass over every scheduled request's new tokens (a decode's last
        sampled token, a prompt or its next chunk, a readmitted request's prompt and generated tokens); each
        request whose tokens all ran samples one; finished requests' blocks are freed.

        The step is a transaction: if the forward pass raises (an exception, ``KeyboardInterrupt``), every
        block the step allocated or made findable is given back and every admission undone, then the error
        propagates. The engine is usable as it was before the step (preemptions the step made stay: their
        requests wait at the front of the queue); call ``step()`` again to retry, ``abort`` a request, or
        ``reset()``. A connector's block that cannot be loaded undoes the step too, and it is planned again
        without that block (its tokens computed)."""
        checks.check_idle(self)
        self._in_step = True
        try:
            while True:
                plan = self.scheduler.schedule()
                try:
                    sampled = self.run_plan(plan)
                    break
                except LoadFailed:  # warned by the connector, which offers that block no more
                    self.scheduler.undo(plan)
                    self.stats.load_failures += 1
                except BaseException:
                    self.scheduler.undo(plan)
                    raise
            self.stats.count(plan, self.cache.num_used_blocks)
            finished = [request.req_id for request in self.scheduler.update(plan, sampled)]
        finally:
            self._in_step = False
        self.stats.finished += finished
        return StepOutput([request.req_id for request, _ in plan.prefill],
                          [request.req_id for request in plan.decode],
                          [request.req_id for request in plan.preempted], finished,
                          {request.req_id: n for request, n in plan.work}, plan.hits)

    def run_plan(self, plan: StepPlan) -> list[int]:
        """Load, forward, save (``step`` runs it as a transaction): the connector's copies into the pool
        (``LoadFailed`` if a block cannot be had), the forward pass, the connector's saves of the blocks the
        step filled. The token each row samples."""
        connector, pool = self.connector, self.cache.pool
        if connector is not None:
            connector.start_load_kv(pool, plan.meta)
        if not plan.work:
            return []
        logits = self.model.forward(self.cache, plan.batch, self.config.attention)  # [batch, vocab]
        if connector is not None:
            connector.wait_for_save(pool, plan.meta)
        return logits.argmax(-1).tolist()

    def output(self, req_id: int) -> list[int]:
        """The tokens request ``req_id`` generated so far (all of them once it finished)."""
        return list(checks.check_known_request(self.requests, req_id).output_tokens)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 progress: bool | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt: ``max_new_tokens`` new tokens each (no end-of-sequence
        stop), in the order of ``prompts``; ``progress``: a tqdm bar (default: from ``PROGRESS_MIN_TOKENS``).
        Every prompt is checked first: ``ValueError`` for one the pool (less the watermark) cannot hold."""
        checks.check_idle(self)
        max_new_tokens = checks.check_generate(self, prompts, max_new_tokens)
        requests = []
        for i, prompt in enumerate(prompts):
            requests.append(self._request(f"prompts[{i}]", prompt, max_new_tokens, i))
        self._next_id += len(requests)
        self._generating = threading.get_ident()
        try:
            for request in requests:
                self.scheduler.add(request)
            self._drain(len(requests) * max_new_tokens, progress)
        except BaseException:
            self.reset()
            raise
        finally:
            self._generating = None
        return [request.output_tokens for request in requests]

    def _drain(self, total: int, progress: bool | None) -> None:
        from tqdm.auto import tqdm

        if progress is None:
            progress = total >= PROGRESS_MIN_TOKENS
        with tqdm(total=total, disable=not progress, desc="generate", unit="tok") as bar:
            while self.scheduler.has_unfinished:
                before = self.stats.generated_tokens
                self.step()
                bar.update(self.stats.generated_tokens - before)

    def reset(self) -> None:
        """Drop every request and every block, cached ones included: a fresh cache and scheduler."""
        self.cache = self._new_cache()
        self.scheduler = self._new_scheduler()
        self.requests.clear()
        self._in_step = False

    def _request(self, name: str, prompt: Sequence[int], max_new_tokens: int,
                 offset: int = 0) -> Request:
        """Check one prompt (nothing is queued): the ``Request`` the scheduler will see."""
        tokens, max_new_tokens = checks.check_prompt(self, name, prompt, max_new_tokens)
        request = Request(self._next_id + offset, 0, len(tokens), max_new_tokens, tuple(tokens))
        checks.check_fits(self, name, request)
        return request
