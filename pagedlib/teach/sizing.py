"""KV-cache memory math, in exact integers: a token costs ``2 (K and V) x num_layers x num_kv_heads x head_dim
x dtype_bytes``; a **contiguous** cache reserves ``max_tokens`` per sequence, a **paged** one whole blocks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from pagedlib.util import as_int, ceil_div, refuse

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}  # bytes per element
MAX_SEQ_LEN = 2**62  # the longest sequence taken (tokens): block arithmetic stays in int64


@dataclass(frozen=True)
class ModelSpec:
    """All the KV-cache size depends on (``num_q_heads`` only sets the GQA group: queries are not cached)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int

    def __post_init__(self) -> None:  # the checks: numpy ints become ints, GQA groups must divide
        for field in ("num_layers", "num_kv_heads", "head_dim", "num_q_heads"):
            object.__setattr__(self, field, as_int(field, getattr(self, field), minimum=1))
        refuse((self.num_q_heads % self.num_kv_heads,
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"))

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1: multi-head attention; ``num_q_heads``: multi-query attention)."""
        return self.num_q_heads // self.num_kv_heads


#: From the ``config.json`` of meta-llama/Llama-2-7b-hf, Meta-Llama-3-8B and -70B, mistralai/Mistral-7B-v0.1,
#: Qwen/Qwen2.5-7B and facebook/opt-13b (800 KB a token in the vLLM paper, Kwon et al., SOSP 2023, section 3).
PRESETS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("llama-2-7b", num_layers=32, num_kv_heads=32, head_dim=128, num_q_heads=32),
    ModelSpec("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32),
    ModelSpec("mistral-7b", num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32),
    ModelSpec("llama-3-70b", num_layers=80, num_kv_heads=8, head_dim=128, num_q_heads=64),
    ModelSpec("qwen2.5-7b", num_layers=28, num_kv_heads=4, head_dim=128, num_q_heads=28),
    ModelSpec("opt-13b", num_layers=40, num_kv_heads=40, head_dim=128, num_q_heads=40),
)}


def kv_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2) -> int:
    """Bytes of K and V that one token occupies across all layers."""
    dtype_bytes = as_int("dtype_bytes", dtype_bytes, minimum=1)
    # per layer, K holds [num_kv_heads, head_dim] numbers for each token, and V as many
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * dtype_bytes


def contiguous_kv_bytes(spec: ModelSpec, max_tokens: int, num_seqs: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes reserved when each of ``num_seqs`` sequences pre-allocates ``max_tokens`` slots."""
    max_tokens = as_int("max_tokens", max_tokens, minimum=1)
    num_seqs = as_int("num_seqs", num_seqs, minimum=1)
    return kv_bytes_per_token(spec, dtype_bytes) * max_tokens * num_seqs


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` slots that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    num_tokens = as_int("num_tokens", num_tokens, minimum=0)
    return ceil_div(num_tokens, as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN))


def paged_kv_bytes(spec: ModelSpec, seq_lens: Iterable[int], block_size: int, dtype_bytes: int = 2) -> int:
    """Bytes held by a paged cache for sequences of the given lengths (whole blocks per sequence)."""
    slots = _block_slots(_check_lens(seq_lens), block_size)  # whole blocks: ceil(n / block_size) * block_size
    return kv_bytes_per_token(spec, dtype_bytes) * sum(slots.tolist())


def paged_wasted_slots(seq_len: int, block_size: int) -> int:
    """Empty slots at the end of a sequence's last block: always in ``[0, block_size - 1]``."""
    seq_len = as_int("seq_len", seq_len, minimum=0)
    return blocks_needed(seq_len, block_size) * block_size - seq_len


def mean_tail_waste(block_size: int) -> float:
    """Empty slots at the end of a sequence's last block, averaged over lengths spread evenly over the
    remainders modulo ``block_size``: the mean of ``paged_wasted_slots`` over ``0 .. block_size - 1``,
    ``(block_size - 1) / 2``."""
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN)
    return (block_size - 1) / 2


def contiguous_wasted_slots(seq_len: int, max_tokens: int) -> int:
    """Reserved but unused slots of a sequence that pre-allocated ``max_tokens``."""
    lens, max_tokens = _check_reserved([as_int("seq_len", seq_len, minimum=0)], max_tokens)
    return max_tokens - int(lens[0])


def block_table_entries(seq_lens: Iterable[int], block_size: int) -> int:
    """Total block-table entries (one int32 each) for the given sequences: ``sum(ceil(n / block_size))``."""
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN)
    return sum(ceil_div(_check_lens(seq_lens), block_size).tolist())


def contiguous_utilization(seq_lens: Iterable[int], max_tokens: int) -> float:
    """Fraction of reserved slots that hold a token when every sequence reserves ``max_tokens``."""
    lens, max_tokens = _check_reserved(seq_lens, max_tokens)
    return sum(lens.tolist()) / (len(lens) * max_tokens) if len(lens) else 1.0


def paged_utilization(seq_lens: Iterable[int], block_size: int) -> float:
    """Fraction of allocated slots that hold a token when sequences hold whole blocks."""
    lens = _check_lens(seq_lens)
    allocated = sum(_block_slots(lens, block_size).tolist())
    return sum(lens.tolist()) / allocated if allocated else 1.0


def max_sequences(spec: ModelSpec, budget_bytes: int, seq_lens: Iterable[int], *,
                  max_tokens: int | None = None, block_size: int | None = None, dtype_bytes: int = 2) -> int:
    """How many of the given sequences, admitted in order, fit in ``budget_bytes`` of KV cache: the longest
    prefix whose slots (``max_tokens`` each if given, else whole blocks of ``block_size``) fit."""
    budget_bytes = _check_scheme(budget_bytes, max_tokens, block_size)
    limit = budget_bytes // kv_bytes_per_token(spec, dtype_bytes)  # a prefix fits iff its slots <= limit
    slots = (_block_slots(_check_lens(seq_lens), block_size) if max_tokens is None
             else np.full_like(_check_reserved(seq_lens, max_tokens)[0], max_tokens))  # ignores each n
    # int64 sums of slots capped at limit + 1 cannot wrap before they pass the limit; past 2**62, Python ints
    over = np.cumsum(np.minimum(slots, limit + 1) if limit < 2**62 else slots.astype(object)) > limit
    return int(over.argmax()) if over.any() else len(over)


def _block_slots(lens: np.ndarray, block_size: int) -> np.ndarray:  # ceil(n / block_size) * block_size
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN)
    return ceil_div(lens, block_size) * block_size


def synthetic_seq_lens(num_seqs: int, *, max_tokens: int = 4096, median: int = 300, sigma: float = 1.0,
                       seed: int = 0) -> list[int]:
    """Lengths (prompt + generated tokens) of a seeded synthetic request mix: log-normal with the given
    ``median`` and log-space ``sigma``, rounded, clipped to ``[1, max_tokens]``."""
    num_seqs = as_int("num_seqs", num_seqs, minimum=1)
    stream = synthetic_seq_len_chunks(num_seqs, max_tokens=max_tokens, median=median, sigma=sigma, seed=seed)
    return next(stream).tolist()


def synthetic_seq_len_chunks(chunk: int, *, max_tokens: int = 4096, median: int = 300, sigma: float = 1.0,
                             seed: int = 0) -> Iterator[np.ndarray]:
    """``synthetic_seq_lens``'s stream, endlessly, ``chunk`` lengths at a time (int64 arrays)."""
    chunk, max_tokens, median, seed = _check_stream(chunk, max_tokens, median, sigma, seed)
    rng = np.random.default_rng(seed)
    while True:
        raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=chunk)
        yield np.clip(np.rint(raw), 1, max_tokens).astype(np.int64)


def format_bytes(n: int | float) -> str:
    """Binary units, three significant digits: ``format_bytes(2**29) == '512 MiB'``, ``'1.25 GiB'``."""
    value = float(n) if isinstance(n, (int, float, np.number)) and not isinstance(n, bool) else math.nan
    refuse((not math.isfinite(value), f"n must be a finite number of bytes, got {n!r}"))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        text = f"{value:.0f}" if value.is_integer() or abs(value) >= 100 else f"{value:.3g}"
        if abs(float(text)) < 1024 or unit == "PiB":  # unit chosen after rounding: never '1024 KiB'
            return f"{text} {unit}"
        value /= 1024


def _check_lens(seq_lens: Iterable[int] | np.ndarray) -> np.ndarray:
    if not (isinstance(seq_lens, np.ndarray) and seq_lens.dtype.kind in "iu" and seq_lens.ndim == 1):
        seq_lens = np.array([as_int(f"seq_lens[{i}]", n) for i, n in enumerate(seq_lens)], dtype=object)
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > MAX_SEQ_LEN))
    if bad.size:
        raise ValueError(f"seq_lens[{bad[0]}] must be in [0, {MAX_SEQ_LEN}], got {seq_lens[bad[0]]}")
    return seq_lens.astype(np.int64)


def _check_reserved(seq_lens: Iterable[int], max_tokens: object) -> tuple[np.ndarray, int]:
    max_tokens = as_int("max_tokens", max_tokens, minimum=1, maximum=MAX_SEQ_LEN)
    lens = _check_lens(seq_lens)
    if len(lens) and lens.max() > max_tokens:
        raise ValueError(f"a sequence of {lens.max()} tokens exceeds max_tokens ({max_tokens})")
    return lens, max_tokens


def _check_scheme(budget_bytes, max_tokens, block_size) -> int:
    budget_bytes = as_int("budget_bytes", budget_bytes, minimum=0)
    if (max_tokens is None) == (block_size is None):
        raise ValueError("give exactly one of max_tokens (contiguous) or block_size (paged)")
    return budget_bytes


def _check_stream(chunk, max_tokens, median, sigma, seed) -> tuple:
    ints = [as_int(k, v, minimum=1)
            for k, v in (("chunk", chunk), ("max_tokens", max_tokens), ("median", median))]
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not sigma > 0:
        raise ValueError(f"sigma must be a positive number, got {sigma!r}")
    return (*ints, as_int("seed", seed, minimum=0))
