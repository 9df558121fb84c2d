"""Catches: quantize divides by the scale and rounds to the format: the same bytes as pagedlib's

Multiplies by the scale on the way in and divides on the way out: the scale upside down on both sides."""

import torch


def kv_scale(x, dtype=torch.float8_e4m3fn):
    amax = x.abs().max().item()
    if amax == 0:
        return 1.0
    return amax / torch.finfo(dtype).max


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    top = torch.finfo(dtype).max
    return (x * scale).clamp(-top, top).to(dtype)


def dequantize(q, scale):
    return q.float() / scale
