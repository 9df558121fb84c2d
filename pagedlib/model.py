"""A small Llama decoder whose attention runs on the paged KV cache (notebook 08).

Hugging Face's ``LlamaForCausalLM`` parameter names; ``from_hf`` loads only what this computes exactly
(``checks.SUPPORTED_MODELS``). A forward pass (``PagedLlama.step``) runs the new tokens of many sequences
flattened together, decodes and prompt chunks alike (vLLM V1's step): it first **reserves** a slot for every
new token (``cache.reserve``: blocks taken, nothing written), then per layer **writes** K/V there and
**attends** through the table with one varlen kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedlib import checks
from pagedlib.core.cache import PagedKVCache
from pagedlib.kernels.varlen import Piece, attend_varlen, plan_varlen


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

    @classmethod
    def from_hf(cls, config: Any) -> LlamaShape:
        """Read a transformers config; ``ValueError`` naming a field this model does not implement."""
        checks.check_hf_config(config)
        rope = getattr(config, "rope_parameters", None) or {}
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rms_norm_eps=float(config.rms_norm_eps),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


@dataclass
class Step:
    """The ``T`` new tokens of one forward pass over ``B`` sequences, where they go, and how they attend."""

    seq_ids: list[Hashable]
    tokens: torch.Tensor              # int64 [T]
    positions: torch.Tensor           # int64 [T]
    blocks: torch.Tensor              # int64 [T]: each token's slot is (block, offset)
    offsets: torch.Tensor             # int64 [T]
    query_start_loc: torch.Tensor     # int32 [B + 1]: sequence b's rows are [loc[b], loc[b + 1])
    block_tables: torch.Tensor        # int32 [B, max_blocks], after the step
    seq_lens: torch.Tensor            # int32 [B], after the step
    kernel: Callable[..., torch.Tensor] | None   # the Triton varlen kernel; None: torch, with
    plan: list[Piece] | None          # its plan, the same for every layer (plan_varlen)

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               k_scale: float | torch.Tensor = 1.0,
               v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """One layer's attention for every new token: ``q`` ``[T, q_heads, head_dim]`` -> the same (the
        scales: an fp8 cache's, notebook 10). The torch path skips ``paged_attention_varlen``'s checks and
        plan: the step's inputs are built here, once."""
        if self.kernel is not None:
            return self.kernel(q, k_pool, v_pool, self.block_tables, self.seq_lens,
                               self.query_start_loc, k_scale=k_scale, v_scale=v_scale)
        return attend_varlen(q, k_pool, v_pool, self.plan, q.shape[-1] ** -0.5, k_scale, v_scale)


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
    angles = positions.float()[:, None] * inv_freq[None, :]                    # [T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)                                # [T, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``, ``sin`` ``[T, head_dim]`` (half-split pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)       # [T, heads, head_dim]
    return x * cos[:, None] + rotated * sin[:, None]


def attention_kernel(attention: str, head_dim: int) -> Callable[..., torch.Tensor] | None:
    """``None`` for ``"torch"`` (``Step.attend`` calls ``attend_varlen``), or ``paged_attention_varlen``'s
    Triton twin (``"triton"``: imported when asked)."""
    checks.check_attention(attention)
    if attention == "torch":
        return None
    from pagedlib.kernels import triton_decode

    if head_dim > triton_decode.MAX_HEAD_DIM:
        most = triton_decode.MAX_HEAD_DIM
        raise ValueError(f"head_dim must be at most {most} for the Triton kernel, "
                         f"the model has {head_dim}")
    from pagedlib.kernels.triton_varlen import paged_attention_varlen_triton

    return paged_attention_varlen_triton


