"""Choosing an fp8 cache's scales from data (notebook 10): the largest magnitude of sample K or V mapped
onto the format's largest finite value; and the relative rounding error that remains whatever the scale.
It is offline work before serving, like vLLM's scale calibration: nothing on a request's path through the
engine calls it (the engine's fp8 cache runs with scale 1.0, vLLM's default)."""

from __future__ import annotations

import torch

from pagedlib.checks import check_calibration
from pagedlib.core.fp8 import FP8_DTYPES


def kv_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_kv_head: bool = False
             ) -> float | torch.Tensor:
    """The scale that maps ``x``'s largest magnitude onto ``dtype``'s largest finite value, amax / fp8 max
    (vLLM's ``calculate_kv_scales`` divides by 200 for K, 100 for V: headroom). ``x``: ``[..., kv_heads,
    head_dim]``, finite; ``per_kv_head``: float32 ``[kv_heads]``, else a float. An all-zero head gets 1.0."""
    check_calibration(x, dtype, per_kv_head)
    # [kv_heads, all the rest]
    heads = x.detach().abs().double().movedim(-2, 0).flatten(1)  # float64: a float64 x's range survives
    amax = heads.amax(1)                                                       # [kv_heads]
    if not per_kv_head:
        amax = amax.max()[None]                                                # [1]
    if not bool(amax.isfinite().all()):  # amax carries any NaN or inf of x through
        raise ValueError("x must hold finite values to set a scale from, got NaN or inf in it")
    if bool((amax / torch.finfo(dtype).max > torch.finfo(torch.float32).max).any()):
        raise ValueError(f"x's largest magnitude, {float(amax.max()):.3g}, needs a scale beyond float32's "
                         f"range (the cache keeps float32 scales)")
    amax = amax.float()  # the float32 max of x, as x.float() would give it
    # a positive amax so small that amax / top rounds to 0 still needs a scale > 0
    scale = (amax / torch.finfo(dtype).max).clamp_min(torch.finfo(torch.float32).tiny)
    scale = torch.where(amax > 0, scale, 1.0)
    if per_kv_head:
        return scale
    return float(scale[0])


def rounding_bound(dtype: torch.dtype) -> float:
    """A bound on the relative error of rounding to nearest in the fp8 ``dtype``: ``|dequantize(quantize(x))
    - x| <= bound * |x|`` wherever ``|x| / scale`` lies between the format's smallest normal and largest
    finite value. It is half the gap between 1 and the next value, ``finfo(dtype).eps / 2 = 2 ** -(mantissa
    bits + 1)`` (e4m3: 0.0625, e5m2: 0.125); the worst case, a value half a step above a power of two, comes
    to ``bound / (1 + bound)``. A scale moves the range, not the spacing, so it leaves the bound as it is;
    below the smallest normal the step is absolute and the relative error grows."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    return torch.finfo(dtype).eps / 2
