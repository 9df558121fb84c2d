"""Helpers shared by the test modules (imported as ``from helpers import ...``; pytest puts tests/ on
``sys.path`` because the folder has no ``__init__.py``)."""

from __future__ import annotations

import torch

from pagedlib.cache import PagedKVCache
from pagedlib.checks import ceil_div


def snapshot(c: PagedKVCache) -> tuple:
    """Everything a failed call must leave untouched: tables, lengths, free stack and both pools."""
    return ({s: list(t) for s, t in c.tables.items()}, dict(c.seq_lens), list(c.free),
            c.k.clone(), c.v.clone())


def assert_unchanged(c: PagedKVCache, snap: tuple) -> None:
    """``c`` is bit-for-bit what ``snapshot`` saw (NaN slots included), and still consistent."""
    tables, lens, free, k, v = snap
    assert c.tables == tables
    assert c.seq_lens == lens
    assert c.free == free
    torch.testing.assert_close(c.k, k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(c.v, v, rtol=0, atol=0, equal_nan=True)
    c.check_invariants()


def filled_cache(lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, *, num_layers: int = 2, fill: float = float("nan"),
                 seed: int = 0, device: str = "cpu") -> PagedKVCache:
    """A cache holding sequences ``0 .. len(lens) - 1`` of random K/V, its blocks handed out in a random
    order, three spare free blocks, and ``fill`` (NaN by default) in every slot that holds no token."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(ceil_div(n, block_size) for n in lens) + 3
    cache = PagedKVCache(num_blocks, num_layers, block_size, kv_heads, head_dim, dtype=dtype, device=device,
                         free_order=torch.randperm(num_blocks, generator=g).tolist(), fill=fill)
    for s, n in enumerate(lens):
        cache.add_sequence(s)
        k, v = torch.randn(2, num_layers, n, kv_heads, head_dim, generator=g).to(device, dtype)
        cache.append_tokens(s, k, v)
    return cache


def decode_args(cache: PagedKVCache, q_heads: int, *, layer: int = 1, seed: int = 1,
                width: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(q, k_cache, v_cache, block_tables, seq_lens)`` for one decode step of every sequence of ``cache``
    (as ``filled_cache`` builds it) at ``layer``: the arguments of ``paged_attention``."""
    seqs = sorted(cache.tables)
    q = torch.randn(len(seqs), q_heads, cache.k.shape[-1], generator=torch.Generator().manual_seed(seed))
    k_cache, v_cache = cache.layer(layer)
    return (q.to(cache.k.device, cache.k.dtype), k_cache, v_cache, cache.block_table(seqs, width=width),
            cache.seq_lens_tensor(seqs))
