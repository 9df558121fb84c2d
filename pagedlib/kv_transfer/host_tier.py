"""A second tier of blocks in host memory (notebook 13), beside the device pool: vLLM's CPU offloading.

Two layers. ``HostCache`` decides: which block keys the tier holds, found by a lookup to the first miss,
stored all or nothing, evicted by a policy (``LRU``, or ``ARC`` as vLLM 0.32.0 has it), each request's
accesses told to the policy when it finishes; it knows keys only, so a trace of block ids replays through
it (``pagedlib.sim.trace``). ``HostTier`` adds the memory: a host pool shaped like ``KVPool`` and the copies
in and out of the device pool.

Every decision follows ``vllm/v1/kv_offload/cpu/manager.py`` (``CPUOffloadingManager``) and its policies
(``cpu/policies/``, here ``policies``), driven as vLLM's offloading connector drives them one request at a
time: ``lookup`` its blocks after the device pool's hits, ``load`` the hits, ``store`` the blocks it
computes, ``finish`` it. The engine reaches the tier only through ``connectors.HostConnector``, which
decides while the scheduler plans and copies while the engine runs the step (one process, no transfer
queue): out of the device pool before a block is overwritten, back before the forward pass reads it."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from pagedlib.core.kv_pool import KVPool, _bits
from pagedlib.kv_transfer.policies import POLICIES, Policy
from pagedlib.util import as_int


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
        self.capacity = as_int("capacity", capacity, minimum=1)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {policy!r}")
        self.policy_name = policy
        self.policy: Policy = POLICIES[policy](self.capacity)
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

    def store(self, req_id: Hashable, keys: Sequence[Hashable], protected: Iterable[Hashable] = ()
              ) -> list[tuple[Hashable, int]] | None:
        """Make room for the blocks of ``keys`` the tier lacks and take a slot for each: ``(key, slot)``
        pairs, in order, for the caller to fill or give back (``cancel_store``). All or nothing: ``None`` if
        eviction cannot free enough slots (``keys``, ``protected`` and pinned keys are never evicted)."""
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
            evicted = self.policy.evict(short, set(keys) | set(self.pinned) | set(protected))
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

    def check(self, swapped: dict[Hashable, Sequence[int]] | None = None) -> str | None:
        """The first broken invariant, in words (``None``: all hold): every slot in exactly one place (free,
        a key's, or held outside the policy: by ``swapped``'s requests if given, else ``reserved`` of them
        counted), and the policy knowing exactly the cached keys."""
        places = [("free", slot) for slot in self.free_slots]
        places += [(f"key {key!r}", slot) for key, slot in self.slots.items()]
        places += [(f"request {req}", slot) for req, slots in (swapped or {}).items() for slot in slots]
        seen: dict[int, str] = {}
        for where, slot in places:
            if slot in seen:
                return f"slot {slot} is in two places: {seen[slot]} and {where}"
            seen[slot] = where
        held = len(seen) if swapped is not None else len(seen) + self.reserved
        if held != self.capacity or not set(seen) <= set(range(self.capacity)):
            return f"slots lost: {self.capacity} in the tier, {held} accounted for"
        held_out = None if swapped is None else sum(map(len, swapped.values()))
        if held_out is not None and self.reserved != held_out:
            return f"{self.reserved} slots reserved but swapped requests hold {held_out}"
        if set(self.policy.keys()) != set(self.slots) or len(self.policy) != len(self.slots):
            return "the policy's keys are not the cached blocks' keys"
        return None


class HostTier:
    """A host pool of ``num_blocks`` blocks shaped like ``device``'s blocks (``KVPool``), the ``HostCache``
    (``policy``) that decides what it holds, the copies between the two, and what moved (counted by
    ``HostConnector``, which drives the tier). On a machine with a GPU the host pool is pinned memory; here
    it is another tensor, and a copy is a copy."""

    def __init__(self, device: KVPool, num_blocks: int, policy: str = "lru") -> None:
        self.cache = HostCache(as_int("num_blocks", num_blocks, minimum=1), policy)
        shape = (self.cache.capacity, *device.k.shape[1:])  # [M, L, block_size, H, D]
        pin = device.k.is_cuda
        self.k = torch.zeros(shape, dtype=device.k.dtype, pin_memory=pin)
        self.v = torch.zeros_like(self.k, pin_memory=pin)
        self.block_bytes = 2 * self.k[0].numel() * self.k.element_size()  # K and V, every layer
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

    def copy_out(self, device: KVPool, blocks: Sequence[int], slots: Sequence[int]) -> None:
        """Copy device ``blocks`` into host ``slots`` (every layer, K and V)."""
        src = torch.tensor(list(blocks), dtype=torch.long, device=device.device)
        dst = torch.tensor(list(slots), dtype=torch.long)
        for host, pool in ((self.k, device.k), (self.v, device.v)):
            _bits(host)[dst] = _bits(pool).index_select(0, src).cpu()

    def copy_in(self, device: KVPool, slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Copy host ``slots`` into device ``blocks``."""
        src = torch.tensor(list(slots), dtype=torch.long)
        dst = torch.tensor(list(blocks), dtype=torch.long, device=device.device)
        for host, pool in ((self.k, device.k), (self.v, device.v)):
            _bits(pool)[dst] = _bits(host).index_select(0, src).to(device.device, non_blocking=True)

    def store(self, req_id: Hashable, device: KVPool, keys: Sequence[Hashable], blocks: Sequence[int],
              protected: Iterable[Hashable] = ()) -> int:
        """Store the device ``blocks`` holding ``keys`` that the tier lacks (all or none; ``protected`` keys
        are not evicted for them): blocks copied."""
        taken = self.cache.store(req_id, keys, protected)
        if not taken:
            return 0
        where = dict(zip(keys, blocks))
        try:
            self.copy_out(device, [where[key] for key, _ in taken], [slot for _, slot in taken])
        except BaseException:
            self.cache.cancel_store(taken)
            raise
        self.saved_blocks += len(taken)
        return len(taken)
