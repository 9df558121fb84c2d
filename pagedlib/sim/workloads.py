"""Seeded synthetic workloads (notebook 07): ShareGPT-like, Alpaca-like and shared-system-prompt requests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pagedlib.core.scheduler import Request
from pagedlib.sim._checks import check_arrivals, check_length_model, check_shared, check_workload


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
    systems = [tuple(int(t) for t in rng.integers(0, vocab_size, system_len)) for _ in range(k)]
    out = []
    for r in base:
        user = tuple(int(t) for t in rng.integers(0, vocab_size, r.prompt_len))
        tokens = systems[int(rng.integers(k))] + user
        out.append(Request(r.req_id, r.arrival, len(tokens), r.output_len, tokens))
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


