"""``Engine``: greedy generation for many prompts at once through the paged cache (notebook 08).

nano-vllm's ``LLMEngine`` in small: the **scheduler** plans each step (whole prompts, notebook 07, or a token
budget with chunked prefill, notebook 09), the **model** runs it in one forward pass over the flattened new
tokens, the **engine** picks each next token (``argmax``) and hands the tokens back to the scheduler, which
appends them to their requests and finishes those that are done."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pagedlib import checks
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.model import PagedLlama
from pagedlib.stats import EngineStats

# generate() shows a progress bar from this many new tokens on (progress=None)
PROGRESS_MIN_TOKENS = 4096
# share of the blocks admission keeps free for running requests to grow into (vLLM's)
WATERMARK = 0.01


class StepOutput(NamedTuple):
    """Request ids, by what one ``Engine.step`` did with them (a request may be prefilled and finished)."""

    prefilled: list[int]    # ran a prompt or a chunk of one (readmitted: prompt and generated tokens)
    decoded: list[int]      # ran their last sampled token
    preempted: list[int]    # lost their blocks; back at the front of the queue
    finished: list[int]     # all their tokens generated; blocks returned


class Engine:
    """Continuous batching with greedy decoding on a ``PagedLlama`` and a ``PagedKVCache``. Single-threaded;
    a ``step()`` that raised midway is not rolled back: later calls raise ``RuntimeError`` until ``reset()``.

    Args:
        model: the decoder (its dtype and device are the cache's).
        num_blocks, block_size: the KV pool, ``engine.cache``.
        attention: ``"torch"`` or ``"triton"`` (``block_size`` a power of two up to 128, ``head_dim`` <= 256).
        enable_prefix_caching: attach a prompt's cached full blocks instead of prefilling them (notebook 06).
        prefix_cache: ``"hash"`` (vLLM's block hashes) or ``"radix"`` (SGLang's tree, notebook 11).
        max_num_seqs: most requests in the running batch.
        max_num_batched_tokens: ``None``: whole prompts; a number: the token budget of a step, with chunked
            prefill, chunks at most ``long_prefill_token_threshold`` long.
    """

    def __init__(self, model: PagedLlama, num_blocks: int, block_size: int = 16,
                 attention: str = "torch", enable_prefix_caching: bool = False, *,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 long_prefill_token_threshold: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None, prefix_cache: str = "hash") -> None:
        num_blocks, block_size, self.max_num_seqs, self.token_budget = checks.check_engine(
            model, PagedLlama, num_blocks, block_size, attention, enable_prefix_caching,
            max_num_seqs, max_num_batched_tokens, long_prefill_token_threshold)
        self.model = model
        self.attention = attention
        self.cache = model.new_cache(num_blocks, block_size,
                                     enable_prefix_caching=enable_prefix_caching,
                                     kv_cache_dtype=kv_cache_dtype, prefix_cache=prefix_cache)
        self.scheduler = self._new_scheduler()
        self.watermark_blocks = self.scheduler.watermark_blocks  # admission keeps them free
        self.requests: dict[int, Request] = {}  # add_request's requests, by id, for output()
        self.stats = EngineStats()
        self._next_id = 0
        self._generating: int | None = None  # the thread inside generate()
        self._in_step = False  # True inside step(), and after one that raised

    @classmethod
    def from_hf(cls, hf_model: Any, *args: Any, **kwargs: Any) -> Engine:
        """An engine on the weights of a transformers model ``PagedLlama.from_hf`` takes (``args``,
        ``kwargs``: those of ``Engine`` after ``model``, ``num_blocks`` first)."""
        return cls(PagedLlama.from_hf(hf_model), *args, **kwargs)

    def _new_scheduler(self) -> Scheduler:
        budget, cap = self.token_budget
        capacity = self.cache.num_blocks * self.cache.block_size
        return Scheduler(self.cache, max_num_seqs=self.max_num_seqs,
                         max_num_batched_tokens=budget, long_prefill_token_threshold=cap,
                         watermark=WATERMARK, max_model_len=capacity + 1)

    def _check_idle(self) -> None:
        """Refuse a call from a second thread, or after a step that raised (a cheap check, not a lock)."""
        checks.check_idle(self._generating, self._in_step)

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue one prompt (checked first); returns its request id for ``output``."""
        self._check_idle()
        request = self._request("prompt", prompt, max_new_tokens)
        self.scheduler.add(request)
        self.requests[request.req_id] = request
        self._next_id += 1
        return request.req_id

    def abort(self, req_id: int) -> None:
        """Stop request ``req_id`` whatever its state (waiting, running, preempted), freeing its blocks;
        ``output`` still gives the tokens it generated."""
        self._check_idle()
        self.scheduler.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        """One scheduler step, one forward pass over every scheduled request's new tokens (a decode's last
        sampled token, a prompt or its next chunk, a readmitted request's prompt and generated tokens); each
        request whose tokens all ran samples one; finished requests' blocks are freed."""
        self._check_idle()
        self._in_step = True  # until the results are in
        plan = self.scheduler.schedule()
        work = plan.work  # (request, new tokens), in the order of the forward pass
        sampled = []
        if work:
            ids = [request.req_id for request, _ in work]
            chunks = [request.next_token_ids(n) for request, n in work]
            # [batch, vocab]
            logits = self.model.step(self.cache, ids, chunks, attention=self.attention)
            sampled = logits.argmax(-1).tolist()
        self.stats.count(plan, self.cache.num_used_blocks)
        finished = [request.req_id for request in self.scheduler.update(plan, sampled)]
        self.stats.finished += finished
        self._in_step = False
        prefilled = [request.req_id for request, _ in plan.prefill]
        decoded = [request.req_id for request in plan.decode]
        preempted = [request.req_id for request in plan.preempted]
        return StepOutput(prefilled, decoded, preempted, finished)

    def output(self, req_id: int) -> list[int]:
        """The tokens request ``req_id`` generated so far (all of them once it finished)."""
        return list(self.requests[req_id].output_tokens)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 progress: bool | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt: ``max_new_tokens`` new tokens each (no end-of-sequence
        stop), in the order of ``prompts``; ``progress``: a tqdm bar (default: from ``PROGRESS_MIN_TOKENS``).
        Every prompt is checked first: ``ValueError`` for one the pool (less the 1% watermark) cannot hold."""
        self._check_idle()
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
        """Drop every request and free every block. With prefix caching the cache is rebuilt empty: a block
        registered by an interrupted prefill may hold placeholder K/V, and must never be found."""
        cache = self.cache
        for seq_id in list(cache.seq_lens):
            cache.free_sequence(seq_id)
        if cache.prefix_cache is not None:
            # the model's own dtype as kv_cache_dtype means no quantization, as None does
            self.cache = self.model.new_cache(cache.num_blocks, cache.block_size,
                                              enable_prefix_caching=True,
                                              kv_cache_dtype=cache.dtype,
                                              prefix_cache=cache.prefix_cache_kind)
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
