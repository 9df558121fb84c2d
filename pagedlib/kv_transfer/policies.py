"""Eviction policies of the host tier (notebook 13), as vLLM 0.32.0 has them
(``vllm/v1/kv_offload/cpu/policies/``: ``base.py``, ``lru.py``, ``arc.py``, chosen by name in
``factory.py``). A policy knows keys only: which the tier holds, in what order it gives them up. ``HostCache``
owns the slots and asks its policy; a new policy is a class with ``Policy``'s methods, added to
``POLICIES``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol


class Policy(Protocol):
    """What ``HostCache`` asks of a policy (``capacity``: the tier's blocks)."""

    capacity: int

    def __contains__(self, key: Hashable) -> bool: ...

    def __len__(self) -> int: ...

    def keys(self) -> list[Hashable]:
        """Every key held, the next evicted first."""

    def insert(self, key: Hashable) -> None:
        """``key`` was stored."""

    def remove(self, key: Hashable) -> None:
        """``key`` leaves without an eviction (its store was cancelled)."""

    def store_missed(self, keys: Sequence[Hashable]) -> None:
        """A request asked to store ``keys``, which the tier lacked (ARC learns from its ghosts)."""

    def touch(self, keys: Sequence[Hashable]) -> None:
        """``keys`` were read (a load)."""

    def finished(self, keys: Sequence[Hashable], inserted: set, reused: set) -> None:
        """A request finished: the keys it met in order, those it stored, those it reused."""

    def evict(self, n: int, protected: set) -> list[Hashable] | None:
        """``n`` keys not in ``protected``, removed; ``None`` (nothing removed) if there are fewer."""


class LRU:
    """Least recently used first. A store puts its keys at the recent end in order; a use (``touch``, a
    request finishing) puts them there in reverse, so a prompt's first block ends most recent and its tail
    is evicted first (vLLM's ranks, as an ordered dict)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: OrderedDict[Hashable, None] = OrderedDict()  # least recent first

    def __contains__(self, key: Hashable) -> bool:
        return key in self.order

    def __len__(self) -> int:
        return len(self.order)

    def keys(self) -> list[Hashable]:  # the next evicted first
        return list(self.order)

    def insert(self, key: Hashable) -> None:
        self.order[key] = None

    def remove(self, key: Hashable) -> None:
        del self.order[key]

    def store_missed(self, keys: Sequence[Hashable]) -> None:  # ARC learns from these; LRU does not
        pass

    def touch(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            if key in self.order:
                self.order.move_to_end(key)

    def finished(self, keys: Sequence[Hashable], inserted: set, reused: set) -> None:
        self.touch(keys)

    def evict(self, n: int, protected: set) -> list[Hashable] | None:
        """The ``n`` least recent keys not in ``protected``, removed; ``None`` (nothing removed) if fewer."""
        chosen = []
        for key in self.order:
            if len(chosen) == n:
                break
            if key not in protected:
                chosen.append(key)
        if len(chosen) < n:
            return None
        for key in chosen:
            del self.order[key]
        return chosen


class ARC:
    """Adaptive replacement (Megiddo and Modha, FAST'03) as vLLM 0.32.0 has it: ``t1`` holds keys used once,
    ``t2`` keys reused since; ``b1``, ``b2`` remember keys evicted from each (ghosts, no memory); a store of a
    ghost moves ``target`` (the share of ``t1``) toward the list that would have kept it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target = 0.0
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def keys(self) -> list[Hashable]:
        return list(self.t1) + list(self.t2)

    def insert(self, key: Hashable) -> None:
        self.t1[key] = None
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            self.t2.pop(key, None)

    def _ghost_hit(self, key: Hashable) -> None:
        if key in self.b1:
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def store_missed(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            self._ghost_hit(key)

    def touch(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def finished(self, keys: Sequence[Hashable], inserted: set, reused: set) -> None:
        """A request's keys, in order: those it only stored keep their list and become most recent; those
        it reused count as one more use (``t1`` -> ``t2``)."""
        for key in reversed(keys):
            if key in inserted and key not in reused:
                for lst in (self.t1, self.t2):
                    if key in lst:
                        lst.move_to_end(key)
                        break
            elif key in reused and key in self.t1:
                del self.t1[key]
                self.t2[key] = None
            elif key in reused and key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set) -> list[Hashable] | None:
        """``n`` keys from ``t1`` while it is at least its target, else from ``t2`` (then ``t1``), each to
        its ghost list; ``None`` (nothing removed) if fewer than ``n`` are unprotected."""
        t1 = (key for key in self.t1 if key not in protected)
        t2 = (key for key in self.t2 if key not in protected)
        size_t1 = len(self.t1)
        chosen: list[tuple[Hashable, bool]] = []  # (key, from t1)
        for _ in range(n):
            key = None
            if size_t1 >= int(self.target):
                key = next(t1, None)
                if key is not None:
                    chosen.append((key, True))
                    size_t1 -= 1
                    continue
            key = next(t2, None)
            if key is not None:
                chosen.append((key, False))
                continue
            key = next(t1, None)
            if key is None:
                return None
            chosen.append((key, True))
            size_t1 -= 1
        for key, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [key for key, _ in chosen]


POLICIES: dict[str, type[Policy]] = {"lru": LRU, "arc": ARC}  # by name, as vLLM's factory
