"""Helpers shared by the test modules (imported as ``from helpers import ...``; pytest puts tests/ on
``sys.path`` because the folder has no ``__init__.py``)."""

from __future__ import annotations

import copy

from pagedlib.cache import PagedKVCache


def snapshot(c: PagedKVCache) -> PagedKVCache:
    """Everything a failed call must leave untouched: a deep copy of the cache (bookkeeping and pools)."""
    return copy.deepcopy(c)


def assert_unchanged(c: PagedKVCache, snap: PagedKVCache) -> None:
    """``c`` is bit-for-bit what ``snapshot`` saw (NaN slots included), and still consistent."""
    assert c.state_diff(snap) == [], f"changed: {c.state_diff(snap)}"
    c.check_invariants()
