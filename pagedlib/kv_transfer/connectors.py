"""The course's two connectors behind ``core.connector.KVConnector`` (notebooks 13, 14):

- ``StoreConnector``: blocks in a ``KVStore`` (files), shared by engines in other processes, vLLM's included;
- ``HostConnector``: notebook 13's host tier: write-through or victim stores, hits copied back, and a
  preempted request's blocks swapped out and back in.

Both name blocks by each request's chained block keys (``Request.block_keys``, the prefix cache's keys)
and follow ``rules`` (what to offer, what to save). The
scheduler side only decides and books; every copy happens on the worker side, in ``start_load_kv`` and
``wait_for_save``, which the engine runs around the forward pass."""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pagedlib.core.connector import ConnectorMeta, KVConnector, LoadFailed, Transfer
from pagedlib.core.kv_pool import KVPool
from pagedlib.core.prefix_cache import BlockKey
from pagedlib.kv_transfer import rules
from pagedlib.kv_transfer.host_tier import HostTier
from pagedlib.kv_transfer.store import DTYPES, EntryError, KVStore

WRITES = ("through", "victim", "none")  # when the host tier stores a block


class BlockConnector(KVConnector):
    """What both connectors share: the offer rule over ``has``, the loads decided at admission and the saves
    of the blocks each step fills, all named by the requests' block keys."""

    def __init__(self, block_size: int, role: str = "both") -> None:
        super().__init__(block_size, role)
        self.pending: dict[Hashable, Transfer] = {}  # loads decided, not yet in a step's meta
        self.loaded_tokens = 0
        self.saved_blocks = 0
        self.load_failures = 0

    def has(self, key: BlockKey) -> bool:
        """Whether the connector can supply the block ``key``."""
        raise NotImplementedError

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Whole blocks after the prefix cache's ``num_computed_tokens``, as many as ``has`` finds in a row,
        before the block of the request's last token (``rules``); none for a producer, which only saves."""
        if self.role == "producer" or request.prompt_tokens is None:
            return 0
        keys = request.block_keys(self.block_size, rules.offer_stop(request.num_tokens, self.block_size))
        return rules.offer(keys, self.has, num_computed_tokens // self.block_size) * self.block_size

    def update_state_after_alloc(self, request: Any, blocks: list[int], num_external_tokens: int) -> None:
        n = num_external_tokens // self.block_size
        if n:
            start = len(blocks) - n
            keys = request.block_keys(self.block_size, start + n)[start:]
            self.pending[request.req_id] = Transfer(request.req_id, keys, list(blocks[start:]))

    def build_connector_meta(self, plan: Any) -> ConnectorMeta:
        meta = self.new_meta()
        for (request, n), table in zip(plan.work, plan.batch.block_tables):
            load = self.pending.pop(request.req_id, None)
            if load is not None:
                meta.loads.append(load)
            if self.role == "consumer" or request.prompt_tokens is None:
                continue
            filled = rules.filled(request.num_computed_tokens, request.num_computed_tokens + n,
                                  self.block_size)
            first, last = filled.start, filled.stop
            if last > first:
                keys = request.block_keys(self.block_size, last)
                meta.saves.append(Transfer(request.req_id, keys[first:], table[first:last],
                                           ([None] + keys)[first:last]))
        self.pending.clear()  # an admission undone before its step ran: nothing to load
        return meta

    def new_meta(self) -> ConnectorMeta:
        return ConnectorMeta()

    def request_finished(self, request: Any) -> None:
        self.pending.pop(request.req_id, None)

    def reset(self) -> None:
        self.pending.clear()

    def stats(self) -> dict[str, int]:
        return {"loaded_tokens": self.loaded_tokens, "saved_blocks": self.saved_blocks,
                "load_failures": self.load_failures}


class StoreConnector(BlockConnector):
    """Blocks in a ``KVStore`` (files): what this engine saves, an engine in another process loads, vLLM's
    included (``pagedlib.vllm.connector``). A bad entry never changes a token: at lookup its header is
    checked (an entry written for another model or layout, or cut short, is not offered); at load the whole
    entry is checked, and one that fails, or a disk error, raises ``LoadFailed`` (the engine plans the step
    again without it). A save that fails, however, is skipped with a warning: the tokens need no save."""

    def __init__(self, store: KVStore, role: str = "both") -> None:
        if not isinstance(store, KVStore):
            raise TypeError(f"store must be a KVStore, got {type(store).__name__}")
        super().__init__(store.block_size, role)
        self.store = store
        self.bad: dict[str, str] = {}  # key -> why its entry cannot be used
        self.save_failures = 0
        self.written_by = "pagedlib"

    def bind(self, cache: Any) -> None:
        super().bind(cache)
        if cache.k.dtype not in DTYPES.values():
            raise ValueError(f"a KV store keeps unquantized blocks; this cache stores {cache.k.dtype}")
        _, layers, _, kv_heads, head_dim = cache.k.shape
        ours = {"num_layers": layers, "kv_heads": kv_heads, "head_dim": head_dim,
                "dtype": str(cache.k.dtype).removeprefix("torch.")}
        wrong = {name: (value, self.store.geometry[name]) for name, value in ours.items()
                 if self.store.geometry[name] != value}
        if wrong:
            raise ValueError(f"the KV store at {self.store.root} holds blocks of another shape: (this cache, "
                             f"the store) differ in {wrong}")

    def has(self, block_key: BlockKey) -> bool:
        key = block_key.digest  # the entry's name
        if key in self.bad or key not in self.store:
            return False
        reason = self.store.check_header(key)
        if reason is not None:
            self.reject(key, reason)
            return False
        return True

    def reject(self, key: str, reason: str) -> None:
        """Never offer ``key`` again; say so once."""
        if key not in self.bad:
            self.bad[key] = reason
            warnings.warn(f"KV store {self.store.root}: {EntryError(key, reason)}; its tokens are computed "
                          f"instead", RuntimeWarning, stacklevel=3)

    def start_load_kv(self, pool: KVPool, meta: ConnectorMeta) -> None:
        for load in meta.loads:
            for block_key, block in zip(load.keys, load.blocks):
                key = block_key.digest
                try:
                    k, v = self.store.get(key)
                except (EntryError, OSError) as error:  # a bad entry, or the disk failing under it
                    reason = getattr(error, "reason", None) or f"cannot be read ({type(error).__name__})"
                    self.load_failures += 1
                    self.reject(key, reason)
                    raise LoadFailed(load.req_id, key, reason) from None
                pool.k[block].copy_(k.to(pool.k.device))  # [L, block_size, H, D]
                pool.v[block].copy_(v.to(pool.v.device))
            self.loaded_tokens += len(load.blocks) * self.block_size

    def wait_for_save(self, pool: KVPool, meta: ConnectorMeta) -> None:
        for save in meta.saves:
            for key, parent, block in zip(save.keys, save.parents, save.blocks):
                key, parent = key.digest, parent.digest if parent is not None else ""
                try:
                    self.saved_blocks += self.store.put(key, parent, pool.k[block], pool.v[block],
                                                        self.written_by)
                except Exception as error:  # each block on its own: a lost save is only a later miss
                    self.save_failures += 1
                    warnings.warn(f"KV store {self.store.root}: block {key[:12]}... not saved "
                                  f"({type(error).__name__}: {error}); the tokens are unchanged",
                                  RuntimeWarning, stacklevel=2)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "save_failures": self.save_failures, "rejected_entries": len(self.bad),
                **self.store.stats()}


