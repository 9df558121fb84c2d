"""A second tier of blocks in host memory (notebook 13), beside the device pool: vLLM's CPU offloading.

Two layers. ``HostCache`` decides: which block keys the tier holds, found by a lookup to the first miss,
stored all or nothing, evicted by a policy (``LRU``, or ``ARC`` as vLLM 0.32.0 has it), each request's
accesses told to the policy when it finishes; it knows keys only, so a trace of block ids replays through
it (``pagedlib.sim.trace``). ``HostTier`` adds the memory: a host pool shaped like ``KVPool``, the copies in
and out of the device pool, and the slots a preempted request's blocks are swapped into.

Every decision follows ``vllm/v1/kv_offload/cpu/manager.py`` (``CPUOffloadingManager``) and its policies
(``cpu/policies/lru.py``, ``arc.py``), driven as vLLM's offloading scheduler drives them one request at a
time: ``lookup`` its blocks after the device pool's hits, ``load`` the hits, ``store`` the blocks it
computes, ``finish`` it. Copies are made when decided (one process, no transfer queue): a copy into the
host is made before the device block is overwritten, a copy back before the forward pass reads it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pagedlib.core.kv_pool import KVPool, _bits
from pagedlib.core.prefix_cache import BlockKey
from pagedlib.util import as_int

POLICIES = ("lru", "arc")
WRITES = ("through", "victim", "none")


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


@dataclass
class Access:
    """One request's dealings with the tier until it finishes: the keys it met, in order, and which it
    stored or reused (vLLM's ``_RequestCacheAccess``)."""

    keys: dict[Hashable, None] = field(default_factory=dict)  # an ordered set
    inserted: set = field(default_factory=set)
    reused: set = field(default_factory=set)
    store_missed: set = field(default_factory=set)

    def saw(self, keys: Iterable[Hashable]) -> None:
        for key in keys:
            self.keys.setdefault(key, None)


class HostCache:
    """Which block keys the tier holds: ``capacity`` of them at most, less the slots swapped requests hold
    (``reserved``), evicted by ``policy`` (``"lru"`` or ``"arc"``); ``slots[key]``: its block's slot."""

    def __init__(self, capacity: int, policy: str = "lru") -> None:
        self.capacity = as_int("host_blocks", capacity, minimum=1)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.policy_name = policy
        self.policy: LRU | ARC = LRU(self.capacity) if policy == "lru" else ARC(self.capacity)
        self.slots: dict[Hashable, int] = {}
        self.free_slots = list(reversed(range(self.capacity)))  # the top of the stack is the end
        self.accesses: dict[Hashable, Access] = {}  # by request id, until it finishes
        self.reserved = 0  # slots held outside the policy (swapped blocks)
        self.pinned: dict[Hashable, int] = {}  # keys being loaded: not evicted until ``release``d
        self.queried_blocks = 0
        self.hit_blocks = 0
        self.stored_blocks = 0
        self.evicted_blocks = 0
        self.refused_stores = 0  # store calls that found too few evictable blocks (nothing stored)
        self.last_evicted: list[Hashable] = []  # the keys the latest store or take_slots evicted

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def access(self, req_id: Hashable) -> Access:
        return self.accesses.setdefault(req_id, Access())

    def lookup(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys`` (a prompt's blocks after those the device pool found) the tier holds, from
        the first to the first miss. Counted in ``queried_blocks`` and ``hit_blocks``."""
        hits = self.peek(keys)
        self.count(len(keys), hits)
        return hits

    def count(self, queried: int, hits: int) -> None:
        """A lookup of ``queried`` blocks that found ``hits``, in the statistics."""
        self.queried_blocks += queried
        self.hit_blocks += hits

    def peek(self, keys: Sequence[Hashable]) -> int:
        """``lookup``, counting nothing."""
        hits = 0
        for key in keys:
            if key not in self.slots:
                break
            hits += 1
        return hits

    def load(self, req_id: Hashable, keys: Sequence[Hashable]) -> list[int]:
        """Request ``req_id`` reads the blocks of ``keys`` (all held): their slots, pinned (never evicted)
        until ``release``d, as vLLM's ``prepare_load`` pins them until ``complete_load``. A use, for the
        policy."""
        slots = [self.slots[key] for key in keys]
        for key in keys:
            self.pinned[key] = self.pinned.get(key, 0) + 1
        access = self.access(req_id)
        access.saw(keys)
        access.reused.update(key for key in keys if key not in access.inserted)
        self.policy.touch(list(keys))
        return slots

    def release(self, keys: Sequence[Hashable]) -> None:
        """The blocks of ``keys`` are read: they may be evicted again."""
        for key in keys:
            self.pinned[key] -= 1
            if not self.pinned[key]:
                del self.pinned[key]

    def store(self, req_id: Hashable, keys: Sequence[Hashable]) -> list[tuple[Hashable, int]] | None:
        """Make room for the blocks of ``keys`` the tier lacks and take a slot for each: ``(key, slot)``
        pairs, in order, for the caller to fill (``commit_store``) or give back (``cancel_store``). All or
        nothing: ``None`` if eviction cannot free enough slots (the keys of ``keys`` are never evicted)."""
        keys = list(dict.fromkeys(keys))
        self.last_evicted = []
        new = [key for key in keys if key not in self.slots]
        access = self.access(req_id)
        missed = [key for key in new if key not in access.store_missed]
        if missed:
            self.policy.store_missed(missed)
            access.store_missed.update(missed)
        held = [key for key in keys if key in self.slots]
        access.saw(keys)
        access.reused.update(key for key in held if key not in access.inserted)
        if not new:
            return []
        short = len(new) - len(self.free_slots)
        if short > 0:
            evicted = self.policy.evict(short, set(keys) | set(self.pinned))
            if evicted is None:
                self.refused_stores += 1
                return None
            for key in evicted:
                self.free_slots.append(self.slots.pop(key))
            self.evicted_blocks += len(evicted)
            self.last_evicted = evicted
        taken = []
        for key in new:
            slot = self.free_slots.pop()
            self.slots[key] = slot
            self.policy.insert(key)
            taken.append((key, slot))
        access.inserted.update(new)
        self.stored_blocks += len(new)
        return taken

    def cancel_store(self, taken: Sequence[tuple[Hashable, int]]) -> None:
        """The copies into ``taken``'s slots did not happen: forget those keys."""
        for key, slot in taken:
            if self.slots.get(key) == slot:
                del self.slots[key]
                self.policy.remove(key)
                self.free_slots.append(slot)
                self.stored_blocks -= 1

    def finish(self, req_id: Hashable) -> None:
        """Request ``req_id`` is done: the policy learns its uses, newest recency to its first blocks."""
        access = self.accesses.pop(req_id, None)
        if access is not None:
            self.policy.finished(list(access.keys), access.inserted, access.reused)

    def take_slots(self, n: int) -> list[int] | None:
        """``n`` slots outside the policy (a swapped request's), evicting cached blocks for them; ``None``
        (nothing changed) if the tier cannot free enough."""
        n = as_int("n", n, minimum=0)
        self.last_evicted = []
        short = n - len(self.free_slots)
        if short > 0:
            evicted = self.policy.evict(short, set(self.pinned))
            if evicted is None:
                return None
            for key in evicted:
                self.free_slots.append(self.slots.pop(key))
            self.evicted_blocks += len(evicted)
            self.last_evicted = evicted
        taken = [self.free_slots.pop() for _ in range(n)]
        self.reserved += n
        return taken

    def give_slots(self, slots: Sequence[int]) -> None:
        self.free_slots.extend(reversed(slots))
        self.reserved -= len(slots)

    def check(self) -> None:
        """``AssertionError`` unless every slot is in exactly one place: free, a key's, or reserved."""
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "two keys share a slot"
        assert not set(used) & set(self.free_slots), "a key's slot is also free"
        assert len(set(self.free_slots)) == len(self.free_slots), "a slot is free twice"
        assert len(used) + len(self.free_slots) + self.reserved == self.capacity, "slots lost"
        assert set(self.policy.keys()) == set(self.slots), "the policy and the slots disagree"


class HostTier:
    """A host pool of ``num_blocks`` blocks shaped like ``device``'s blocks (``KVPool``), the ``HostCache``
    that decides what it holds, and the copies between the two, counted. ``write``: ``"through"`` (every
    full block is stored as soon as it is computed, vLLM's offloading connector), ``"victim"`` (a block is
    stored when the device's prefix cache evicts it) or ``"none"`` (the tier holds swapped blocks only).
    On a machine with a GPU the host pool is pinned memory; here it is another tensor, and a copy is a copy.
    """

    def __init__(self, device: KVPool, num_blocks: int, policy: str = "lru", write: str = "through") -> None:
        self.cache = HostCache(num_blocks, policy)
        if write not in WRITES:
            raise ValueError(f"host_write must be one of {WRITES}, got {write!r}")
        self.write = write
        shape = (self.cache.capacity, *device.k.shape[1:])  # [M, L, block_size, H, D]
        pin = device.k.is_cuda
        self.k = torch.zeros(shape, dtype=device.k.dtype, pin_memory=pin)
        self.v = torch.zeros_like(self.k, pin_memory=pin)
        self.block_bytes = 2 * self.k[0].numel() * self.k.element_size()  # K and V, every layer
        self.keys: dict[Hashable, list[BlockKey]] = {}  # each request's full blocks' keys, so far
        self.device_keys: dict[int, BlockKey] = {}  # victim: the key of each device block's content
        self.saved_blocks = 0     # device -> host copies of cached blocks (write-through or victim)
        self.loaded_blocks = 0    # host -> device copies of cached blocks (host hits)
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.swap_fallbacks = 0   # preemptions that recomputed because the tier had no room

    @property
    def bytes_moved(self) -> int:
        blocks = self.saved_blocks + self.loaded_blocks + self.swapped_out_blocks + self.swapped_in_blocks
        return blocks * self.block_bytes

    def stats(self) -> dict[str, int | float]:
        cache = self.cache
        return {"host_blocks": cache.capacity, "cached": len(cache), "swapped": cache.reserved,
                "queried_blocks": cache.queried_blocks, "hit_blocks": cache.hit_blocks,
                "hit_rate": cache.hit_blocks / max(cache.queried_blocks, 1),
                "saved_blocks": self.saved_blocks, "loaded_blocks": self.loaded_blocks,
                "evicted_blocks": cache.evicted_blocks, "refused_stores": cache.refused_stores,
                "swapped_out_blocks": self.swapped_out_blocks, "swapped_in_blocks": self.swapped_in_blocks,
                "swap_fallbacks": self.swap_fallbacks, "bytes_moved": self.bytes_moved}

    def block_keys(self, req_id: Hashable, token_ids: Sequence[int], n: int, block_size: int
                   ) -> list[BlockKey]:
        """The chained keys of the first ``n`` full blocks of ``token_ids`` (request ``req_id``'s; kept)."""
        keys = self.keys.setdefault(req_id, [])
        while len(keys) < n:
            index = len(keys)
            parent = keys[-1] if keys else None
            keys.append(BlockKey(parent, tuple(token_ids[index * block_size:(index + 1) * block_size])))
        return keys[:n]

    def save(self, device: KVPool, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device ``blocks`` into host ``slots`` (every layer, K and V)."""
        src = torch.tensor(list(blocks), dtype=torch.long, device=device.device)
        dst = torch.tensor(list(slots), dtype=torch.long)
        for host, pool in ((self.k, device.k), (self.v, device.v)):
            _bits(host)[dst] = _bits(pool).index_select(0, src).cpu()

    def load(self, device: KVPool, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy host ``slots`` into device ``blocks``."""
        src = torch.tensor(list(slots), dtype=torch.long)
        dst = torch.tensor(list(blocks), dtype=torch.long, device=device.device)
        for host, pool in ((self.k, device.k), (self.v, device.v)):
            _bits(pool)[dst] = _bits(host).index_select(0, src).to(device.device, non_blocking=True)

    def store(self, req_id: Hashable, device: KVPool, keys: Sequence[BlockKey], blocks: Sequence[int]
              ) -> int:
        """Store the device ``blocks`` holding ``keys`` that the tier lacks (all or none): blocks copied."""
        taken = self.cache.store(req_id, keys)
        if not taken:
            return 0
        where = dict(zip(keys, blocks))
        try:
            self.save(device, [where[key] for key, _ in taken], [slot for _, slot in taken])
        except BaseException:
            self.cache.cancel_store(taken)
            raise
        self.saved_blocks += len(taken)
        return len(taken)

    def forget(self, req_id: Hashable) -> None:
        """Request ``req_id`` finished: the policy learns its uses; its keys are dropped."""
        self.cache.finish(req_id)
        self.keys.pop(req_id, None)