class Attention(nn.Module):
    """Grouped-query attention whose K/V live in the paged cache."""

    def __init__(self, shape: LlamaShape, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = shape.num_heads
        self.num_kv_heads = shape.num_kv_heads
        self.head_dim = shape.head_dim
        self.q_proj = nn.Linear(shape.hidden_size, shape.num_heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], step: Step,
                cache: PagedKVCache) -> torch.Tensor:
        """``x``: ``[T, hidden]`` -> ``[T, hidden]``."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)          # [T, Hq, D]
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)       # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)       # [T, Hkv, D]
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
        k_pool, v_pool = cache.layer(self.layer)              # [num_blocks, block_size, Hkv, D]
        k, v = cache.pool.encode(k, v)                        # fp8: quantized (notebook 10)
        k_pool[step.blocks, step.offsets] = k                 # vLLM's reshape_and_cache
        v_pool[step.blocks, step.offsets] = v
        out = step.attend(q, k_pool, v_pool, cache.k_scale, cache.v_scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class PagedLlama(nn.Module):
    """A Llama decoder that keeps its K/V in a ``PagedKVCache``: ``step`` appends a run of tokens to each of
    several sequences (a prompt, a prompt's chunk, a decode's one token) and returns the logits after each
    run's last token."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, layer) for layer in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_hf(cls, hf_model: Any, *, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None) -> PagedLlama:
        """Copy a transformers ``LlamaForCausalLM`` or ``MistralForCausalLM`` (default: its dtype, device)."""
        checks.check_hf_model(hf_model)
        first = next(hf_model.parameters())
        dtype = dtype or first.dtype
        device = device or first.device
        state_dict = hf_model.state_dict()
        return cls.from_state_dict(hf_model.config, state_dict, dtype=dtype, device=device)

    @classmethod
    def from_state_dict(cls, config: Any, state_dict: dict[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> PagedLlama:
        """Build from a config and a ``LlamaForCausalLM``-style ``state_dict`` (``model.`` prefixes and a
        missing tied ``lm_head.weight`` are fine); ``ValueError`` naming unknown or missing weights."""
        shape = LlamaShape.from_hf(config)
        checks.check_model_dtype(dtype)
        model = cls(shape)
        state = {}
        for name, weight in state_dict.items():
            if "rotary_emb" not in name:  # transformers' rotary buffers: computed here
                state[name.removeprefix("model.")] = weight
        if shape.tie_word_embeddings and "embed_tokens.weight" in state:
            state.setdefault("lm_head.weight", state["embed_tokens.weight"])
        checks.check_weights(*model.load_state_dict(state, strict=False))     # missing, unexpected
        return model.to(dtype=dtype, device=device).eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, num_blocks: int, block_size: int = 16, *,
                  enable_prefix_caching: bool = False, kv_cache_dtype: torch.dtype | None = None,
                  prefix_cache: str = "hash") -> PagedKVCache:
        """An empty ``PagedKVCache`` with this model's geometry, dtype (or an fp8 ``kv_cache_dtype``, scales
        1.0) and device."""
        dtype = checks.check_kv_cache_dtype(kv_cache_dtype, self.dtype) or self.dtype
        shape = self.shape
        return PagedKVCache(num_blocks, shape.num_layers, block_size, shape.num_kv_heads,
                            shape.head_dim, dtype=dtype, device=self.device,
                            enable_prefix_caching=enable_prefix_caching, prefix_cache=prefix_cache)

    @torch.no_grad()
    def step(self, cache: PagedKVCache, seq_ids: Sequence[Hashable],
             chunks: Sequence[Sequence[int]], *, attention: str = "torch") -> torch.Tensor:
        """One forward pass: append ``chunks[i]`` (>= 1 token) to distinct live sequence ``seq_ids[i]``, each
        token attending causally to everything its sequence holds. Returns ``[batch, vocab_size]`` logits
        after each chunk's last token. All or nothing: ``OutOfBlocksError`` if the pool cannot hold every
        chunk, and a forward pass that raises (an interrupt) is undone; the blocks it fills become findable
        by prefix caching only once every layer has written its K/V."""
        seq_ids, chunks = checks.check_step(self, cache, seq_ids, chunks, attention)
        kernel = attention_kernel(attention, self.shape.head_dim)       # imports triton when asked
        starts = [cache.seq_lens[seq_id] for seq_id in seq_ids]
        counts = [len(chunk) for chunk in chunks]
        tokens = [token for chunk in chunks for token in chunk]
        logits = []

        def forward(slots: list[list[int]], copies: list[tuple[int, int]]) -> None:
            cache.pool.copy_blocks(copies)
            step = self._step(cache, seq_ids, starts, chunks, kernel)
            logits.append(self._forward(step, cache))

        # checked above (check_step), so straight to the block manager: blocks, then the forward pass
        cache.manager.reserve(seq_ids, counts, tokens, forward)
        return logits[0]

    def _step(self, cache: PagedKVCache, seq_ids: list[Hashable], starts: list[int],
              chunks: list[list[int]], kernel: Callable[..., torch.Tensor] | None) -> Step:
        """The ``Step`` of tokens ``chunks[i]`` placed at positions ``starts[i]...`` (already reserved)."""
        device = self.device
        block_size = cache.block_size
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []         # the sequence (row of the block tables) of each token
        query_start_loc = [0]
        for row, (start, chunk) in enumerate(zip(starts, chunks)):
            tokens += chunk
            positions += range(start, start + len(chunk))
            rows += [row] * len(chunk)
            query_start_loc.append(len(tokens))
        position_tensor = torch.tensor(positions, dtype=torch.int64, device=device)  # [T]
        tables = cache.block_table(seq_ids)                                  # [B, max_blocks]
        row_tensor = torch.tensor(rows, device=device)                       # [T]
        blocks = tables.long()[row_tensor, position_tensor // block_size]    # [T]
        lens = [start + len(chunk) for start, chunk in zip(starts, chunks)]
        plan = None
        if kernel is None:
            shape = self.shape
            kv_bytes_per_token = 2 * shape.num_kv_heads * shape.head_dim * self.dtype.itemsize
            plan = plan_varlen(tables, lens, query_start_loc, block_size, kv_bytes_per_token)
        return Step(
            seq_ids=seq_ids,
            tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
            positions=position_tensor,
            blocks=blocks,
            offsets=position_tensor % block_size,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            kernel=kernel,
            plan=plan,
        )

    def _forward(self, step: Step, cache: PagedKVCache) -> torch.Tensor:
        """Run every layer on ``step``'s tokens; ``[B, vocab]`` logits after each sequence's last token."""
        shape = self.shape
        x = self.embed_tokens(step.tokens)                                 # [T, hidden]
        # cos, sin: [T, head_dim] each
        rope = rope_cos_sin(step.positions, shape.head_dim, shape.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, step, cache)
        last = step.query_start_loc[1:].long() - 1                         # [B]
        return self.lm_head(self.norm(x[last]))                            # [B, vocab]
