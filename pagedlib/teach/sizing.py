"""KV-cache memory math: how many bytes a cache needs, and how much of it a scheme wastes.

Every decoder layer keeps, for every token it has seen, one key and one value vector per KV head.
So one token costs ``2 (K and V) x num_layers x num_kv_heads x head_dim x dtype_bytes`` bytes, and
a cache is that figure times the number of token *slots* it holds. The two schemes the course
compares differ only in how many slots they hold:

- **contiguous**: every sequence reserves ``max_tokens`` slots up front;
- **paged**: a sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks of ``block_size`` slots.

All functions are pure integer arithmetic: they return exact byte and slot counts.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from pagedlib.checks import as_int, ceil_div

__all__ = [
    "DTYPE_BYTES",
    "MAX_SEQ_LEN",
    "PRESETS",
    "ModelSpec",
    "block_table_entries",
    "blocks_needed",
    "contiguous_kv_bytes",
    "contiguous_utilization",
    "contiguous_wasted_slots",
    "format_bytes",
    "kv_bytes_per_token",
    "max_sequences",
    "paged_kv_bytes",
    "paged_utilization",
    "paged_wasted_slots",
    "synthetic_seq_len_chunks",
    "synthetic_seq_lens",
]

#: Bytes per element of the dtypes a KV cache is stored in.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}

#: Largest sequence length the sizing functions take (4.6e18 tokens): block arithmetic stays in int64.
MAX_SEQ_LEN = 2**62


@dataclass(frozen=True)
class ModelSpec:
    """The attention shape of a model: all the KV-cache size depends on.

    ``num_q_heads`` does not enter the cache size (queries are never cached) but tells how many
    query heads share one KV head: ``num_q_heads // num_kv_heads`` is the GQA group size.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads"):  # numpy ints -> int
            object.__setattr__(self, field, as_int(field, getattr(self, field), minimum=1))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = multi-head attention, num_q_heads = multi-query attention)."""
        return self.num_q_heads // self.num_kv_heads


#: Attention shapes read from each model's published ``config.json`` on the Hugging Face Hub
#: (``num_hidden_layers``, ``num_key_value_heads``, ``num_attention_heads``, and
#: ``head_dim = hidden_size // num_attention_heads``):
#:
#: - ``llama-2-7b``: meta-llama/Llama-2-7b-hf (32 layers, 32 heads, hidden 4096: no GQA)
#: - ``llama-3-8b``: meta-llama/Meta-Llama-3-8B (32 layers, 32 heads, 8 KV heads, hidden 4096)
#: - ``mistral-7b``: mistralai/Mistral-7B-v0.1 (32 layers, 32 heads, 8 KV heads, hidden 4096)
#: - ``llama-3-70b``: meta-llama/Meta-Llama-3-70B (80 layers, 64 heads, 8 KV heads, hidden 8192)
#: - ``qwen2.5-7b``: Qwen/Qwen2.5-7B (28 layers, 28 heads, 4 KV heads, hidden 3584)
#: - ``opt-13b``: facebook/opt-13b (40 layers, 40 heads, hidden 5120: no GQA); the model the vLLM
#:   paper (Kwon et al., SOSP 2023, section 3) sizes at 800 KB of KV cache per token.
PRESETS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128, num_q_heads=32),
        ModelSpec("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32),
        ModelSpec("mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32),
        ModelSpec("llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128, num_q_heads=64),
        ModelSpec("qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, num_q_heads=28),
        ModelSpec("opt-13b", num_layers=40, num_kv_heads=40, head_dim=128, num_q_heads=40),
    )
}


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2) -> int:
    """Bytes of K and V that one token occupies across all layers.

    ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``: the K tensor of one layer holds
    ``[num_kv_heads, head_dim]`` per token, V the same, and every layer has its own pair.
    """
    dtype_bytes = as_int("dtype_bytes", dtype_bytes, minimum=1)
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes


def contiguous_kv_bytes(spec: ModelSpec, max_tokens: int, num_seqs: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes reserved when each of ``num_seqs`` sequences pre-allocates ``max_tokens`` slots."""
    max_tokens = as_int("max_tokens", max_tokens, minimum=1)
    num_seqs = as_int("num_seqs", num_seqs, minimum=1)
    return kv_bytes_per_token(spec, dtype_bytes) * max_tokens * num_seqs


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    num_tokens = as_int("num_tokens", num_tokens, minimum=0)
    block_size = as_int("block_size", block_size, minimum=1)
    return ceil_div(num_tokens, block_size)


