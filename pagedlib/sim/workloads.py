"""Seeded synthetic workloads (notebook 07): ShareGPT-like, Alpaca-like and shared-system-prompt requests."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from pagedlib.core.request import Request
from pagedlib.sim._checks import check_arrivals, check_length_model, check_shared, check_sizes, check_workload


@dataclass(frozen=True)
class LengthModel:
    """Log-normal lengths in tokens: ``*_mean`` before rounding and clipping, ``*_sigma`` of the log."""

    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float

    def __post_init__(self) -> None:
        check_length_model(self)


# The paper's Figure 11: ShareGPT prompts and outputs average 161.31 and 337.99 tokens, Alpaca's 19.31 and
# 58.45. The sigmas are our choice (the paper gives means only); ShareGPT's means before clipping are set so
# that, once prompt + output is clipped to 2,048 tokens, they come out at the paper's.
SHAREGPT = LengthModel(prompt_mean=162, prompt_sigma=1.0, output_mean=353, output_sigma=1.0)
ALPACA = LengthModel(prompt_mean=19.31, prompt_sigma=0.6, output_mean=58.45, output_sigma=0.8)


def _lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, high: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # E[exp(N(mu, sigma^2))] = mean
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, high).astype(np.int64)


def _ids(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(0, vocab_size, n))


def _with_prompt(r: Request, prompt: tuple[int, ...], **changes: int) -> Request:
    """``r`` (id, arrival, output length unless ``changes`` say otherwise) with ``prompt``'s token ids."""
    return replace(r, prompt_len=len(prompt), prompt_tokens=prompt, **changes)


