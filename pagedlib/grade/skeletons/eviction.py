"""Build it yourself, notebook 13: the host tier's eviction policy, least recently used first (LRU).

Write the class below, then grade it:  python -m pagedlib.grade eviction
(or, in a notebook: ``from pagedlib.grade import grade; grade("eviction")``).

A policy knows keys only (the tier, ``HostCache``, owns the slots and counts them: the policy has no
capacity of its own). A key is a block hash (an int here; any hashable will do): compare keys with ``==``
(as ``in`` and a dict do), never with ``is``, since an equal hash may be another object. Think of a line:
the least recently used key at the front (evicted first), the most recent at the back. ``HostCache`` calls
``insert`` when it stores a block, ``remove`` when a store is cancelled, ``touch`` when a request reads
blocks and again when the request finishes (every key it met, in order), and ``evict`` when it needs room,
protecting the keys of the store itself and the keys being read.

Checked, against pagedlib's ``LRU`` (``pagedlib/kv_transfer/policies.py``): every answer and ``keys()``
after each operation of generated sequences over keys 1000 to 1007 (hypothesis shows the shortest that
fails); then, with keys 0 to 7, that a touched key goes to the back, that a protected key is never evicted,
that an eviction that cannot free ``n`` keys returns ``None`` and changes nothing, and ``HostCache``
replaying requests on your policy, finding, storing and evicting the blocks it does on pagedlib's.
"""


class LRU:
    """Least recently used first."""

    def __init__(self) -> None:
        """An empty policy: no keys held."""
        raise NotImplementedError

    def __contains__(self, key) -> bool:
        """Whether ``key`` is held."""
        raise NotImplementedError

    def __len__(self) -> int:
        """How many keys are held."""
        raise NotImplementedError

    def keys(self) -> list:
        """Every key held, as a list in the line's order: the next evicted (least recent) first."""
        raise NotImplementedError

    def insert(self, key) -> None:
        """``key`` (never one already held) was stored: it joins the back of the line."""
        raise NotImplementedError

    def remove(self, key) -> None:
        """``key`` (always one held) leaves the line, wherever it is: its store was cancelled."""
        raise NotImplementedError

    def touch(self, keys: list) -> None:
        """``keys`` (distinct, in a request's order) were used: each one held goes to the back of the line,
        the last of the list first and the first of the list last, so ``keys[0]`` ends the most recent and
        a request's tail is evicted before its head. Keys not held are ignored; the keys not touched keep
        their order."""
        raise NotImplementedError

    def evict(self, n: int, protected: set) -> list | None:
        """Remove and return the ``n`` (>= 1) least recent keys not in ``protected``, least recent first.
        If fewer than ``n`` keys outside ``protected`` are held, return ``None`` and remove nothing (the tier
        then refuses the store: all or nothing)."""
        raise NotImplementedError