def paged_kv_bytes(spec: ModelSpec, seq_lens: Iterable[int], block_size: int, dtype_bytes: int = 2) -> int:
    """Bytes held by a paged cache for sequences of the given lengths (whole blocks per sequence)."""
    slots = _block_slots(_seq_lens(seq_lens), block_size)  # ceil(n / block_size) * block_size for each n
    return kv_bytes_per_token(spec, dtype_bytes) * sum(slots.tolist())


def paged_wasted_slots(seq_len: int, block_size: int) -> int:
    """Empty slots at the end of a sequence's last block: always in ``[0, block_size - 1]``."""
    return blocks_needed(seq_len, block_size) * block_size - seq_len


def contiguous_wasted_slots(seq_len: int, max_tokens: int) -> int:
    """Reserved but unused slots of a sequence that pre-allocated ``max_tokens``."""
    seq_len = as_int("seq_len", seq_len, minimum=0)
    max_tokens = as_int("max_tokens", max_tokens, minimum=1)
    if seq_len > max_tokens:
        raise ValueError(f"seq_len ({seq_len}) exceeds max_tokens ({max_tokens})")
    return max_tokens - seq_len


def block_table_entries(seq_lens: Iterable[int], block_size: int) -> int:
    """Total block-table entries (one int32 each) for the given sequences: ``sum(ceil(n / block_size))``."""
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN)
    return sum(ceil_div(_seq_lens(seq_lens), block_size).tolist())


def contiguous_utilization(seq_lens: Iterable[int], max_tokens: int) -> float:
    """Fraction of reserved slots that hold a token when every sequence reserves ``max_tokens``."""
    lens = _reserved_lens(seq_lens, max_tokens)
    return sum(lens.tolist()) / (len(lens) * max_tokens) if len(lens) else 1.0


def paged_utilization(seq_lens: Iterable[int], block_size: int) -> float:
    """Fraction of allocated slots that hold a token when sequences hold whole blocks."""
    lens = _seq_lens(seq_lens)
    allocated = sum(_block_slots(lens, block_size).tolist())
    return sum(lens.tolist()) / allocated if allocated else 1.0


def max_sequences(
    spec: ModelSpec, budget_bytes: int, seq_lens: Iterable[int] | np.ndarray, *,
    max_tokens: int | None = None, block_size: int | None = None, dtype_bytes: int = 2,
) -> int:
    """How many of the given sequences, admitted in order, fit in ``budget_bytes`` of KV cache.

    Give ``max_tokens`` for contiguous reservation or ``block_size`` for paging (exactly one). Each
    sequence costs its slots (``max_tokens``, or its whole blocks) times ``kv_bytes_per_token``; the
    answer is the longest prefix whose running total stays within the budget. Exact for any size.
    """
    budget_bytes = as_int("budget_bytes", budget_bytes, minimum=0)
    if (max_tokens is None) == (block_size is None):
        raise ValueError("give exactly one of max_tokens (contiguous) or block_size (paged)")
    limit = budget_bytes // kv_bytes_per_token(spec, dtype_bytes)  # a prefix fits iff its slots <= limit
    if max_tokens is not None:
        slots = np.full_like(_reserved_lens(seq_lens, max_tokens), max_tokens)  # the reservation ignores n
    else:
        slots = _block_slots(_seq_lens(seq_lens), block_size)
    if limit >= 2**62:  # beyond int64 headroom: exact Python ints
        return bisect.bisect_right(list(itertools.accumulate(slots.tolist())), limit)
    total = np.cumsum(np.minimum(slots, limit + 1))  # capped: cannot wrap before it passes the limit
    over = total > limit
    return int(over.argmax()) if over.any() else len(total)


