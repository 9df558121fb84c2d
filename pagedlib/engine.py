"""``Engine``: greedy generation for many prompts at once through the paged cache (notebook 08).

Three pieces, the same three as nano-vllm's ``LLMEngine`` and vLLM's engine core:

- the **scheduler** (``pagedlib.core.scheduler.Scheduler``, notebook 07, ``policy="paged"``) decides each step
  which running requests decode, which waiting ones are admitted and prefilled (while the free blocks
  allow), and which are preempted when a decode step needs more blocks than are free (their blocks are
  freed, and they are recomputed from their tokens when readmitted);
- the **model** (``PagedLlama``) runs the plan: one ``prefill`` call for the admitted requests, one
  batched ``decode`` call for the running ones;
- the **engine** keeps each request's tokens, picks the next token (greedy: ``argmax``), and hands
  finished requests back to the scheduler, which frees their blocks.

With ``enable_prefix_caching=True`` the cache finds full blocks again by their token ids (notebook 06):
the scheduler looks each admitted request's tokens up and attaches the blocks found, and the model
prefills only the tokens after them; every append carries its token ids.

``generate`` is that loop until every request is done. ``add_request`` / ``step`` expose it one step at a
time (notebook 08 watches the block tables between steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagedlib.checks import as_int
from pagedlib.core.scheduler import Request, Scheduler
from pagedlib.model import ATTENTION_BACKENDS, PagedLlama, token_list

__all__ = ["Engine", "EngineStats", "StepOutput"]

PROGRESS_MIN_TOKENS = 4096  # generate() shows a progress bar from this many new tokens on (progress=None)


@dataclass
class EngineStats:
    """What the engine did since it was built (``prefill_tokens`` counts recomputed tokens again;
    ``cached_tokens``: tokens found in the prefix cache at admission, attached instead of prefilled)."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0            # most blocks held at once
    peak_running: int = 0           # most requests decoding or prefilling in one step
    finished: list[int] = field(default_factory=list)   # request ids, in finishing order


class StepOutput(NamedTuple):
    """Request ids, by what one ``Engine.step`` did with them (a request may be both prefilled and
    finished, when it needed only one new token)."""

    prefilled: list[int]    # admitted (or readmitted after a preemption): prompt (+ generated) run at once
    decoded: list[int]      # one token appended in the batched decode
    preempted: list[int]    # lost their blocks; back at the front of the queue
    finished: list[int]     # all their tokens generated; blocks returned


