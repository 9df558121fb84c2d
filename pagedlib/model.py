"""A small Llama decoder whose attention runs on the paged KV cache (notebook 08).

Hugging Face's ``LlamaForCausalLM`` parameter names; ``from_hf`` loads only what this computes exactly
(``checks.SUPPORTED_MODELS``; ``pagedlib.loader`` reads the config and copies the weights). A hybrid model's
layers (notebook 15) run full attention or a sliding window, as its config's ``layer_types`` say; its cache
keeps a block table per KV-cache group (``core/groups.py``), and each layer reads its group's. A forward pass
(``PagedLlama.forward``) runs a step the scheduler planned: the new tokens of many sequences flattened
together, decodes and prompt chunks alike (vLLM V1's step), each with the slot the scheduler reserved for it
(``Batch``). Per layer it **writes** K/V there and **attends** through the tables with one varlen kernel,
reading where everything is from the step's ``Step`` (``kernels/varlen.py``). It never allocates.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlib import checks, loader
from pagedlib.core.cache import Batch, PagedKVCache, padded_tables
from pagedlib.core.groups import SLIDING, KVGroup, kv_groups
from pagedlib.kernels.cpu_gemm import PackedLinear, project
from pagedlib.kernels.varlen import Step


@dataclass(frozen=True)
class LlamaShape:
    """The sizes that define the model (a subset of Hugging Face's ``LlamaConfig``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] | None = None  # each layer's kind (None: all full attention; notebook 15)
    sliding_window: int | None = None           # the tokens a sliding layer sees, itself included

    def window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends through (``None``: full attention)."""
        if self.layer_types is None or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The layers grouped as vLLM groups them, one block table each (one group: one kind of layer)."""
        return kv_groups(self.layer_types, self.sliding_window, self.num_layers)

    @classmethod
    def from_hf(cls, config: Any) -> LlamaShape:
        """Read a transformers config; ``ValueError`` naming a field this model does not implement."""
        return cls(**loader.shape_fields(config))


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables ``cos``, ``sin`` ``[T, head_dim]`` for ``positions`` (int64 ``[T]``): dims ``i`` and
    ``i + head_dim/2`` turn by ``position * theta^(-2i/head_dim)``."""
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = torch.outer(positions.float(), inv_freq).repeat(1, 2)             # [T, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``, ``sin`` ``[T, head_dim]`` (half-split pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)       # [T, heads, head_dim]
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    """Grouped-query attention whose K/V live in the paged cache."""

    def __init__(self, shape: LlamaShape, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = shape.window(layer)  # None: full attention
        self.head_dim = shape.head_dim
        q_size = shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        self.q_proj = PackedLinear(shape.hidden_size, q_size, bias=False)
        self.k_proj = PackedLinear(shape.hidden_size, kv_size, bias=False)
        self.v_proj = PackedLinear(shape.hidden_size, kv_size, bias=False)
        self.o_proj = PackedLinear(q_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: Step,
                cache: PagedKVCache) -> torch.Tensor:
        """``x``: ``[T, hidden]`` -> ``[T, hidden]``."""
        T = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)       # one product if packed
        # the projections' heads: -1 is Hq for q, Hkv for k and v
        q = q.view(T, -1, self.head_dim)                                   # [T, Hq, D]
        k = k.view(T, -1, self.head_dim)                                   # [T, Hkv, D]
        v = v.view(T, -1, self.head_dim)                                   # [T, Hkv, D]
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
        k_pool, v_pool = cache.layer(self.layer)              # [num_blocks, block_size, Hkv, D]
        k, v = cache.pool.encode(k, v)                        # fp8: quantized (notebook 10)
        k_pool[step.blocks, step.offsets] = k                 # vLLM's reshape_and_cache
        v_pool[step.blocks, step.offsets] = v
        out = step.attend(q, k_pool, v_pool, cache.k_scale, cache.v_scale, self.window)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, -1))                # [T, Hq * D] -> [T, hidden]


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = PackedLinear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = PackedLinear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = PackedLinear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)               # one product if packed
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, shape: LlamaShape, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape, layer)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: Step,
                cache: PagedKVCache) -> torch.Tensor:
        """``step``: the step as this layer's KV-cache group sees it (its slots and tables)."""
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class PagedLlama(nn.Module):
    """A Llama decoder that keeps its K/V in a ``PagedKVCache``: ``forward`` runs a planned step (a run of new
    tokens for each of several sequences: a prompt, a prompt's chunk, a decode's one token) and returns the
    logits after each run's last token; ``step`` plans a one-off step itself."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, layer) for layer in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = PackedLinear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    # a copy of a transformers LlamaForCausalLM or MistralForCausalLM (its dtype, device unless given)
    from_hf = classmethod(loader.from_hf)

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> PagedLlama:
        """Build from a config and a ``LlamaForCausalLM``-style ``state_dict`` (``model.`` prefixes and a
        missing tied ``lm_head.weight`` are fine); ``ValueError`` naming unknown or missing weights."""
        shape = LlamaShape.from_hf(config)
        checks.check_model_dtype(dtype)  # before the model's weights are allocated
        return loader.load_weights(cls(shape), state_dict, dtype, device)

    def pack_weights(self) -> PagedLlama:
        """Pack every projection's weight for oneDNN, as vLLM's CPU path does (``PackedLinear``; float32 on a
        CPU): a second copy of the weights, made again if one changes. Returns the model."""
        for module in self.modules():
            if isinstance(module, PackedLinear):
                module.pack()
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_blocks: int, block_size: int = 16, *,
                  enable_prefix_caching: bool = False, kv_cache_dtype: torch.dtype | None = None,
                  prefix_cache: str = "hash", hybrid_kv_cache: bool = True) -> PagedKVCache:
        """An empty ``PagedKVCache`` with this model's geometry, dtype (or an fp8 ``kv_cache_dtype``, scales
        1.0) and device. A model with sliding layers gets a table per KV-cache group (its window groups give
        back the blocks their window has left); ``hybrid_kv_cache=False``: one table for every layer, as
        vLLM's ``--disable-hybrid-kv-cache-manager`` (the windows then only mask, every block stays)."""
        dtype = checks.check_kv_cache_dtype(kv_cache_dtype, self.dtype)
        if not isinstance(hybrid_kv_cache, bool):
            raise ValueError(f"hybrid_kv_cache must be a bool, got {hybrid_kv_cache!r}")
        shape = self.shape
        grouped = {}
        if hybrid_kv_cache and shape.layer_types is not None:
            grouped = dict(groups=shape.kv_groups)
        return PagedKVCache(num_blocks, shape.num_layers, block_size, shape.num_kv_heads,
                            shape.head_dim, dtype=dtype, device=self.device,
                            enable_prefix_caching=enable_prefix_caching, prefix_cache=prefix_cache,
                            **grouped)

    @torch.no_grad()
    def step(self, cache: PagedKVCache, seq_ids: Sequence[Hashable],
             chunks: Sequence[Sequence[int]], *, attention: str = "torch") -> torch.Tensor:
        """A one-off step outside an engine (notebook 08): append ``chunks[i]`` (>= 1 token) to distinct live
        sequence ``seq_ids[i]``, each token attending causally to everything its sequence holds. Returns
        ``[batch, vocab_size]`` logits after each chunk's last token. All or nothing: ``OutOfBlocksError`` if
        the pool cannot hold every chunk, and a forward pass that raises (an interrupt) is undone."""
        seq_ids, chunks = checks.check_step(self, cache, seq_ids, chunks, attention)
        with cache.reserving(seq_ids, chunks) as batch:  # slots reserved; undone if the pass raises
            return self.forward(cache, batch, attention)

    @torch.no_grad()
    def forward(self, cache: PagedKVCache, batch: Batch, attention: str = "torch") -> torch.Tensor:
        """Run a step planned already (``Scheduler.schedule``'s ``plan.batch``): make its block copies, then
        per layer write each new token's K/V into its slot and attend through the tables. Returns
        ``[len(batch.seq_ids), vocab_size]`` logits after each sequence's last new token."""
        cache.pool.copy_blocks(batch.copies)
        return self._forward(self._steps(cache, batch, attention), cache)

    def _steps(self, cache: PagedKVCache, batch: Batch, attention: str) -> list[Step]:
        """The ``Step`` tensors of ``batch`` as each KV-cache group sees them (one group: one ``Step``): the
        tokens, positions and lengths of all, and each group's slots and tables."""
        device = self.device
        block_size = cache.block_size
        positions = []
        query_start_loc = [0]
        for length, new in zip(batch.seq_lens, batch.slots):
            positions += range(length - len(new), length)
            query_start_loc.append(len(positions))
        tokens = [token for new in batch.token_ids for token in new]  # type: ignore[union-attr]
        shared = dict(tokens=torch.tensor(tokens, device=device),
                      positions=torch.tensor(positions, device=device),
                      query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
                      seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
                      attention=attention)
        steps = []
        group_slots = batch.group_slots or [batch.slots]
        for slots, tables in zip(group_slots, batch.group_tables or [batch.block_tables]):
            # slot = block * block_size + offset (vLLM's slot_mapping); a list of ints makes int64 tensors
            flat_slots = [slot for sequence_slots in slots for slot in sequence_slots]
            slot_mapping = torch.tensor(flat_slots, device=device)              # [T]
            width = max(map(len, tables))
            steps.append(Step(blocks=slot_mapping // block_size, offsets=slot_mapping % block_size,
                              block_tables=padded_tables(tables, width, device),  # [B, max_blocks]
                              **shared))
        return steps

    def _forward(self, steps: list[Step], cache: PagedKVCache) -> torch.Tensor:
        """Run every layer on the step's tokens, each through its KV-cache group's ``Step``; ``[B, vocab]``
        logits after each sequence's last token."""
        shape = self.shape
        step = steps[0]
        group_of = [cache.layer_place[layer][0] for layer in range(shape.num_layers)]  # layer -> its group
        x = self.embed_tokens(step.tokens)                                 # [T, hidden]
        # cos, sin: [T, head_dim] each
        rope = rope_cos_sin(step.positions, shape.head_dim, shape.rope_theta, x.dtype)
        for layer, group in zip(self.layers, group_of):
            x = layer(x, rope, steps[group], cache)
        last = step.query_start_loc[1:].long() - 1                         # [B]
        return self.lm_head(self.norm(x[last]))                            # [B, vocab]
