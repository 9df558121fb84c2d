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

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "DTYPE_BYTES",
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
    "synthetic_seq_lens",
]

#: Bytes per element of the dtypes a KV cache is stored in.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _check_int(name: str, value: object, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an integer >= ``minimum``; otherwise raise ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


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
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads"):
            _check_int(field, getattr(self, field))
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
    dtype_bytes = _check_int("dtype_bytes", dtype_bytes)
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes


def contiguous_kv_bytes(spec: ModelSpec, max_tokens: int, num_seqs: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes reserved when each of ``num_seqs`` sequences pre-allocates ``max_tokens`` slots."""
    max_tokens = _check_int("max_tokens", max_tokens)
    num_seqs = _check_int("num_seqs", num_seqs)
    return kv_bytes_per_token(spec, dtype_bytes) * max_tokens * num_seqs


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    num_tokens = _check_int("num_tokens", num_tokens, minimum=0)
    block_size = _check_int("block_size", block_size)
    return -(-num_tokens // block_size)


def _seq_lens(seq_lens: Iterable[int]) -> list[int]:
    lens = list(seq_lens)
    for i, n in enumerate(lens):
        _check_int(f"seq_lens[{i}]", n, minimum=0)
    return [int(n) for n in lens]


def paged_kv_bytes(spec: ModelSpec, seq_lens: Iterable[int], block_size: int, dtype_bytes: int = 2) -> int:
    """Bytes held by a paged cache for sequences of the given lengths (whole blocks per sequence)."""
    block_size = _check_int("block_size", block_size)
    slots = sum(blocks_needed(n, block_size) * block_size for n in _seq_lens(seq_lens))
    return kv_bytes_per_token(spec, dtype_bytes) * slots


def paged_wasted_slots(seq_len: int, block_size: int) -> int:
    """Empty slots at the end of a sequence's last block: always in ``[0, block_size - 1]``."""
    return blocks_needed(seq_len, block_size) * block_size - seq_len


def contiguous_wasted_slots(seq_len: int, max_tokens: int) -> int:
    """Reserved but unused slots of a sequence that pre-allocated ``max_tokens``."""
    seq_len = _check_int("seq_len", seq_len, minimum=0)
    max_tokens = _check_int("max_tokens", max_tokens)
    if seq_len > max_tokens:
        raise ValueError(f"seq_len ({seq_len}) exceeds max_tokens ({max_tokens})")
    return max_tokens - seq_len


def block_table_entries(seq_lens: Iterable[int], block_size: int) -> int:
    """Total block-table entries (one int32 each) for the given sequences."""
    block_size = _check_int("block_size", block_size)
    return sum(blocks_needed(n, block_size) for n in _seq_lens(seq_lens))


def _utilization(used: int, reserved: int) -> float:
    return used / reserved if reserved else 1.0


def contiguous_utilization(seq_lens: Iterable[int], max_tokens: int) -> float:
    """Fraction of reserved slots that hold a token when every sequence reserves ``max_tokens``."""
    max_tokens = _check_int("max_tokens", max_tokens)
    lens = _seq_lens(seq_lens)
    for n in lens:
        contiguous_wasted_slots(n, max_tokens)  # validates n <= max_tokens
    return _utilization(sum(lens), len(lens) * max_tokens)


def paged_utilization(seq_lens: Iterable[int], block_size: int) -> float:
    """Fraction of allocated slots that hold a token when sequences hold whole blocks."""
    block_size = _check_int("block_size", block_size)
    lens = _seq_lens(seq_lens)
    allocated = sum(blocks_needed(n, block_size) * block_size for n in lens)
    return _utilization(sum(lens), allocated)


def max_sequences(
    spec: ModelSpec, budget_bytes: int, seq_lens: Iterable[int] | np.ndarray, *,
    max_tokens: int | None = None, block_size: int | None = None, dtype_bytes: int = 2,
) -> int:
    """How many of the given sequences, admitted in order, fit in ``budget_bytes`` of KV cache.

    Give ``max_tokens`` for contiguous reservation or ``block_size`` for paging (exactly one). Each
    sequence costs its slots (``max_tokens``, or its whole blocks) times ``kv_bytes_per_token``; the
    answer is the longest prefix whose running total stays within the budget.
    """
    budget_bytes = _check_int("budget_bytes", budget_bytes, minimum=0)
    if (max_tokens is None) == (block_size is None):
        raise ValueError("give exactly one of max_tokens (contiguous) or block_size (paged)")
    per_token = kv_bytes_per_token(spec, dtype_bytes)
    if isinstance(seq_lens, np.ndarray) and seq_lens.dtype.kind in "iu":  # validated in one go
        if seq_lens.size and seq_lens.min() < 0:
            raise ValueError(f"seq_lens must be >= 0, got {seq_lens.min()}")
        lens = seq_lens.astype(np.int64)
    else:
        lens = np.asarray(_seq_lens(seq_lens), dtype=np.int64)
    if max_tokens is not None:
        max_tokens = _check_int("max_tokens", max_tokens)
        if lens.size and lens.max() > max_tokens:
            raise ValueError(f"seq_lens holds {lens.max()} tokens, more than max_tokens ({max_tokens})")
        slots = np.full_like(lens, max_tokens)  # the reservation ignores the actual length
    else:
        block_size = _check_int("block_size", block_size)
        slots = -(-lens // block_size) * block_size  # whole blocks
    running = np.cumsum(slots * per_token)
    return int(np.searchsorted(running, budget_bytes, side="right"))


def synthetic_seq_lens(
    num_seqs: int, *, max_tokens: int = 4096, median: int = 300, sigma: float = 1.0, seed: int = 0,
    as_array: bool = False,
) -> list[int] | np.ndarray:
    """Lengths (prompt + generated tokens) of a seeded synthetic request mix.

    Drawn from a log-normal distribution with the given ``median`` and log-space ``sigma``, rounded,
    and clipped to ``[1, max_tokens]``. Log-normal because serving traces look like it: lengths are
    positive and right-skewed, most requests are a few hundred tokens and a few run to the limit
    (the chat traces used in the vLLM paper have means of a few hundred tokens and long tails).
    The first ``n`` lengths do not depend on ``num_seqs``; ``as_array`` returns an int64 array.
    """
    num_seqs = _check_int("num_seqs", num_seqs)
    max_tokens = _check_int("max_tokens", max_tokens)
    median = _check_int("median", median)
    if not (isinstance(sigma, (int, float)) and sigma > 0):
        raise ValueError(f"sigma must be a positive number, got {sigma!r}")
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=num_seqs)
    lens = np.clip(np.rint(raw), 1, max_tokens).astype(np.int64)
    return lens if as_array else lens.tolist()


def format_bytes(n: int | float) -> str:
    """Binary units, three significant digits: ``format_bytes(2**29) == '512 MiB'``, ``'1.25 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() or abs(n) >= 100 else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