class Engine:
    """Continuous batching with greedy decoding on a ``PagedLlama`` and a ``PagedKVCache`` of
    ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        model: the decoder (its dtype and device are the cache's).
        num_blocks, block_size: the KV pool; the cache is ``engine.cache``.
        attention: decode attention, ``"torch"`` (``paged_attention``) or ``"triton"`` (the fused kernel;
            ``block_size`` must then be a power of two up to 128).
        enable_prefix_caching: find the full blocks of a prompt's leading tokens that an earlier request
            computed (in use or freed but kept) and attach them instead of prefilling those tokens again
            (``PagedKVCache``'s prefix caching, notebook 06); ``engine.cache.prefix_cache_stats()`` counts
            the hits.
        max_num_seqs: most requests in the running batch.
    """

    def __init__(self, model: PagedLlama, num_blocks: int, block_size: int = 16, attention: str = "torch",
                 enable_prefix_caching: bool = False, *, max_num_seqs: int = 256) -> None:
        if not isinstance(model, PagedLlama):
            raise ValueError(f"model must be a PagedLlama (Engine.from_hf takes a transformers model), "
                             f"got {type(model).__name__}")
        num_blocks = as_int("num_blocks", num_blocks, minimum=1)
        block_size = as_int("block_size", block_size, minimum=1)
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
        if attention == "triton" and (block_size > 128 or block_size & (block_size - 1)):
            raise ValueError(f"block_size must be a power of two from 1 to 128 for the Triton kernel, "
                             f"got {block_size}")
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {enable_prefix_caching!r}")
        self.model = model
        self.attention = attention
        self.max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
        self.cache = model.new_cache(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = self._new_scheduler()
        self.tokens: dict[int, list[int]] = {}     # request id -> prompt + generated tokens
        self.prompt_lens: dict[int, int] = {}
        self.stats = EngineStats()
        self._next_id = 0

    @classmethod
    def from_hf(cls, hf_model: Any, num_blocks: int, block_size: int = 16, attention: str = "torch",
                enable_prefix_caching: bool = False, **kwargs: Any) -> Engine:
        """An engine on the weights of a ``transformers.LlamaForCausalLM`` (same dtype and device)."""
        return cls(PagedLlama.from_hf(hf_model), num_blocks, block_size, attention, enable_prefix_caching,
                   **kwargs)

    def _new_scheduler(self) -> Scheduler:
        capacity = self.cache.num_blocks * self.cache.block_size
        caching = self.cache.prefix_cache is not None
        return Scheduler(self.cache, policy="paged", max_num_seqs=self.max_num_seqs,
                         max_model_len=capacity + 1, token_ids=self._token_ids if caching else None)

    def _token_ids(self, request: Request, n: int) -> list[int]:
        """The first ``n`` tokens of a request (prompt, then generated): what the scheduler looks up."""
        return self.tokens[request.req_id][:n]

    # ---------------------------------------------------------------------------------------------
    # one request, one step

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> int:
        """Queue one prompt (checked first); returns its request id for ``output``."""
        request, tokens = self._request("prompt", prompt, max_new_tokens)
        self._enqueue(request, tokens)
        return request.req_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> StepOutput:
        """Run one scheduler step: a batched decode for the running requests and one prefill for those
        just admitted (or readmitted after a preemption: prompt and generated tokens are recomputed);
        requests that have all their tokens are finished and their blocks freed."""
        plan = self.scheduler.step()
        sampled: dict[int, int] = {}
        if plan.decode:
            ids = [r.req_id for r in plan.decode]
            logits = self.model.decode(self.cache, ids, [self.tokens[i][-1] for i in ids],
                                       attention=self.attention)                   # [batch, vocab]
            sampled.update(zip(ids, logits.argmax(-1).tolist()))
        if plan.prefill:
            ids = [r.req_id for r, _ in plan.prefill]
            found = [self.cache.seq_lens[i] for i in ids]          # tokens in the blocks the cache found
            todo = [self.tokens[i][n:] for i, n in zip(ids, found)]  # the rest: prefilled
            assert [len(t) for t in todo] == [n for _, n in plan.prefill]
            logits = self.model.prefill(self.cache, ids, todo)
            sampled.update(zip(ids, logits.argmax(-1).tolist()))
            self.stats.prefill_tokens += sum(map(len, todo))
            self.stats.cached_tokens += sum(found)
        self._account(plan)
        for i, token in sampled.items():
            self.tokens[i].append(token)
        self.stats.generated_tokens += len(sampled)
        return StepOutput([r.req_id for r, _ in plan.prefill], [r.req_id for r in plan.decode],
                          [r.req_id for r in plan.preempted], self._retire(plan.scheduled))

    def output(self, req_id: int) -> list[int]:
        """The tokens request ``req_id`` generated so far (all of them once it finished)."""
        return self.tokens[req_id][self.prompt_lens[req_id]:]

    def _account(self, plan: Any) -> None:
        s = self.stats
        s.steps += 1
        s.decode_tokens += len(plan.decode)
        s.preemptions += len(plan.preempted)
        s.peak_blocks = max(s.peak_blocks, self.cache.num_used_blocks)
        s.peak_running = max(s.peak_running, len(plan.scheduled))

    def _retire(self, scheduled: list[Request]) -> list[int]:
        done = [r for r in scheduled if self.scheduler.generated[r.req_id] == r.output_len]
        for r in done:
            self.scheduler.finish(r)                                    # frees its blocks
            self.stats.finished.append(r.req_id)
        return [r.req_id for r in done]

    # ---------------------------------------------------------------------------------------------
    # many requests

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 progress: bool | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt: ``max_new_tokens`` new tokens each (no end-of-sequence
        stop), in the order of ``prompts``.

        Every prompt is checked before any work starts: ``ValueError`` for an empty prompt, a token id
        outside the vocabulary, ``max_new_tokens < 1``, or a request the pool could never hold (its
        prompt plus ``max_new_tokens - 1`` generated tokens must fit in the blocks). ``progress``: a
        tqdm bar (default: from ``PROGRESS_MIN_TOKENS`` new tokens on).
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        max_new_tokens = as_int("max_new_tokens", max_new_tokens, minimum=1)
        if self.scheduler.has_unfinished:
            raise ValueError("the engine still has unfinished requests (from add_request): step() them "
                             "to completion first")
        requests = [self._request(f"prompts[{i}]", p, max_new_tokens, i) for i, p in enumerate(prompts)]
        for request, tokens in requests:
            self._enqueue(request, tokens)
        total = len(requests) * max_new_tokens
        show = total >= PROGRESS_MIN_TOKENS if progress is None else bool(progress)
        try:
            self._drain(total, show)
        except BaseException:
            self.reset()
            raise
        return [self._collect(r.req_id) for r, _ in requests]

    def _drain(self, total: int, show: bool) -> None:
        from tqdm.auto import tqdm

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
        """Drop every request and free every block (after an error, or to start over). With prefix
        caching the cache is rebuilt empty: a block registered by an interrupted prefill may hold
        placeholder K/V, and must never be found."""
        for seq_id in list(self.cache.seq_lens):
            self.cache.free_sequence(seq_id)
        if self.cache.prefix_cache is not None:
            c = self.cache
            self.cache = self.model.new_cache(c.num_blocks, c.block_size, enable_prefix_caching=True)
        self.scheduler = self._new_scheduler()
        self.tokens.clear()
        self.prompt_lens.clear()

    def _request(self, name: str, prompt: Sequence[int], max_new_tokens: int,
                 offset: int = 0) -> tuple[Request, list[int]]:
        """Check one prompt (nothing is queued): the ``Request`` the scheduler sees, and its tokens."""
        tokens = token_list(name, prompt, self.model.shape.vocab_size)
        if not tokens:
            raise ValueError(f"{name} is empty: a prompt needs at least one token")
        max_new_tokens = as_int("max_new_tokens", max_new_tokens, minimum=1)
        request = Request(self._next_id + offset, 0, len(tokens), max_new_tokens)
        nb, bs = self.cache.num_blocks, self.cache.block_size
        if request.max_kv_len > nb * bs:
            raise ValueError(f"{name} ({len(tokens)} tokens) with max_new_tokens={max_new_tokens} needs "
                             f"{request.max_kv_len} token slots (the prompt and every new token but the "
                             f"last), more than the pool of {nb} blocks x {bs} = {nb * bs} can ever hold")
        try:
            self.scheduler.check(request)        # the scheduler's own limits (its free-block watermark)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        return request, tokens

    def _enqueue(self, request: Request, tokens: list[int]) -> None:
        self.scheduler.add(request)
        self.tokens[request.req_id] = tokens
        self.prompt_lens[request.req_id] = len(tokens)
        self._next_id = max(self._next_id, request.req_id + 1)
