"""FP8 K/V (notebook 10): the cache stores ``x / scale`` saturated to the format's finite range and cast to
one byte; attention reads ``stored.float() * scale``. A scale is a float (per tensor, vLLM's default) or a
float32 tensor ``[kv_heads]`` (one per KV head). ``check_scale`` (in ``core/_checks.py``, exported
here) is the one check of a scale: the cache, the kernels and the functions here all take a scale
through it."""

from __future__ import annotations

import torch

# the checks live with the cache's (core/_checks.py); the kernels take a scale through check_scale too
from pagedlib.core._checks import FP8_DTYPES, check_calibration, check_fp8_input, check_scale, check_scales

__all__ = ["FP8_DTYPES", "check_scale", "check_scales", "dequantize", "kv_scale", "per_head",
           "quantize"]


def per_head(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A checked scale as it broadcasts over ``[..., kv_heads, head_dim]``: a float as it is, a
    ``[kv_heads]`` tensor as ``[kv_heads, 1]``."""
    if isinstance(scale, torch.Tensor):
        return scale[:, None]
    return scale


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., kv_heads, head_dim]`` as ``dtype``: divided by ``scale``, clamped to the finite range
    (torch's cast gives e5m2 an inf beyond it), rounded to nearest. NaN stays NaN."""
    scale = check_fp8_input(x, scale, dtype)
    top = torch.finfo(dtype).max
    return (x.float() / per_head(scale)).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """What an fp8 ``x`` ``[..., kv_heads, head_dim]`` stands for: ``x.float() * scale``, as ``dtype``."""
    scale = check_fp8_input(x, scale)
    return (x.float() * per_head(scale)).to(dtype)


def kv_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_kv_head: bool = False
             ) -> float | torch.Tensor:
    """The scale that maps ``x``'s largest magnitude onto ``dtype``'s largest finite value, amax / fp8 max
    (vLLM's ``calculate_kv_scales`` divides by 200 for K, 100 for V: headroom). ``x``: ``[..., kv_heads,
    head_dim]``, finite; ``per_kv_head``: float32 ``[kv_heads]``, else a float. An all-zero head gets 1.0."""
    check_calibration(x, dtype, per_kv_head)
    # [kv_heads, all the rest]
    heads = x.detach().abs().float().movedim(-2, 0).flatten(1)
    amax = heads.amax(1)                                                       # [kv_heads]
    if not per_kv_head:
        amax = amax.max()[None]                                                # [1]
    if not bool(amax.isfinite().all()):  # amax carries any NaN or inf of x through
        raise ValueError("x must hold finite values to set a scale from, got NaN or inf in it")
    # a positive amax so small that amax / top rounds to 0 still needs a scale > 0
    scale = (amax / torch.finfo(dtype).max).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.where(amax > 0, scale, 1.0)
    if per_kv_head:
        return scale
    return float(scale[0])
