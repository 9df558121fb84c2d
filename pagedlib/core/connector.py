"""The KV connector (notebook 14): how an engine loads K/V it did not compute and saves K/V another engine
will load, split as vLLM 0.32.0 splits it (``KVConnectorBase_V1``, ``vllm/distributed/kv_transfer/
kv_connector/v1/base.py``):

- the **scheduler side**, while a step is planned: ``get_num_new_matched_tokens`` (how many prompt tokens
  after the prefix cache's hit the connector can supply), ``update_state_after_alloc`` (the blocks reserved
  for them), ``build_connector_meta`` (the step's loads and saves, handed to the worker side) and
  ``request_finished``;
- the **worker side**, around the forward pass: ``start_load_kv`` before it (the loaded tokens' K/V into
  their blocks), ``wait_for_save`` after it (the step's new full blocks out).

vLLM's worker side also has ``wait_for_layer_load`` and ``save_kv_layer``, called layer by layer inside the
forward pass so that transfers overlap compute; pagedlib's copies are synchronous, so loading every layer
before the pass and saving every layer after it is the same. Two connectors: ``StoreConnector`` (files,
``kv_store.KVStore``, shared by engines in other processes, vLLM's included) and ``HostConnector`` (notebook
13's host tier behind the same contract)."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pagedlib.core.host_tier import HostTier
from pagedlib.core.kv_pool import KVPool
from pagedlib.core.kv_store import EntryError, KVStore, block_hashes
from pagedlib.core.prefix_cache import BlockKey

ROLES = ("both", "producer", "consumer")  # vLLM's kv_both, kv_producer (saves), kv_consumer (loads)


@dataclass
class Transfer:
    """Blocks of one request to move: ``keys[i]`` is the content of device block ``blocks[i]``."""

    req_id: Hashable
    keys: list
    blocks: list[int]
    parents: list = field(default_factory=list)  # the key before each (a store entry names its parent)


@dataclass
class ConnectorMeta:
    """What the scheduler side tells the worker side for one step (vLLM's ``KVConnectorMetadata``)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class LoadFailed(Exception):
    """A load could not be done (``key``: the block, ``reason``): the engine undoes the step and plans it
    again; the connector no longer offers that block, so its tokens are computed instead."""

    def __init__(self, req_id: Hashable, key: Any, reason: str) -> None:
        super().__init__(f"request {req_id}: block {str(key)[:12]}... {reason}")
        self.req_id, self.key, self.reason = req_id, key, reason


class KVConnector(ABC):
    """The contract. ``block_size``: the engine's; the scheduler calls the first four, the engine the last
    two. ``role``: ``"both"``, ``"producer"`` (saves only) or ``"consumer"`` (loads only)."""

    def __init__(self, block_size: int, role: str = "both") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.block_size = block_size
        self.role = role
        self.keys: dict[Hashable, list] = {}      # each request's full blocks' keys, so far
        self.pending: dict[Hashable, Transfer] = {}  # loads decided, not yet in a step's meta
        self.loaded_tokens = 0
        self.saved_blocks = 0
        self.load_failures = 0

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Prompt tokens after the first ``num_computed_tokens`` (the prefix cache's, whole blocks) the
        connector can load: whole blocks, to the first it lacks, never the block of the last prompt token."""
        if self.role == "producer" or request.prompt_tokens is None:
            return 0
        bs = self.block_size
        keys = self.block_keys(request, (request.num_tokens - 1) // bs)
        found = 0
        for key in keys[num_computed_tokens // bs:]:
            if not self.has(key):
                break
            found += 1
        return found * bs

    def update_state_after_alloc(self, request: Any, blocks: list[int], num_external_tokens: int) -> None:
        """The scheduler gave ``request`` its blocks (``blocks``: its whole table); the last of them hold the
        ``num_external_tokens`` this connector offered, loaded at the step's ``start_load_kv``."""
        n = num_external_tokens // self.block_size
        if n:
            start = len(blocks) - n
            keys = self.keys[request.req_id][start:start + n]
            self.pending[request.req_id] = Transfer(request.req_id, keys, list(blocks[start:]))

    def build_connector_meta(self, plan: Any) -> ConnectorMeta:
        """The step's loads (decided at admission) and saves: every block a request fills in this step."""
        meta = ConnectorMeta()
        for (request, n), table in zip(plan.work, plan.batch.block_tables):
            load = self.pending.pop(request.req_id, None)
            if load is not None:
                meta.loads.append(load)
            if self.role == "consumer" or request.prompt_tokens is None:
                continue
            first = request.num_computed_tokens // self.block_size
            last = (request.num_computed_tokens + n) // self.block_size
            if last > first:
                keys = self.block_keys(request, last)
                meta.saves.append(Transfer(request.req_id, keys[first:last], table[first:last],
                                           ([""] + keys)[first:last]))
        self.pending.clear()  # an admission undone before its step ran: nothing to load
        return meta

    def request_finished(self, request: Any) -> None:
        self.keys.pop(request.req_id, None)
        self.pending.pop(request.req_id, None)

    def reset(self) -> None:
        """Forget every request (the engine dropped them all)."""
        self.keys.clear()
        self.pending.clear()

    # ---- worker side ----
    @abstractmethod
    def start_load_kv(self, pool: KVPool, meta: ConnectorMeta) -> None:
        """Copy every load of ``meta`` into its device blocks, or raise ``LoadFailed``."""

    @abstractmethod
    def wait_for_save(self, pool: KVPool, meta: ConnectorMeta) -> None:
        """Save every block of ``meta.saves`` the connector lacks."""

    # ---- helpers ----
    @abstractmethod
    def has(self, key: Any) -> bool:
        """Whether the connector can supply the block ``key``."""

    def block_keys(self, request: Any, n: int) -> list:
        """The keys of ``request``'s first ``n`` full blocks (kept between steps)."""
        keys = self.keys.setdefault(request.req_id, [])
        if len(keys) < n:
            keys[:] = self.make_keys(request.token_ids, n)
        return keys[:n]

    @abstractmethod
    def make_keys(self, token_ids: Any, n: int) -> list:
        """The chained keys of the first ``n`` full blocks of ``token_ids``."""

    def stats(self) -> dict[str, int]:
        return {"loaded_tokens": self.loaded_tokens, "saved_blocks": self.saved_blocks,
                "load_failures": self.load_failures}


class StoreConnector(KVConnector):
    """Blocks in a ``KVStore`` (files): what this engine saves, an engine in another process loads, vLLM's
    included (``pagedlib.vllm_connector``). A bad entry never changes a token: at lookup its header is
    checked (an entry written for another model or layout, or cut short, is not offered); at load the whole
    entry is checked, and one that fails raises ``LoadFailed`` (the engine plans the step again without it).
    A save that fails (the folder gone, the disk full) is skipped with a warning: the tokens need no save."""

    def __init__(self, store: KVStore, role: str = "both") -> None:
        if not isinstance(store, KVStore):
            raise TypeError(f"store must be a KVStore, got {type(store).__name__}")
        super().__init__(store.block_size, role)
        self.store = store
        self.bad: dict[str, str] = {}  # key -> why its entry cannot be used
        self.save_failures = 0
        self.written_by = "pagedlib"

    def make_keys(self, token_ids: Any, n: int) -> list:
        return block_hashes(token_ids, self.block_size, n)

    def has(self, key: str) -> bool:
        if key in self.bad:
            return False
        if key not in self.store:
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
            for key, block in zip(load.keys, load.blocks):
                try:
                    k, v = self.store.get(key)
                except EntryError as error:
                    self.load_failures += 1
                    self.reject(key, error.reason)
                    raise LoadFailed(load.req_id, key, error.reason) from None
                pool.k[block].copy_(k.to(pool.k.device))  # [L, block_size, H, D]
                pool.v[block].copy_(v.to(pool.v.device))
            self.loaded_tokens += len(load.blocks) * self.block_size

    def wait_for_save(self, pool: KVPool, meta: ConnectorMeta) -> None:
        for save in meta.saves:
            for key, parent, block in zip(save.keys, save.parents, save.blocks):
                if key in self.store:
                    continue
                try:
                    written = self.store.put(key, parent, pool.k[block], pool.v[block], self.written_by)
                except OSError as error:
                    self.save_failures += 1
                    warnings.warn(f"KV store {self.store.root}: a block could not be saved ({error}); "
                                  f"the tokens are unchanged, another engine will compute it",
                                  RuntimeWarning, stacklevel=2)
                    return
                self.saved_blocks += written

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "save_failures": self.save_failures, "rejected_entries": len(self.bad),
                **self.store.stats()}


class HostConnector(KVConnector):
    """Notebook 13's host tier behind the contract, write-through: a lookup to the first miss, loads that pin
    their keys while they copy, all-or-nothing stores of the blocks each step fills."""

    def __init__(self, tier: HostTier) -> None:
        if not isinstance(tier, HostTier):
            raise TypeError(f"tier must be a HostTier, got {type(tier).__name__}")
        block_size = tier.k.shape[2]
        super().__init__(block_size)
        self.tier = tier

    def make_keys(self, token_ids: Any, n: int) -> list:
        keys: list[BlockKey] = []  # the host tier's keys: chained, as notebook 13's
        for index in range(n):
            block = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            keys.append(BlockKey(keys[-1] if keys else None, block))
        return keys

    def has(self, key: Any) -> bool:
        return key in self.tier.cache

    def update_state_after_alloc(self, request: Any, blocks: list[int], num_external_tokens: int) -> None:
        found = (len(blocks) * self.block_size - num_external_tokens) // self.block_size
        asked = (request.num_tokens - 1) // self.block_size - found
        self.tier.cache.count(max(0, asked), num_external_tokens // self.block_size)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def start_load_kv(self, pool: KVPool, meta: ConnectorMeta) -> None:
        for load in meta.loads:
            slots = self.tier.cache.load(load.req_id, load.keys)
            try:
                self.tier.load(pool, slots, load.blocks)
            finally:
                self.tier.cache.release(load.keys)
            self.tier.loaded_blocks += len(load.blocks)
            self.loaded_tokens += len(load.blocks) * self.block_size

    def wait_for_save(self, pool: KVPool, meta: ConnectorMeta) -> None:
        for save in meta.saves:
            self.saved_blocks += self.tier.store(save.req_id, pool, save.keys, save.blocks)

    def request_finished(self, request: Any) -> None:
        super().request_finished(request)
        self.tier.forget(request.req_id)
