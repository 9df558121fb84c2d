"""Inputs of the attention tasks (notebooks 04 and 05): one decode step over a batch of sequences whose K/V
sit in a ``PagedKVCache``, as ``paged_attention`` takes them, with what the checks need to say about them.

``Case`` names an input in plain numbers (the failing input a reader sees); ``build`` makes its tensors:
blocks handed out in a shuffled order, every slot that holds no token filled with what a previous owner
left (random numbers) or with garbage (NaN, or 1e4), block tables padded with -1 or with the ids of free
blocks full of garbage. ``compare`` runs the reader's code, checks that it left its inputs as they were and
holds its output to the float64 oracle at the dtype's tolerance; ``head_probe`` builds inputs on which
each query head's output says which KV head it read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pagedlib.core.cache import PagedKVCache
from pagedlib.grade.framework import Failed, expect_equal
from pagedlib.kernels.attention import TOLERANCES, paged_attention_oracle
from pagedlib.testing import fill_unused
from pagedlib.util import ceil_div

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ARGS = ("q", "k_cache", "v_cache", "block_tables", "seq_lens")


@dataclass(frozen=True)
class Case:
    """One decode step: ``seq_lens`` tokens per sequence, ``q_heads = kv_heads * group``; ``garbage``: what
    unused slots hold (``None``: a previous owner's random K/V; ``"nan"``; ``"1e4"``); ``table_garbage``:
    unused table entries name free blocks instead of -1; ``layers`` > 1: the caches are a strided view
    (the last layer of the pool); ``last_block_at_end``: the batch's last block is the pool's last, with no
    block to spare; ``exact_width``: the tables are as wide as the longest sequence needs, no wider."""

    seq_lens: tuple[int, ...]
    block_size: int
    kv_heads: int
    group: int
    head_dim: int
    dtype: str = "float32"
    scale: float | None = None
    seed: int = 0
    garbage: str | None = None
    table_garbage: bool = False
    layers: int = 1
    last_block_at_end: bool = False
    exact_width: bool = False

    def shown(self) -> dict:
        """The case as a reader reads it: the sizes, then only the options that differ from the defaults."""
        full = asdict(self)
        shown = {"seq_lens": list(self.seq_lens), "block_size": self.block_size,
                 "q_heads": self.kv_heads * self.group, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        defaults = Case((1,), 1, 1, 1, 1)
        shown.update({k: v for k, v in full.items() if k not in shown and k != "group"
                      and v != getattr(defaults, k)})
        return shown


def build(case: Case) -> tuple[torch.Tensor, ...]:
    """``(q, k_cache, v_cache, block_tables, seq_lens)`` for ``case``, in pagedlib's layout."""
    gen = torch.Generator().manual_seed(case.seed)
    dtype, bs, kvh, dim = DTYPES[case.dtype], case.block_size, case.kv_heads, case.head_dim
    used = sum(ceil_div(n, bs) for n in case.seq_lens)
    spare = 0 if case.last_block_at_end else 2
    order = torch.randperm(used + spare, generator=gen).tolist()
    if case.last_block_at_end:                       # the last block handed out is the pool's last
        order.remove(used - 1)
        order.append(used - 1)
    cache = PagedKVCache(used + spare, case.layers, bs, kvh, dim, dtype=dtype, free_order=order)
    for pool in (cache.k, cache.v):                  # what a previous owner left in every slot
        pool.copy_(torch.randn(pool.shape, generator=gen))
    for s, n in enumerate(case.seq_lens):
        cache.add_sequence(s)
        cache.append_tokens(s, torch.randn(case.layers, n, kvh, dim, generator=gen).to(dtype),
                            torch.randn(case.layers, n, kvh, dim, generator=gen).to(dtype))
    if case.garbage is not None:
        fill_unused(cache, float(case.garbage))
    batch = range(len(case.seq_lens))
    longest = max(ceil_div(n, bs) for n in case.seq_lens)
    tables = cache.block_table(batch, width=longest + (0 if case.exact_width else 1))
    if case.table_garbage:                           # unused entries name free blocks (full of garbage)
        free = torch.tensor(cache.free, dtype=torch.int32)       # 2 spare blocks: never empty here
        cycled = free[torch.arange(tables.numel()) % len(free)].view(tables.shape)
        tables = torch.where(tables < 0, cycled, tables)
    k_cache, v_cache = cache.layer(case.layers - 1)
    q = torch.randn(len(case.seq_lens), kvh * case.group, dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables, cache.seq_lens_tensor(batch)


def compare(what: str, run: Callable[[], object], args: tuple[torch.Tensor, ...], case: Case,
            tol: dict | None = None) -> None:
    """``Failed`` unless ``run()`` (the reader's code on ``args``) leaves ``args`` as they were and returns a
    tensor of ``q``'s shape and dtype equal to ``paged_attention_oracle`` (float64, computed first) within
    ``tol`` (default: ``TOLERANCES`` of the dtype); a failure names the first sequence and query head that
    differ."""
    q = args[0]
    oracle = paged_attention_oracle(*args, case.scale)          # float64 [batch, q_heads, head_dim]
    before = [a.clone() for a in args]
    out = run()
    for name, now, then in zip(ARGS, args, before):
        if not (now.eq(then) | (now.isnan() & then.isnan())).all():
            raise Failed(f"{what}: your code changed its input {name}; it may only read it",
                         case=case.shown())
    expect_equal(f"{what}: a tensor of q's shape and dtype", (tuple(q.shape), q.dtype),
                 (tuple(out.shape), out.dtype) if isinstance(out, torch.Tensor) else type(out).__name__,
                 case.shown())
    label = "the tolerance" if tol else f"{case.dtype}'s tolerance"
    tol = tol or TOLERANCES[q.dtype]
    close = (out.double() - oracle).abs() <= tol["atol"] + tol["rtol"] * oracle.abs()
    if bool(close.all()):
        return
    b, h = (~close).any(-1).nonzero()[0].tolist()
    raise Failed(f"{what}: sequence {b}, query head {h} differs from the float64 oracle by more than "
                 f"{label} (atol {tol['atol']:g}, rtol {tol['rtol']:g}); first values shown",
                 expected=rounded(oracle[b, h]), got=rounded(out[b, h]), case=case.shown())


def rounded(row: torch.Tensor) -> list[float]:
    return [round(x, 4) for x in row[:4].double().tolist()]


def head_probe(kv_heads: int, group: int, head_dim: int, read: str) -> tuple[torch.Tensor, ...]:
    """Inputs on which query head ``h``'s output is ``j + 1`` in every dimension when it reads KV head
    ``j``'s ``read`` (``"values"`` or ``"keys"``): with ``"values"`` KV head ``j``'s V is ``j + 1``
    everywhere; with ``"keys"`` token ``t``'s V is ``t + 1`` for every head and only KV head ``j``'s K
    points at token ``j`` (a score of 40 against 0, so the softmax puts all its weight there)."""
    n = kv_heads                                     # one token per KV head, in one block
    q = torch.ones(1, kv_heads * group, head_dim)
    k = torch.zeros(1, n, kv_heads, head_dim)        # [num_blocks=1, block_size=n, kv_heads, head_dim]
    v = torch.zeros(1, n, kv_heads, head_dim)
    for j in range(kv_heads):
        if read == "values":
            v[0, :, j] = j + 1
        else:
            k[0, j, j] = 40 / head_dim ** 0.5        # q . k * head_dim**-0.5 == 40
            v[0, j] = j + 1
    return q, k, v, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32)


def check_heads(out: torch.Tensor, kv_heads: int, group: int, read: str) -> None:
    """``Failed`` naming the first query head whose output is not its own KV head's (see ``head_probe``)."""
    case = {"seq_lens": [kv_heads], "block_size": kv_heads, "q_heads": kv_heads * group, "kv_heads": kv_heads,
            "head_dim": out.shape[-1], "built so that": f"reading KV head j's {read} gives j + 1"}
    for h in range(kv_heads * group):
        row = out[0, h].double()
        want = h // group + 1
        if torch.allclose(row, torch.full_like(row, want), atol=1e-4, rtol=0):
            continue
        j = round(row[0].item())
        which = f"none of the KV heads' {read}"
        if 1 <= j <= kv_heads and torch.allclose(row, torch.full_like(row, j), atol=1e-4, rtol=0):
            which = f"KV head {j - 1}'s {read}"
        raise Failed(f"query head {h} reads KV head {h // group} ({kv_heads * group} query heads, {kv_heads} "
                     f"KV heads: groups of {group}), but its output is {which}",
                     expected=rounded(torch.full_like(row, want)), got=rounded(row), case=case)


def rising_scores(case: Case, top: float, start: float = 0.0) -> tuple[torch.Tensor, ...]:
    """``build(case)`` with scores that change linearly with the position in every query head, from near
    ``start`` at each sequence's first token to ``top`` (in nats, the scale included) at its last for the
    query head of the group whose entries sum highest (the other heads' ramps shrink by their sums' share).
    Rising from 0: every tile of keys raises the running max, so a kernel that forgets to rescale its
    running sum and accumulator is wrong, and with ``top`` in the hundreds one that never subtracts the max
    overflows float32. Falling from the hundreds (``start`` 300, ``top`` 0): a max that follows each tile
    down instead of keeping the largest overflows. All far below 0: a max that starts at 0 instead of -inf
    underflows every exp to 0."""
    q, k_cache, v_cache, tables, seq_lens = build(case)
    q = q.abs() + 0.5                                   # [batch, q_heads, D], every entry > 0
    scale = case.head_dim**-0.5 if case.scale is None else case.scale
    sums = q.sum(-1).view(len(case.seq_lens), case.kv_heads, case.group).amax(-1)   # [batch, kv_heads]
    for b, n in enumerate(case.seq_lens):
        pos = torch.arange(n)
        blocks, slots = tables[b, pos // case.block_size].long(), pos % case.block_size
        score = start + (pos + 1) / n * (top - start)                               # [n], in nats
        k_cache[blocks, slots] = (score[:, None, None] / (scale * sums[b])[None, :, None]).expand(
            n, case.kv_heads, case.head_dim).to(k_cache.dtype)
    return q, k_cache, v_cache, tables, seq_lens
