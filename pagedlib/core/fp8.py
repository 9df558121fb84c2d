"""FP8 K/V (notebook 10): the cache stores ``x / scale`` saturated to the format's finite range and cast to
one byte; attention reads ``stored.float() * scale``. A scale is a float (per tensor, vLLM's default) or a
float32 tensor ``[kv_heads]`` (one per KV head). ``check_scale`` (in ``core/_checks.py``, exported
here) is the one check of a scale: the cache, the kernels and the functions here all take a scale
through it."""

from __future__ import annotations

import torch

# the checks live with the cache's (core/_checks.py); the kernels take a scale through check_scale too
from pagedlib.core._checks import FP8_DTYPES, check_fp8_input, check_scale, check_scales

__all__ = ["FP8_DTYPES", "check_scale", "check_scales", "dequantize", "per_head",
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


