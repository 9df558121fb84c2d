"""The KV pool: K and V ``[num_blocks, num_layers, block_size, kv_heads, head_dim]``, so one block table
serves every layer. A token's place is its slot id ``block * block_size + offset`` (vLLM's
``slot_mapping``); ``write`` puts new K/V there as vLLM's ``reshape_and_cache`` does, one indexed write per
pool. The pool knows nothing of sequences: the ``BlockManager`` says which slots to use.

With several KV-cache groups (notebook 15) the second dimension is ``layers_per_group``: a block belongs to
one group at a time and holds its layers, layer ``i`` of the group at index ``i`` (a smaller group leaves
the last indices unused). One group of every layer is notebook 02's layout exactly."""

from __future__ import annotations

import torch

from pagedlib.core.fp8 import FP8_DTYPES, quantize


class KVPool:
    """K and V, each of ``shape`` ``(num_blocks, num_layers, block_size, kv_heads, head_dim)``, filled with
    ``fill``. Writes never record autograd history; an fp8 pool stores ``x / k_scale`` (``v_scale``),
    saturated (``fp8.quantize``)."""

    def __init__(self, shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str,
                 fill: float = 0.0, k_scale: float | torch.Tensor = 1.0,
                 v_scale: float | torch.Tensor = 1.0) -> None:
        self.k = torch.full(shape, fill, dtype=dtype, device=device)
        self.v = torch.full_like(self.k, fill)
        self.device = self.k.device  # normalised: "cuda" -> "cuda:0"
        _, self.num_layers, self.block_size, kv_heads, head_dim = shape
        self.flat = (-1, kv_heads, head_dim)  # a pool seen as rows of one token of one layer
        layers = torch.arange(self.num_layers, device=self.device)
        # [L, 1]: where each layer starts in a block
        self.layer_rows = layers[:, None] * self.block_size
        self.k_scale = k_scale
        self.v_scale = v_scale

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[..., kv_heads, head_dim]`` as the pools store them: quantized if they are fp8."""
        if self.k.dtype not in FP8_DTYPES:
            return k, v
        return quantize(k, self.k_scale, self.k.dtype), quantize(v, self.v_scale, self.v.dtype)

    def rows(self, slots: list[int], layers: int | None = None) -> torch.Tensor:
        """int64 ``[layers * n]`` rows of ``slots`` in a block's first ``layers`` layers (``None``: all),
        layer-major, in the pool flattened to ``[-1, H, D]``: (layer ``l``, slot) is row
        ``(block * num_layers + l) * block_size + offset``."""
        block_size = self.block_size
        rows_per_block = self.num_layers * block_size
        first = [slot // block_size * rows_per_block + slot % block_size for slot in slots]
        first_rows = torch.tensor(first, dtype=torch.long, device=self.device)   # [n]: layer 0
        return (first_rows + self.layer_rows[:layers]).view(-1)  # [L, 1] + [n] -> [L, n]

    def write(self, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write token ``i`` of ``k``, ``v`` (``[layers, n, kv_heads, head_dim]``, ``layers`` at most
        ``num_layers``: a block's first ones) into slot ``slots[i]`` of each layer: one ``index_copy_`` per
        pool."""
        rows = self.rows(slots, k.shape[0])
        k, v = self.encode(k.detach(), v.detach())
        for pool, new in ((self.k, k), (self.v, v)):
            flat_pool = _bits(pool).view(self.flat)
            flat_pool.index_copy_(0, rows, _bits(new).reshape(self.flat))  # [L * n, H, D]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` (every layer, K and V) for each pair (copy-on-write)."""
        if not copies:
            return
        pairs = torch.tensor(copies, device=self.device)  # [c, 2]: (source, destination) rows
        for pool in (self.k, self.v):
            pool[pairs[:, 1]] = pool[pairs[:, 0]]  # [c, L, block_size, H, D]

    def gather(self, slots: list[int], layers: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of K and V at ``slots`` in a block's first ``layers`` layers (``None``: all), as
        stored: ``[layers, n, kv_heads, head_dim]``."""
        layers = self.num_layers if layers is None else layers
        rows = self.rows(slots, layers)
        shape = (layers, len(slots), *self.flat[1:])
        k = self.k.view(self.flat).index_select(0, rows).view(shape)
        v = self.v.view(self.flat).index_select(0, rows).view(shape)
        return k, v


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as ``uint8`` (the same bytes): torch's CPU indexing kernels have no fp8 versions."""
    if t.dtype in FP8_DTYPES:
        return t.view(torch.uint8)
    return t
