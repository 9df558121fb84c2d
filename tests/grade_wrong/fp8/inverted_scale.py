"""Catches: the scale maps the largest magnitude onto the format's largest finite value (448 for e4m3)

Inverts the scale: the format's largest value over max |x|, which quantize then divides by."""

import torch


def kv_scale(x, dtype=torch.float8_e4m3fn):
    amax = x.abs().max().item()
    if amax == 0:
        return 1.0
    return torch.finfo(dtype).max / amax


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    top = torch.finfo(dtype).max
    return (x / scale).clamp(-top, top).to(dtype)


def dequantize(q, scale):
    return q.float() * scale