def synthetic_workload(num_requests: int, model: LengthModel, *, seed: int = 0, rate: float = 1.0,
                       max_model_len: int = 2048) -> list[Request]:
    """``num_requests`` requests with lengths drawn from ``model`` (``prompt + output <= max_model_len``)
    and Poisson arrivals, ``rate`` requests per step on average (``math.inf``: all at step 0)."""
    n, seed, rate, max_model_len = check_workload(num_requests, seed, rate, max_model_len)
    rng = np.random.default_rng(seed)
    prompts = _lengths(rng, n, model.prompt_mean, model.prompt_sigma, max_model_len - 1)
    outputs = _lengths(rng, n, model.output_mean, model.output_sigma, max_model_len)
    outputs = np.minimum(outputs, max_model_len - prompts)
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1 / rate, n)
    arrivals = np.floor(np.cumsum(gaps))
    check_arrivals(arrivals, rate)
    return [Request(i, int(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def sharegpt_like(num_requests: int, seed: int = 0, *, rate: float = 1.0,
                  max_model_len: int = 2048) -> list[Request]:
    """Conversations: long prompts (mean ~161 tokens) and long outputs (mean ~338), as ShareGPT."""
    return synthetic_workload(num_requests, SHAREGPT, seed=seed, rate=rate, max_model_len=max_model_len)


def alpaca_like(num_requests: int, seed: int = 0, *, rate: float = 1.0,
                max_model_len: int = 2048) -> list[Request]:
    """Instructions: short prompts (mean ~19 tokens) and short outputs (mean ~58), as Alpaca."""
    return synthetic_workload(num_requests, ALPACA, seed=seed, rate=rate, max_model_len=max_model_len)


def shared_prompt_like(num_requests: int, seed: int = 0, *, system_len: int = 341,
                       num_system_prompts: int = 2, rate: float = 1.0,
                       vocab_size: int = 32000) -> list[Request]:
    """Alpaca-like user turns behind one of ``num_system_prompts`` random system prompts of ``system_len``
    tokens (341: the paper's 5-shot translation prefix, §6.4); requests carry their token ids."""
    system_len, k, vocab_size = check_shared(num_requests, system_len, num_system_prompts, vocab_size,
                                             OUTPUT_TOKEN_BASE)
    base = alpaca_like(num_requests, seed, rate=rate, max_model_len=2048 - system_len)
    rng = np.random.default_rng([seed, 1])
    systems = [_ids(rng, system_len, vocab_size) for _ in range(k)]
    out = []
    for r in base:
        user = _ids(rng, r.prompt_len, vocab_size)  # drawn before the choice of system prompt
        out.append(_with_prompt(r, systems[int(rng.integers(k))] + user))
    return out


#: Made-up token ids of simulated outputs start here, above any vocabulary a workload draws prompts from.
OUTPUT_TOKEN_BASE = 1 << 40


def fake_token_ids(request: Request, stop: int, start: int = 0) -> list[int]:
    """Token ids of positions ``start .. stop-1`` of a simulated request: its prompt's, then made-up output
    ids, distinct and the same on every call (a readmitted request finds its own blocks again)."""
    if request.prompt_tokens is None:
        raise ValueError(f"request {request.req_id} has no prompt_tokens (prefix caching needs them)")
    p, base = request.prompt_len, OUTPUT_TOKEN_BASE * (request.req_id + 1)
    return list(request.prompt_tokens[start:stop]) + [base + i for i in range(max(start, p) - p, stop - p)]


def fake_output_token(request: Request) -> int:
    """The made-up id of the next token ``request`` samples in a simulation (``fake_token_ids``' output)."""
    return OUTPUT_TOKEN_BASE * (request.req_id + 1) + len(request.output_tokens)


# Workloads of notebook 11, prefix caching's cases: each request carries its token ids (random ids below
# ``VOCAB_SIZE``; a turn that resends a reply resends the made-up output ids ``fake_token_ids`` gives it).
VOCAB_SIZE = 32000


def multi_turn_like(num_conversations: int, turns: int = 4, seed: int = 0) -> list[Request]:
    """Chat: turn ``t`` of a conversation resends the whole conversation so far (every earlier user message
    and reply) plus a new user message of 20 to 60 tokens, 100 steps after the previous turn arrived;
    replies of 1 to 119 tokens; conversations start one step apart."""
    n, turns = check_sizes(num_conversations=num_conversations, num_turns=turns)
    rng, out = np.random.default_rng([seed, 11]), []
    for c in range(n):
        history: tuple[int, ...] = ()
        for t in range(turns):
            prompt = history + _ids(rng, int(rng.integers(20, 61)), VOCAB_SIZE)
            r = Request(len(out), c + t * 100, len(prompt), int(rng.integers(1, 120)), prompt)
            out.append(r)
            history = tuple(fake_token_ids(r, r.prompt_len + r.output_len))
    return out


def few_shot_like(num_requests: int, seed: int = 0, *, num_examples: int = 6) -> list[Request]:
    """Few-shot prompts: the first ``k`` of ``num_examples`` fixed examples of 50 tokens, always in the same
    order (``k`` drawn per request), then a question of its own (20 tokens); Alpaca-like output lengths and
    Poisson arrivals, a request a step on average."""
    (k,) = check_sizes(num_examples=num_examples)
    base, rng = alpaca_like(num_requests, seed), np.random.default_rng([seed, 12])
    examples = [_ids(rng, 50, VOCAB_SIZE) for _ in range(k)]
    return [_with_prompt(r, sum(examples[:rng.integers(1, k + 1)], ()) + _ids(rng, 20, VOCAB_SIZE))
            for r in base]


def branching_like(num_trees: int, branches: int = 4, seed: int = 0, *, stem_len: int = 200) -> list[Request]:
    """Tree of thought, parallel samples: every 20 steps a stem request (a problem of ``stem_len`` tokens,
    one new token), then, one step later, ``branches`` requests that resend the stem plus a thought of their
    own (30 tokens) and generate 40 tokens each, diverging right after the stem, inside a block unless
    ``stem_len`` is a multiple of the block size."""
    n, branches, stem_len = check_sizes(num_trees=num_trees, num_branches=branches, stem_len=stem_len)
    rng, out = np.random.default_rng([seed, 13]), []
    for t in range(n):
        stem = _ids(rng, stem_len, VOCAB_SIZE)
        out.append(Request(len(out), t * 20, stem_len, 1, stem))
        for _ in range(branches):
            prompt = stem + _ids(rng, 30, VOCAB_SIZE)
            out.append(Request(len(out), t * 20 + 1, len(prompt), 40, prompt))
    return out


def unique_documents_like(num_requests: int, seed: int = 0, *, doc_len: int = 1000) -> list[Request]:
    """Long documents that share nothing (summaries, retrieval): prompts of ``doc_len`` tokens +- 50%, 50 new
    tokens each, Poisson arrivals, 0.2 requests a step on average."""
    (doc_len,) = check_sizes(doc_len=doc_len)
    base, rng = alpaca_like(num_requests, seed, rate=0.2), np.random.default_rng([seed, 14])
    return [_with_prompt(r, _ids(rng, int(rng.integers(doc_len // 2, doc_len * 3 // 2 + 1)), VOCAB_SIZE),
                         output_len=50) for r in base]