def _seq_lens(seq_lens: Iterable[int] | np.ndarray) -> np.ndarray:
    """``seq_lens`` as an int64 array, each length checked to be an int in ``[0, MAX_SEQ_LEN]``."""
    if isinstance(seq_lens, np.ndarray) and seq_lens.dtype.kind in "iu" and seq_lens.ndim == 1:
        bad = np.flatnonzero((seq_lens < 0) | (seq_lens > MAX_SEQ_LEN))
        if bad.size:
            raise ValueError(f"seq_lens[{bad[0]}] must be in [0, {MAX_SEQ_LEN}], got {seq_lens[bad[0]]}")
        return seq_lens.astype(np.int64)
    return np.array([as_int(f"seq_lens[{i}]", n, minimum=0, maximum=MAX_SEQ_LEN)
                     for i, n in enumerate(seq_lens)], dtype=np.int64)


def _block_slots(lens: np.ndarray, block_size: int) -> np.ndarray:
    """Slots each sequence holds in whole blocks: ``ceil(n / block_size) * block_size`` (int64)."""
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN)
    return ceil_div(lens, block_size) * block_size


def _reserved_lens(seq_lens: Iterable[int], max_tokens: int) -> np.ndarray:
    """``seq_lens`` checked against a reservation of ``max_tokens`` slots each."""
    max_tokens = as_int("max_tokens", max_tokens, minimum=1, maximum=MAX_SEQ_LEN)
    lens = _seq_lens(seq_lens)
    if len(lens) and lens.max() > max_tokens:
        raise ValueError(f"seq_lens holds {lens.max()} tokens, which exceeds max_tokens ({max_tokens})")
    return lens


def synthetic_seq_lens(
    num_seqs: int, *, max_tokens: int = 4096, median: int = 300, sigma: float = 1.0, seed: int = 0,
    as_array: bool = False,
) -> list[int] | np.ndarray:
    """Lengths (prompt + generated tokens) of a seeded synthetic request mix.

    Drawn from a log-normal distribution with the given ``median`` and log-space ``sigma``, rounded,
    and clipped to ``[1, max_tokens]``. Log-normal because serving traces look like it: lengths are
    positive and right-skewed, most requests are short and a few run to the limit. (The vLLM paper's
    ShareGPT workload averages ~161 input and ~338 output tokens, its Alpaca workload ~19 and ~58.)
    The first ``n`` lengths do not depend on ``num_seqs``; ``as_array`` returns an int64 array.
    """
    num_seqs = as_int("num_seqs", num_seqs, minimum=1)
    stream = synthetic_seq_len_chunks(num_seqs, max_tokens=max_tokens, median=median, sigma=sigma, seed=seed)
    lens = next(stream)
    return lens if as_array else lens.tolist()


def synthetic_seq_len_chunks(
    chunk: int, *, max_tokens: int = 4096, median: int = 300, sigma: float = 1.0, seed: int = 0,
) -> Iterator[np.ndarray]:
    """The same seeded stream as ``synthetic_seq_lens``, endlessly, ``chunk`` lengths at a time (int64
    arrays): the stream's first ``n`` values are ``synthetic_seq_lens(n)`` whatever the chunking."""
    chunk = as_int("chunk", chunk, minimum=1)
    max_tokens = as_int("max_tokens", max_tokens, minimum=1)
    median = as_int("median", median, minimum=1)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
        raise ValueError(f"sigma must be a positive number, got {sigma!r}")
    rng = np.random.default_rng(as_int("seed", seed, minimum=0))
    while True:
        raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=chunk)
        yield np.clip(np.rint(raw), 1, max_tokens).astype(np.int64)


def format_bytes(n: int | float) -> str:
    """Binary units, three significant digits: ``format_bytes(2**29) == '512 MiB'``, ``'1.25 GiB'``.

    The unit is chosen after rounding, so 1,048,575 bytes print as ``'1 MiB'``, never ``'1024 KiB'``."""
    value = float(n) if isinstance(n, (int, float, np.number)) and not isinstance(n, bool) else math.nan
    if not math.isfinite(value):
        raise ValueError(f"n must be a finite number of bytes, got {n!r}")
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        text = f"{value:.0f}" if value.is_integer() or abs(value) >= 100 else f"{value:.3g}"
        if abs(float(text)) < 1024 or unit == "PiB":
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