@dataclass
class HostMeta(ConnectorMeta):
    """A step's host-tier transfers beyond loads and saves: ``victims``, device blocks the prefix cache
    evicted this step (stored before they are overwritten); ``swap_outs`` and ``swap_ins``, a preempted
    request's blocks to and from its host slots (``keys``: the slots)."""

    victims: list[Transfer] = field(default_factory=list)
    swap_outs: list[Transfer] = field(default_factory=list)
    swap_ins: list[Transfer] = field(default_factory=list)


@dataclass
class Swapped:
    """A preempted request's blocks in the host tier: its ``slots`` hold its first ``tokens`` tokens."""

    slots: list[int]
    tokens: int
    copied: bool = False  # the swap-out ran (a step undone before it leaves nothing to load)


class HostConnector(BlockConnector):
    """Notebook 13's host tier behind the contract. ``write``: ``"through"`` (every full block stored as
    it is computed, vLLM's ``OffloadingConnector``), ``"victim"`` (a block stored when the device's prefix
    cache evicts it) or ``"none"`` (no cached blocks); ``swap``: a preempted request's blocks are copied
    into host slots and back at readmission, instead of being computed again (recomputed when the tier
    cannot make room). Lookups run to the first miss; loads pin their keys while they copy."""

    def __init__(self, tier: HostTier, write: str = "through", swap: bool = False) -> None:
        if not isinstance(tier, HostTier):
            raise TypeError(f"tier must be a HostTier, got {type(tier).__name__}")
        if write not in WRITES:
            raise ValueError(f"write must be one of {WRITES}, got {write!r}")
        super().__init__(tier.k.shape[2])
        self.tier = tier
        self.write = write
        self.swap = bool(swap)
        self.device_keys: dict[int, Any] = {}  # victim: the key of each device block's content
        self.swapped: dict[Hashable, Swapped] = {}  # preempted requests' blocks, by request id
        self.queued = HostMeta()  # victims and swap-outs decided, for the next step's meta
        self.swap_ins: dict[Hashable, Transfer] = {}  # readmissions decided, not yet in a step's meta

    def bind(self, cache: Any) -> None:
        super().bind(cache)
        if tuple(self.tier.k.shape[1:]) != tuple(cache.k.shape[1:]) or self.tier.k.dtype != cache.k.dtype:
            raise ValueError(f"host tier blocks {tuple(self.tier.k.shape[1:])} {self.tier.k.dtype} do not "
                             f"match the cache's {tuple(cache.k.shape[1:])} {cache.k.dtype}")
        if self.write == "victim":
            if cache.prefix_cache is None:
                raise ValueError("host_write='victim' stores the blocks the prefix cache evicts: it needs "
                                 "enable_prefix_caching=True")
            cache.manager.on_evict = self.evicted  # vLLM's connectors see the block pool's events

    def has(self, key: BlockKey) -> bool:
        return key in self.tier.cache

    # ---- scheduler side: decisions and bookings, no copies ----
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        swapped = self.swapped.get(request.req_id)
        if swapped is not None and swapped.copied:  # its own blocks, after what the prefix cache found
            return max(0, swapped.tokens - num_computed_tokens)
        if self.write == "none":
            return 0
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: list[int], num_external_tokens: int) -> None:
        swapped = self.swapped.get(request.req_id)
        if swapped is not None and swapped.copied and num_external_tokens:
            first = (swapped.tokens - num_external_tokens) // self.block_size
            slots, targets = swapped.slots[first:], list(blocks[first:])
            self.swap_ins[request.req_id] = Transfer(request.req_id, slots, targets)
            return
        if swapped is not None:  # the prefix cache holds all of it, or it was never copied: slots back
            self.tier.cache.give_slots(self.swapped.pop(request.req_id).slots)
        if self.write != "none" and request.prompt_tokens is not None:
            found = len(blocks) - num_external_tokens // self.block_size
            asked = rules.offer_stop(request.num_tokens, self.block_size) - found
            self.tier.cache.count(max(0, asked), num_external_tokens // self.block_size)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def handle_preemption(self, request: Any, blocks: list[int]) -> None:
        if not self.swap:
            return
        slots = self.tier.cache.take_slots(len(blocks))
        if slots is None:
            self.tier.swap_fallbacks += 1
            return
        self.swapped[request.req_id] = Swapped(slots, request.num_computed_tokens)
        self.queued.swap_outs.append(Transfer(request.req_id, slots, list(blocks)))

    def evicted(self, block: int) -> None:
        """The prefix cache evicts device ``block`` for new content: its K/V go to the tier first."""
        key = self.device_keys.pop(block, None)
        if key is not None:
            self.queued.victims.append(Transfer("evictions", [key], [block]))

    def new_meta(self) -> HostMeta:
        meta, self.queued = self.queued, HostMeta()
        return meta

    def build_connector_meta(self, plan: Any) -> ConnectorMeta:
        meta = super().build_connector_meta(plan)
        assert isinstance(meta, HostMeta)
        rows = {request.req_id for request, _ in plan.work}
        meta.swap_ins = [swap_in for req_id, swap_in in self.swap_ins.items() if req_id in rows]
        self.swap_ins.clear()  # as the loads: an admission undone before its step ran loads nothing
        return meta

    def request_finished(self, request: Any) -> None:
        super().request_finished(request)
        self.swap_ins.pop(request.req_id, None)
        self.tier.cache.finish(request.req_id)
        swapped = self.swapped.pop(request.req_id, None)
        if swapped is not None:
            self.tier.cache.give_slots(swapped.slots)

    # ---- worker side: the copies ----
    def start_load_kv(self, pool: KVPool, meta: ConnectorMeta) -> None:
        """Victims and swap-outs first (their blocks are overwritten next), then hits and swap-ins."""
        assert isinstance(meta, HostMeta)
        loading = {key for load in meta.loads for key in load.keys}
        for victim in meta.victims:
            self.store(pool, victim, loading)
            self.tier.cache.finish("evictions")  # an insertion, nothing more
        for out in meta.swap_outs:
            self.copy(self.tier.copy_out, pool, out.blocks, out.keys, out.req_id)
            self.swapped[out.req_id].copied = True
            self.tier.swapped_out_blocks += len(out.blocks)
        for load in meta.loads:
            slots = self.tier.cache.load(load.req_id, load.keys)  # pinned while they copy
            try:
                self.tier.copy_in(pool, slots, load.blocks)
            finally:
                self.tier.cache.release(load.keys)
            if self.write == "victim":
                self.device_keys.update(zip(load.blocks, load.keys))
            self.tier.loaded_blocks += len(load.blocks)
            self.loaded_tokens += len(load.blocks) * self.block_size
        for swap_in in meta.swap_ins:
            self.copy(self.tier.copy_in, pool, swap_in.keys, swap_in.blocks, swap_in.req_id)
            self.tier.swapped_in_blocks += len(swap_in.blocks)
            self.tier.cache.give_slots(self.swapped.pop(swap_in.req_id).slots)

    def copy(self, how: Any, pool: KVPool, source: list[int], target: list[int], req_id: Hashable) -> None:
        """A swap's copy; if it fails the request's slots go back (it is computed again instead)."""
        try:
            how(pool, source, target)
        except BaseException:
            swapped = self.swapped.pop(req_id, None)
            if swapped is not None:
                self.tier.cache.give_slots(swapped.slots)
            raise

    def wait_for_save(self, pool: KVPool, meta: ConnectorMeta) -> None:
        for save in meta.saves:
            if self.write == "through":
                self.saved_blocks += self.store(pool, save)
            elif self.write == "victim":  # stored when evicted
                self.device_keys.update(zip(save.blocks, save.keys))

    def store(self, pool: KVPool, transfer: Transfer, protected: set = frozenset()) -> int:
        """Store ``transfer``'s blocks the tier lacks, all or none: blocks copied. A failure is a lost save
        (warned): the tokens are already right."""
        try:
            return self.tier.store(transfer.req_id, pool, transfer.keys, transfer.blocks, protected)
        except Exception as error:
            warnings.warn(f"host tier: blocks not stored ({type(error).__name__}: {error}); the tokens are "
                          f"unchanged", RuntimeWarning, stacklevel=3)
            return 0

    def stats(self) -> dict[str, int | float]:
        return self.tier.stats()
