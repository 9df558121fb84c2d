"""vLLM's side of the store (notebook 14): a KV connector that vLLM loads by its module path.

vLLM asks a *connector* two kinds of question. Its **scheduler** asks, when it admits a request, how many
of the prompt's tokens past its own prefix-cache hit an outside store can supply, and at the end of each
scheduling step what the workers must load and save; its **worker** then does the copying around the
model's forward pass. This file answers both for ``KVStore`` (``pagedlib.kv_transfer.store``), so vLLM and
pagedlib's ``Engine`` (with ``StoreConnector``) read and write the same entries::

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=folder, block_size=32, ...,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="PagedlibConnector", kv_connector_module_path="pagedlib.vllm.connector",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"store": "/some/folder"}))

``kv_connector_extra_config`` takes ``store`` (the store's folder, required) and ``model`` (the store's
name for the model; default: ``model_fingerprint`` of the folder vLLM loaded). ``kv_role`` says what the
connector does: ``kv_producer`` only saves, ``kv_consumer`` only loads, ``kv_both`` does both.

The rules both engines follow:

These rules are ``pagedlib.kv_transfer.rules``, which ``StoreConnector`` follows too:

* **Keys.** Block ``i`` of a request is entry ``block_hashes(token_ids, block_size)[i]``; its parent is
  entry ``i - 1`` (``""`` for block 0).
* **Load, at admission.** Past the local prefix cache's hit, the full blocks before the block that holds
  the last prompt token (that token is always computed, its logits give the first new token), as many as
  the store holds in a row with a sound header. They are loaded before the step's forward pass
  (synchronously), so the request's first step starts after them.
* **Save, after each step.** Every full block all of whose tokens are computed, prompt or generated, that
  the store lacks. A prompt chunked over several steps gets its blocks saved as its chunks complete them,
  which is why the connector follows each request's block ids across steps (new requests' ``block_ids``,
  then running requests' ``new_block_ids``), not just its first chunk's.
* **A failed load is recomputed.** An entry that passed the header check at admission can still fail to
  load (deleted, truncated or rewritten since): the worker reports its block through
  ``get_block_ids_with_load_errors`` and vLLM's scheduler moves the request back to the block before it
  and computes the rest. vLLM does this only with ``kv_load_failure_policy="recompute"``; with its default,
  ``"fail"``, it ends the request with an error instead.

**vLLM's CPU cache layout.** The CPU attention backend keeps a layer's cache as ``[num_blocks, kv_heads,
block_size, 2 * head_dim]`` and views it as ``[num_blocks, kv_heads, 2 * block_size, head_dim]``: for each
block and head, K's rows then V's. How K's numbers are ordered inside its half depends on the kernels'
ISA (with ``vec`` on float32, K is kept transposed). So this connector never writes that layout itself:
it writes blocks through the backend's own op, ``cpu_attn_reshape_and_cache``, and reads them back through
the inverse it measures from that op once (``CpuBlockLayout``).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from pagedlib.core.prefix_cache import BlockKey, chained_keys
from pagedlib.kv_transfer import rules
from pagedlib.kv_transfer.store import EntryError, KVStore, block_hashes, model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


# ---- vLLM's CPU block layout, measured from its own op ------------------------------------------------

def cpu_attention_isa(dtype: torch.dtype, block_size: int, head_dim: int,
                      kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU attention backend picks for this cache (``vec``, ``amx``, ``neon``, ...): the
    backend's own choice, so the connector lays blocks out as the kernels read them."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)


class CpuBlockLayout:
    """Blocks in and out of one layer's CPU cache tensor (``[num_blocks, kv_heads, block_size,
    2 * head_dim]``), in the store's neutral layout ``[block_size, kv_heads, head_dim]`` per block.

    ``write`` calls vLLM's ``cpu_attn_reshape_and_cache``, the op the backend uses for new tokens. ``read``
    is its inverse, measured once at construction: the op writes a block whose every number is its own
    index, and where each index lands in the cache says where to read it from. Indices are written in
    base-128 digits, one pass a digit, so every number is exact in any cache dtype (bfloat16 holds the
    integers up to 256 exactly)."""

    def __init__(self, isa: str, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
        self.isa, self.kv_heads, self.block_size, self.head_dim, self.dtype = (
            isa, kv_heads, block_size, head_dim, dtype)
        self.k_from, self.v_from = self._measure()

    def halves(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V halves of a layer's cache, viewed exactly as the backend views them."""
        num_blocks, kv_heads, block_size, _ = layer.shape
        return layer.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)

    def write(self, layer: torch.Tensor, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Put ``k``, ``v`` (``[len(block_ids), block_size, kv_heads, head_dim]``) into those blocks."""
        from vllm import _custom_ops as ops

        slots = (torch.tensor(block_ids, dtype=torch.int64)[:, None] * self.block_size
                 + torch.arange(self.block_size)).flatten()
        shape = (-1, self.kv_heads, self.head_dim)
        key_cache, value_cache = self.halves(layer)
        ops.cpu_attn_reshape_and_cache(k.reshape(shape).to(layer.dtype).contiguous(),
                                       v.reshape(shape).to(layer.dtype).contiguous(),
                                       key_cache, value_cache, slots, self.isa)

    def read(self, layer: torch.Tensor, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of those blocks, each ``[len(block_ids), block_size, kv_heads, head_dim]``."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        shape = (len(block_ids), self.block_size, self.kv_heads, self.head_dim)
        key_cache, value_cache = self.halves(layer)
        k = key_cache[index].reshape(len(block_ids), -1)[:, self.k_from]
        v = value_cache[index].reshape(len(block_ids), -1)[:, self.v_from]
        return k.view(shape), v.view(shape)

    def _measure(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each number of a neutral block (flattened), where the op puts it in a block's K half and in
        its V half (flattened as ``halves`` views them)."""
        count = self.block_size * self.kv_heads * self.head_dim
        numbers = torch.arange(count)
        landed = [torch.zeros(count, dtype=torch.int64) for _ in range(2)]
        for digit in range(max(1, math.ceil(math.log(count, 128)))):
            scratch = torch.full((1, self.kv_heads, self.block_size, 2 * self.head_dim), -1.0,
                                 dtype=self.dtype)
            pattern = ((numbers // 128 ** digit) % 128).to(self.dtype)
            pattern = pattern.view(self.block_size, self.kv_heads, self.head_dim)
            self.write(scratch, [0], pattern[None], pattern[None])
            for found, half in zip(landed, self.halves(scratch)):
                values = half[0].flatten().to(torch.int64)
                if (values < 0).any():
                    raise RuntimeError(f"cpu_attn_reshape_and_cache (isa={self.isa}) left part of a block "
                                       f"unwritten: this layout cannot be read back")
                found += values * 128 ** digit
        inverses = []
        for found in landed:
            if not torch.equal(torch.sort(found).values, numbers):
                raise RuntimeError(f"cpu_attn_reshape_and_cache (isa={self.isa}) does not place a block's "
                                   f"numbers one to a slot: this layout cannot be read back")
            source_at = torch.empty(count, dtype=torch.int64)
            source_at[found] = torch.arange(count)      # source_at[number] = where that number sits
            inverses.append(source_at)
        return inverses[0], inverses[1]


# ---- what the scheduler hands the worker each step -----------------------------------------------------

@dataclass
class BlockLoad:
    req_id: str
    block_id: int
    key: str


@dataclass
class BlockSave:
    req_id: str
    block_id: int
    key: str
    parent: str


@dataclass
class StorePlan(KVConnectorMetadata):
    """One step's copies: blocks to load before the forward pass, blocks to save after it."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class _Tracked:
    """The scheduler side's view of one running request: its block ids, how many blocks were saved, and its
    full blocks' keys so far (extended as it grows, never made again)."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    keys: list[str] = field(default_factory=list)  # the store's names: the keys' digests
    last: BlockKey | None = None

    def block_keys(self, n: int, block_size: int) -> list[str]:
        if len(self.keys) < n:
            tokens = list(self.request.all_token_ids)
            for key in chained_keys(tokens, block_size, n, len(self.keys), self.last):
                self.keys.append(key.digest)
                self.last = key
        return self.keys


# ---- the connector ---------------------------------------------------------------------------------------

class PagedlibConnector(KVConnectorBase_V1):
    """vLLM's connector to a ``KVStore``. vLLM builds two of them: one with ``role`` SCHEDULER (in the
    engine core, next to the scheduler) and one with role WORKER (next to the model). They share nothing
    but the store's folder and the ``StorePlan`` the scheduler's one builds each step."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        settings = transfer.kv_connector_extra_config or {}
        if not settings.get("store"):
            raise ValueError('PagedlibConnector needs kv_connector_extra_config={"store": folder}')
        model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
        if vllm_config.cache_config.cache_dtype not in ("auto", None):
            raise ValueError(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype}: the store keeps the "
                             f"model's own dtype only")
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning("kv_load_failure_policy=%r: an entry that fails to load ends its request with "
                           "an error; 'recompute' makes vLLM compute it instead",
                           transfer.kv_load_failure_policy)
        self.block_size = vllm_config.cache_config.block_size
        model = settings.get("model") or model_fingerprint(model_config.model)
        self.store = KVStore(settings["store"], model=model,
                             block_size=self.block_size, num_layers=model_config.get_num_layers(parallel),
                             kv_heads=model_config.get_num_kv_heads(parallel),
                             head_dim=model_config.get_head_size(), dtype=model_config.dtype)
        self.loads_enabled = transfer.is_kv_consumer
        self.saves_enabled = transfer.is_kv_producer
        # scheduler side
        self._matches: dict[str, tuple[int, list[str]]] = {}     # request -> (first block, keys it may load)
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: list[BlockLoad] = []
        # worker side
        self._layers: list[torch.Tensor] = []
        self.layout: CpuBlockLayout | None = None
        self.written_by = ""
        self._load_errors: set[int] = set()
        self._failed_requests: set[str] = set()     # requests whose load failed in this step

    # ---- scheduler side ------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Called when the scheduler tries to admit ``request`` (maybe more than once, if it must wait),
        after the local prefix cache found ``num_computed_tokens`` (whole blocks): how many tokens after
        those the store supplies, and ``False`` (they are loaded synchronously, in the step that admits
        the request). Reads only the entries' headers."""
        if not self.loads_enabled:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        first = num_computed_tokens // self.block_size
        keys = block_hashes(prompt, self.block_size, rules.offer_stop(len(prompt), self.block_size))
        found = rules.offer(keys, lambda key: self.store.check_header(key) is None, first)
        self._matches[request.request_id] = (first, keys[first:first + found])
        return found * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """Called once the scheduler gave an admitted request its blocks (every admitted request, store hit
        or not): the blocks that receive the ``num_external_tokens`` go on the next plan's loads, and the
        request is followed from now on for its saves."""
        self._tracked[request.request_id] = _Tracked(request)
        first, keys = self._matches.pop(request.request_id, (0, []))
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        for offset, key in enumerate(keys[:num_external_tokens // self.block_size]):
            self._pending_loads.append(BlockLoad(request.request_id, block_ids[first + offset], key))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StorePlan:
        """Called at the end of each scheduling step: the step's ``StorePlan``. Loads are those admissions
        asked for; saves are the full blocks that this step's computation completes and the store lacks.
        Block ids are followed across steps: a new request brings its first blocks, a running one the
        blocks added for this step, a resumed one (after a preemption) all of its blocks anew."""
        plan = StorePlan(loads=self._pending_loads)
        self._pending_loads = []
        computed = self._follow_blocks(scheduler_output)
        if self.saves_enabled:
            plan.saves = self._saves(computed)
        return plan

    def _follow_blocks(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Bring each scheduled request's block ids up to date; how many of its tokens are computed once
        this step has run."""
        computed: dict[str, int] = {}
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens + scheduled[new.req_id]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(added[0]) if added else []
            elif added:
                tracked.block_ids.extend(added[0])
            # after a failed load vLLM moves a request back to the failed block: blocks from there on
            # are computed again, and saved then (the worker skipped them in the failed step)
            tracked.saved = min(tracked.saved, cached.num_computed_tokens[i] // self.block_size)
            computed[req_id] = cached.num_computed_tokens[i] + scheduled[req_id]
        return computed

    def _saves(self, computed: dict[str, int]) -> list[BlockSave]:
        """The full blocks the step completes that the store lacks (each key once, if requests share it)."""
        saves, planned = [], set()
        for req_id, tokens in computed.items():
            tracked = self._tracked[req_id]
            tokens = min(tokens, len(tracked.block_ids) * self.block_size)
            filled = rules.filled(tracked.saved * self.block_size, tokens, self.block_size)
            if not filled:
                continue
            keys = tracked.block_keys(filled.stop, self.block_size)
            for index in filled:
                if keys[index] not in planned and keys[index] not in self.store:
                    planned.add(keys[index])
                    parent = keys[index - 1] if index else ""
                    saves.append(BlockSave(req_id, tracked.block_ids[index], keys[index], parent))
            tracked.saved = filled.stop
        return saves

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request ends, before its blocks are freed: its saves were all made in the
        steps that computed them, so the blocks can go at once (``False``), and nothing is sent back."""
        self._tracked.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        return False, None

    # ---- worker side -----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once, after the worker allocated the cache: one tensor per attention layer, named like
        ``model.layers.0.self_attn.attn``. Kept in layer order; the block layout is measured here."""
        def layer_index(name: str) -> int:
            numbers = re.findall(r"\.(\d+)\.", f".{name}.")
            if not numbers:
                raise ValueError(f"cannot tell the layer index of {name!r}")
            return int(numbers[0])

        names = sorted(kv_caches, key=layer_index)
        self._layers = [kv_caches[name] for name in names]
        num_layers, block_size, kv_heads, head_dim = self.store.shape
        for name, layer in zip(names, self._layers):
            if layer.dim() != 4 or tuple(layer.shape[1:]) != (kv_heads, block_size, 2 * head_dim):
                raise ValueError(f"{name}: cache {list(layer.shape)} is not vLLM's CPU layout [num_blocks, "
                                 f"{kv_heads}, {block_size}, {2 * head_dim}]")
        if len(self._layers) != num_layers:
            raise ValueError(f"the model has {len(self._layers)} attention layers, the store {num_layers}")
        dtype = self._layers[0].dtype
        isa = cpu_attention_isa(dtype, block_size, head_dim)
        self.layout = CpuBlockLayout(isa, kv_heads, block_size, head_dim, dtype)
        from vllm import __version__

        self.written_by = f"vllm {__version__} cpu_attn isa={isa}"

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Called before the step's forward pass when the plan has loads (after it otherwise): copy each
        planned entry into its block, every layer. A request's loads stop at its first entry that fails;
        that block and the request's later ones are reported as load errors, so vLLM recomputes them."""
        plan = self._get_connector_metadata()
        assert isinstance(plan, StorePlan)
        if not plan.loads:
            return
        failed_requests = self._failed_requests = set()
        block_ids, ks, vs = [], [], []
        for load in plan.loads:
            if load.req_id in failed_requests:
                self._load_errors.add(load.block_id)
                continue
            try:
                k, v = self.store.get(load.key)
            except EntryError as error:
                logger.warning("store entry not loaded, vLLM recomputes its block: %s", error)
                failed_requests.add(load.req_id)
                self._load_errors.add(load.block_id)
                continue
            block_ids.append(load.block_id)
            ks.append(k)
            vs.append(v)
        if not block_ids:
            return
        k_all, v_all = torch.stack(ks, dim=1), torch.stack(vs, dim=1)    # [layers, blocks, bs, heads, dim]
        for layer, k, v in zip(self._layers, k_all, v_all):
            self.layout.write(layer, block_ids, k, v)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by each attention layer before it runs: nothing to wait for, every load finished in
        ``start_load_kv``."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Called by each attention layer after it wrote its new K and V: nothing yet. An entry holds every
        layer of its block, so blocks are saved in ``wait_for_save``, once the whole model has run."""

    def wait_for_save(self) -> None:
        """Called once per step, after the forward pass: read each planned block from every layer and write
        its entry (atomically; an entry the store got meanwhile is left as it is). A request whose load
        failed in this step computed its new tokens over a block it never got: none of its blocks is
        saved (vLLM computes them again, and they are saved then)."""
        plan = self._get_connector_metadata()
        assert isinstance(plan, StorePlan)
        saves = [save for save in plan.saves if save.req_id not in self._failed_requests]
        self._failed_requests = set()
        if not saves or self.layout is None:
            return
        block_ids = [save.block_id for save in saves]
        read = [self.layout.read(layer, block_ids) for layer in self._layers]
        k_all = torch.stack([k for k, _ in read])               # [layers, blocks, bs, heads, dim]
        v_all = torch.stack([v for _, v in read])
        for i, save in enumerate(saves):
            try:
                self.store.put(save.key, save.parent, k_all[:, i], v_all[:, i], self.written_by)
            except OSError as error:       # a store gone or full: a save lost is only a later miss
                logger.warning("store entry %s... not saved: %s", save.key[:12], error)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Called after each step: the blocks whose entries failed to load in it (then forgotten)."""
        errors, self._load_errors = self._load_errors, set()
        return errors
