"""``Engine``: greedy generation for many prompts at once through the paged cache (notebook 08).

nano-vllm's ``LLMEngine`` in small: the **scheduler** plans each step (whole prompts, notebook 07, or a token
budget with chunked prefill, notebook 09), the **model** runs it in one forward pass over the flattened new
tokens, the **engine** keeps each request's tokens, picks the next one (``argmax``) and hands finished
requests back to the scheduler, which frees their blocks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pagedlib.checks import check_engine, check_generate, check_token_budget, token_list
from pagedlib.core.scheduler import ChunkedScheduler, Request, Scheduler, StepPlan
from pagedlib.model import PagedLlama, attention_kernel
from pagedlib.util import as_int

PROGRESS_MIN_TOKENS = 4096  # generate() shows a progress bar from this many new tokens on (progress=None)
WATERMARK = 0.01  # share of the blocks admission keeps free for running requests to grow into (vLLM's)


@dataclass
class EngineStats:
    """What the engine did since it was built."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0         # recomputed tokens count again
    cached_tokens: int = 0          # found in the prefix cache at admission, attached instead of prefilled
    decode_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0            # most blocks held at once
    peak_running: int = 0           # most requests decoding or prefilling in one step
    finished: list[int] = field(default_factory=list)   # request ids, in finishing order


