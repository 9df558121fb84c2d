"""The KV connector contract: the one door through which K/V that is not in the device pool comes in and
goes out (notebooks 13, 14). It is split as vLLM 0.32.0 splits it (``KVConnectorBase_V1``,
``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):

- the **scheduler side**, while a step is planned (bookkeeping only, no K/V moves):
  ``get_num_new_matched_tokens`` (how many tokens after the prefix cache's hit the connector can supply),
  ``update_state_after_alloc`` (the blocks reserved for them), ``handle_preemption`` (a request lost its
  blocks: a connector may keep them), ``build_connector_meta`` (the step's transfers, handed to the worker
  side as ``schedule()`` ends) and ``request_finished``; ``bind`` hands it the cache once;
- the **worker side**, which the engine runs around the forward pass: ``start_load_kv`` before it (blocks
  about to be overwritten saved first, then the loaded tokens' K/V into their blocks), ``wait_for_save``
  after it (the step's new full blocks out).

vLLM's worker side also has ``wait_for_layer_load`` and ``save_kv_layer``, called layer by layer inside the
forward pass so that transfers overlap compute; pagedlib's copies are synchronous, so loading every layer
before the pass and saving every layer after it is the same. The connectors themselves (a store of files,
the host tier) live in ``pagedlib.kv_transfer``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pagedlib.core.kv_pool import KVPool

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
    """What the scheduler side tells the worker side for one step (vLLM's ``KVConnectorMetadata``):
    ``loads`` fill the blocks admissions reserved, ``saves`` are the full blocks the step computes (a
    connector may add transfers of its own)."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class LoadFailed(Exception):
    """A load could not be done (``key``: the block, ``reason``): the engine undoes the step and plans it
    again; the connector no longer offers that block, so its tokens are computed instead."""

    def __init__(self, req_id: Hashable, key: Any, reason: str) -> None:
        super().__init__(f"request {req_id}: block {str(key)[:12]}... {reason}")
        self.req_id, self.key, self.reason = req_id, key, reason


class KVConnector(ABC):
    """The contract. ``block_size``: the engine's; ``role``: ``"both"``, ``"producer"`` (saves only) or
    ``"consumer"`` (loads only). The scheduler calls the scheduler side, the engine the worker side."""

    def __init__(self, block_size: int, role: str = "both") -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.block_size = block_size
        self.role = role

    # ---- scheduler side ----
    def bind(self, cache: Any) -> None:
        """The scheduler's cache, handed over once before any request (vLLM hands the scheduler's block pool
        to connectors that need it). ``ValueError`` if this connector cannot move its blocks."""
        if self.block_size != cache.block_size:
            raise ValueError(f"the connector's block_size is {self.block_size}, the cache's "
                             f"{cache.block_size}")

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens after the first ``num_computed_tokens`` (the prefix cache's hit) the connector can supply:
        never the last token (it is computed for its logits). Changes nothing the step cannot undo."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: list[int], num_external_tokens: int) -> None:
        """``request`` was admitted with its table ``blocks``; the blocks after its first
        ``len(blocks) * block_size - num_external_tokens`` tokens' hold what this connector offered."""

    def handle_preemption(self, request: Any, blocks: list[int]) -> None:  # noqa: B027 (optional hook)
        """``request`` is about to lose its ``blocks`` (vLLM's ``handle_preemptions``): a connector that keeps
        them copies them out before the step's forward pass and offers them back at readmission."""

    @abstractmethod
    def build_connector_meta(self, plan: Any) -> ConnectorMeta:
        """The step's transfers, as ``schedule()`` ends (``plan.work`` and ``plan.batch`` are final)."""

    def request_finished(self, request: Any) -> None:  # noqa: B027 (optional hook)
        """``request`` is done (finished or aborted): forget it."""

    def reset(self) -> None:  # noqa: B027 (optional hook)
        """Forget every request (the engine dropped them all)."""

    # ---- worker side ----
    @abstractmethod
    def start_load_kv(self, pool: KVPool, meta: ConnectorMeta) -> None:
        """Before the forward pass (also of a step with no rows): whatever must leave blocks the step
        overwrites first, then every load of ``meta`` into its blocks, or ``LoadFailed``."""

    @abstractmethod
    def wait_for_save(self, pool: KVPool, meta: ConnectorMeta) -> None:
        """After the forward pass: save the blocks of ``meta.saves``. A save that fails is dropped (a
        later miss), never raised: the tokens are already right."""

    def stats(self) -> dict[str, int]:
        return {}
