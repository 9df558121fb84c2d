"""FP8 K/V (notebook 10): the cache stores ``x / scale`` saturated to the format's finite range and cast to
one byte; attention reads ``stored.float() * scale``. A scale is a float (per tensor, vLLM's default) or a
float32 tensor ``[kv_heads]`` (one per KV head). ``check_scale`` is the one check of a scale: the cache,
the kernels and the functions here all take a scale through it."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def per_head(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A checked scale as it broadcasts over ``[..., kv_heads, head_dim]``: a float as it is, a
    ``[kv_heads]`` tensor as ``[kv_heads, 1]``."""
    if isinstance(scale, torch.Tensor):
        return scale[:, None]
    return scale


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., kv_heads, head_dim]`` as ``dtype``: divided by ``scale``, clamped to the finite range
    (torch's cast gives e5m2 an inf beyond it), rounded to nearest. NaN stays NaN."""
    scale = _check_input(x, scale, dtype)
    top = torch.finfo(dtype).max
    return (x.float() / per_head(scale)).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """What an fp8 ``x`` ``[..., kv_heads, head_dim]`` stands for: ``x.float() * scale``, as ``dtype``."""
    scale = _check_input(x, scale)
    return (x.float() * per_head(scale)).to(dtype)


def kv_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_kv_head: bool = False
             ) -> float | torch.Tensor:
    """The scale that maps ``x``'s largest magnitude onto ``dtype``'s largest finite value, amax / fp8 max
    (vLLM's ``calculate_kv_scales`` divides by 200 for K, 100 for V: headroom). ``x``: ``[..., kv_heads,
    head_dim]``, finite; ``per_kv_head``: float32 ``[kv_heads]``, else a float. An all-zero head gets 1.0."""
    _check_calibration(x, dtype, per_kv_head)
    heads = x.detach().abs().float().movedim(-2, 0).reshape(x.shape[-2], -1)  # [kv_heads, all the rest]
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


def check_scale(name: str, scale: object, kv_heads: int | None = None,
                device: torch.device | str | None = None) -> float | torch.Tensor:
    """``scale`` as the functions here take it: a float from ``None`` (1.0), a number, a numpy scalar, a
    0-d tensor or array; a float32 ``[kv_heads]`` tensor on ``device`` from a 1-D tensor or array. Every
    value must be finite and > 0; a bool is refused (not taken as 1.0). ``ValueError`` naming ``name``."""
    if scale is None:
        return 1.0
    if isinstance(scale, float) and 0 < scale < math.inf:  # the common case: no tensor made
        return scale
    values = _scale_values(name, scale, kv_heads)            # a checked tensor, [] or [kv_heads]
    if values.dim() == 0:
        return float(values)
    return values.to(device=device, dtype=torch.float32, copy=True)  # its own: the caller may change theirs


def check_scales(k_scale: object, v_scale: object, dtype: torch.dtype, kv_heads: int,
                 device: torch.device | str) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """A cache's ``(k_scale, v_scale)`` as ``check_scale`` returns them; a cache not in fp8 takes none."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and dtype not in FP8_DTYPES:
            raise ValueError(f"{name} needs a float8 dtype, got dtype {dtype}")
    k_scale = check_scale("k_scale", k_scale, kv_heads, device)
    v_scale = check_scale("v_scale", v_scale, kv_heads, device)
    return k_scale, v_scale


def _scale_values(name: str, scale: object, kv_heads: int | None) -> torch.Tensor:
    """The values of a scale as a tensor (0-d or ``[kv_heads]``, where they were), each finite and > 0."""
    heads = "kv_heads"
    if kv_heads is not None:
        heads = f"kv_heads={kv_heads}"
    must = f"{name} must be None, a finite number > 0 or a tensor of {heads} of them"
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor, np.ndarray)):
        raise ValueError(f"{must}, got {scale!r} ({type(scale).__name__})")
    try:
        values = torch.as_tensor(scale).detach()
    except (TypeError, RuntimeError):  # a numpy array of objects or strings
        raise ValueError(f"{must}, got {scale!r}") from None
    if values.dtype == torch.bool or values.is_complex() or values.dim() > 1:
        raise ValueError(f"{must}, got a {values.dtype} tensor of shape {list(values.shape)}")
    if values.dim() == 1 and len(values) == 0:
        raise ValueError(f"{must}, got an empty tensor")
    if values.dim() == 1 and kv_heads is not None and len(values) != kv_heads:
        raise ValueError(f"{must}, got a tensor of shape {list(values.shape)}")
    smallest, largest = torch.aminmax(values)  # one pass (NaN propagates into both, then fails both tests)
    if not (float(smallest) > 0 and float(largest) < math.inf):
        raise ValueError(f"{must}, got {scale!r}")
    return values


def _check_input(x: object, scale: object, dtype: torch.dtype | None = None) -> float | torch.Tensor:
    """``quantize``'s and ``dequantize``'s arguments: ``x`` a tensor, ``dtype`` (if given) an fp8 format,
    ``scale`` checked (a per-head one must match ``x``'s ``kv_heads``; it is moved to ``x``'s device)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor [..., kv_heads, head_dim], got {type(x).__name__}")
    if dtype is not None and dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    if x.dim() >= 2:
        return check_scale("scale", scale, x.shape[-2], x.device)
    scale = check_scale("scale", scale, None, x.device)
    if isinstance(scale, torch.Tensor):
        raise ValueError(f"a per-head scale needs x of shape [..., kv_heads, head_dim], got {list(x.shape)}")
    return scale


def _check_calibration(x: object, dtype: object, per_kv_head: object) -> None:
    """``kv_scale``'s arguments: a non-empty floating tensor ``[..., kv_heads, head_dim]``, an fp8 format."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2 or x.numel() == 0:
        got = type(x).__name__
        if isinstance(x, torch.Tensor):
            got = f"{x.dtype} {list(x.shape)}"
        raise ValueError(f"x must be a non-empty floating tensor [..., kv_heads, head_dim], got {got}")
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    if not isinstance(per_kv_head, bool):
        raise ValueError(f"per_kv_head must be a bool, got {per_kv_head!r}")
