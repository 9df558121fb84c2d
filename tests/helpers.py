"""Helpers shared by the test modules (imported as ``from helpers import ...``; pytest puts tests/ on
``sys.path`` because the folder has no ``__init__.py``)."""

from __future__ import annotations

import torch

from pagedlib.cache import PagedKVCache


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