class StepOutput(NamedTuple):
    """Request ids, by what one ``Engine.step`` did with them (a request may be prefilled and finished)."""

    prefilled: list[int]    # ran a prompt, or a chunk of one (readmitted: prompt and generated tokens)
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
            prefill (``ChunkedScheduler``), chunks at most ``long_prefill_token_threshold`` long.
    """

    def __init__(self, model: PagedLlama, num_blocks: int, block_size: int = 16, attention: str = "torch",
                 enable_prefix_caching: bool = False, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, long_prefill_token_threshold: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None, prefix_cache: str = "hash") -> None:
        num_blocks, block_size, self.max_num_seqs = check_engine(
            model, PagedLlama, num_blocks, block_size, attention, enable_prefix_caching, max_num_seqs)
        self.token_budget = check_token_budget(max_num_batched_tokens, long_prefill_token_threshold)
        attention_kernel(attention, model.shape.head_dim)     # refuses a head size the kernel cannot take
        self.model, self.attention = model, attention
        self.cache = model.new_cache(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                     kv_cache_dtype=kv_cache_dtype, prefix_cache=prefix_cache)
        self.watermark_blocks = int(WATERMARK * num_blocks)       # the scheduler's rounding
        self.scheduler = self._new_scheduler()
        self.tokens: dict[int, list[int]] = {}     # request id -> prompt + generated tokens
        self.prompt_lens: dict[int, int] = {}
        self.stats = EngineStats()
        self._next_id = 0
        self._generating: int | None = None        # the thread inside generate()
        self._in_step = False                      # True inside step(), and after one that raised

    @classmethod
    def from_hf(cls, hf_model: Any, num_blocks: int, block_size: int = 16, attention: str = "torch",
                enable_prefix_caching: bool = False, **kwargs: Any) -> Engine:
        """An engine on the weights of a transformers model ``PagedLlama.from_hf`` takes (``kwargs``: the
        keywords of ``Engine``, ``max_num_batched_tokens`` among them)."""
        return cls(PagedLlama.from_hf(hf_model), num_blocks, block_size, attention, enable_prefix_caching,
                   **kwargs)

    def _new_scheduler(self) -> Scheduler:
        capacity = self.cache.num_blocks * self.cache.block_size
        caching = self.cache.prefix_cache is not None
        token_ids = (lambda r, n: self.tokens[r.req_id][:n]) if caching else None   # prompt + generated
        budget, cap = self.token_budget
        chunked = {} if budget is None else {"max_num_batched_tokens": budget,
                                             "long_prefill_token_threshold": cap}
        return (ChunkedScheduler if chunked else Scheduler)(
            self.cache, policy="paged", max_num_seqs=self.max_num_seqs, watermark=WATERMARK,
            max_model_len=capacity + 1, token_ids=token_ids, **chunked)

    def _check_idle(self) -> None:
        """Refuse a call from a second thread, or after a step that raised (a cheap check, not a lock)."""
        if self._generating not in (None, threading.get_ident()):
            raise RuntimeError("another thread is inside this engine's generate(): an Engine is "
                               "single-threaded (give each thread its own engine, or serialise the calls)")
        if self._in_step:
            raise RuntimeError("the engine's last step() raised midway (or another thread is inside step(): "
                               "an Engine is single-threaded): call reset() before using it again")

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue one prompt (checked first); returns its request id for ``output``."""
        self._check_idle()
        request, tokens = self._request("prompt", prompt, max_new_tokens)
        self._enqueue(request, tokens)
        return request.req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        """One scheduler step, one forward pass over every scheduled request's new tokens (a decode's last
        sampled token, a prompt or its next chunk, a readmitted request's prompt and generated tokens); each
        request whose tokens all ran samples one; finished requests' blocks are freed."""
        self._check_idle()
        self._in_step = True                                        # until the results are in
        sched = self.scheduler
        counted = sched.prefill_tokens, sched.cached_tokens
        plan = sched.step()
        work = [(r, 1) for r in plan.decode] + plan.prefill         # (request, new tokens)
        if work:
            ids = [r.req_id for r, _ in work]
            starts = [self.cache.seq_lens[i] for i in ids]          # K/V stored, or found by prefix caching
            chunks = [self.tokens[i][s:s + n] for i, s, (_, n) in zip(ids, starts, work)]
            logits = self.model.step(self.cache, ids, chunks, attention=self.attention)     # [batch, vocab]
            for i, token in zip(ids, logits.argmax(-1).tolist()):
                if i not in plan.partial:
                    self.tokens[i].append(token)
        self.stats.prefill_tokens += sched.prefill_tokens - counted[0]
        self.stats.cached_tokens += sched.cached_tokens - counted[1]
        out = StepOutput([r.req_id for r, _ in plan.prefill], [r.req_id for r in plan.decode],
                         [r.req_id for r in plan.preempted], self._retire(plan))
        self._in_step = False
        return out

    def output(self, req_id: int) -> list[int]:
        """The tokens request ``req_id`` generated so far (all of them once it finished)."""
        return self.tokens[req_id][self.prompt_lens[req_id]:]

    def _retire(self, plan: StepPlan) -> list[int]:
        """Count the step, then finish the requests that have all their tokens (freeing their blocks)."""
        s = self.stats
        s.steps += 1
        s.generated_tokens += len(plan.scheduled)
        s.decode_tokens += len(plan.decode)
        s.preemptions += len(plan.preempted)
        s.peak_blocks = max(s.peak_blocks, self.cache.num_used_blocks)
        s.peak_running = max(s.peak_running, len(plan.decode) + len(plan.prefill))  # partial chunks too
        done = [r for r in plan.scheduled if self.scheduler.generated[r.req_id] == r.output_len]
        for r in done:
            self.scheduler.finish(r)
            s.finished.append(r.req_id)
        return [r.req_id for r in done]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 progress: bool | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt: ``max_new_tokens`` new tokens each (no end-of-sequence
        stop), in the order of ``prompts``; ``progress``: a tqdm bar (default: from ``PROGRESS_MIN_TOKENS``).
        Every prompt is checked first: ``ValueError`` for one the pool (less the 1% watermark) cannot hold."""
        self._check_idle()
        max_new_tokens = check_generate(prompts, max_new_tokens, pending=self.scheduler.has_unfinished)
        requests = [self._request(f"prompts[{i}]", p, max_new_tokens, i) for i, p in enumerate(prompts)]
        self._generating = threading.get_ident()
        try:
            for request, tokens in requests:
                self._enqueue(request, tokens)
            self._drain(len(requests) * max_new_tokens, progress)
        except BaseException:
            self.reset()
            raise
        finally:
            self._generating = None
        return [self._collect(r.req_id) for r, _ in requests]

    def _drain(self, total: int, progress: bool | None) -> None:
        from tqdm.auto import tqdm

        show = total >= PROGRESS_MIN_TOKENS if progress is None else bool(progress)
        with tqdm(total=total, disable=not show, desc="generate", unit="tok") as bar:
            while self.scheduler.has_unfinished:
                before = self.stats.generated_tokens
                self.step()
                bar.update(self.stats.generated_tokens - before)

    def _collect(self, req_id: int) -> list[int]:
        out = self.output(req_id)
        del self.tokens[req_id], self.prompt_lens[req_id]
        return out

    def reset(self) -> None:
        """Drop every request and free every block. With prefix caching the cache is rebuilt empty: a block
        registered by an interrupted prefill may hold placeholder K/V, and must never be found."""
        for seq_id in list(self.cache.seq_lens):
            self.cache.free_sequence(seq_id)
        if (c := self.cache).prefix_cache is not None:
            self.cache = self.model.new_cache(c.num_blocks, c.block_size, enable_prefix_caching=True,
                                              kv_cache_dtype=None if c.dtype == self.model.dtype else c.dtype,
                                              prefix_cache=c.prefix_cache_kind)
        self.scheduler = self._new_scheduler()
        self.tokens.clear()
        self.prompt_lens.clear()
        self._in_step = False

    def _request(self, name: str, prompt: Sequence[int], max_new_tokens: int,
                 offset: int = 0) -> tuple[Request, list[int]]:
        """Check one prompt (nothing is queued): the ``Request`` the scheduler sees, and its tokens."""
        tokens = token_list(name, prompt, self.model.shape.vocab_size)
        if not tokens:
            raise ValueError(f"{name} is empty: a prompt needs at least one token")
        max_new_tokens = as_int("max_new_tokens", max_new_tokens, minimum=1)
        request = Request(self._next_id + offset, 0, len(tokens), max_new_tokens)
        nb, bs, mark = self.cache.num_blocks, self.cache.block_size, self.watermark_blocks
        if request.max_kv_len > (nb - mark) * bs:
            held = f" less the watermark of {mark} (1% kept free)" if mark else ""
            raise ValueError(f"{name} ({len(tokens)} tokens) with max_new_tokens={max_new_tokens} needs "
                             f"{request.max_kv_len} token slots (the prompt and every new token but the "
                             f"last), more than the pool of {nb} blocks{held} x {bs} = {(nb - mark) * bs} "
                             f"can ever hold")
        return request, tokens

    def _enqueue(self, request: Request, tokens: list[int]) -> None:
        self.scheduler.add(request)
        self.tokens[request.req_id] = tokens
        self.prompt_lens[request.req_id] = len(tokens)
        self._next_id = max(self._next_id, request.req_id + 1)
