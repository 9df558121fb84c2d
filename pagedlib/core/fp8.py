"""FP8 K/V (notebook 10): the cache stores ``x / scale`` saturated to the format's finite range and cast to
one byte; attention reads ``stored.float() * scale``. A scale is a float (per tensor, vLLM's default) or a
float32 tensor ``[kv_heads]`` (one per KV head)."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def per_head(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A float as it is; a ``[kv_heads]`` tensor as ``[kv_heads, 1]``, to broadcast over ``[..., H, D]``."""
    return scale if isinstance(scale, float) else scale[:, None]


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., kv_heads, head_dim]`` as ``dtype``: divided by ``scale``, clamped to the finite range
    (torch's cast gives e5m2 an inf beyond it), rounded to nearest. NaN stays NaN."""
    top = torch.finfo(dtype).max
    return (x.float() / per_head(scale)).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """What an fp8 ``x`` ``[..., kv_heads, head_dim]`` stands for: ``x.float() * scale``, as ``dtype``."""
    return (x.float() * per_head(scale)).to(dtype)


def kv_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_kv_head: bool = False
             ) -> float | torch.Tensor:
    """The scale that maps ``x``'s largest magnitude onto ``dtype``'s largest finite value, amax / fp8 max
    (vLLM's ``calculate_kv_scales`` divides by 200 for K, 100 for V: headroom). ``x``: ``[..., kv_heads,
    head_dim]``; ``per_kv_head``: float32 ``[kv_heads]``, else a float. An all-zero head gets 1.0."""
    amax = x.detach().abs().float().movedim(-2, 0).reshape(x.shape[-2], -1).amax(1)  # [kv_heads]
    amax = amax if per_kv_head else amax.max()[None]
    scale = torch.where(amax > 0, amax / torch.finfo(dtype).max, 1.0)
    return scale if per_kv_head else float(scale[0])
