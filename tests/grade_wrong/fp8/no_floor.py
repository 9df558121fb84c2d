"""Catches: the scale maps the largest magnitude onto the format's largest finite value (448 for e4m3)

No floor at float32's smallest normal number: a tiny tensor gets a subnormal scale, or 0."""

import torch


def kv_scale(x, dtype=torch.float8_e4m3fn):
    amax = x.abs().max().item()
    return 1.0 if amax == 0 else amax / torch.finfo(dtype).max


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    top = torch.finfo(dtype).max
    return (x / scale).clamp(-top, top).to(dtype)


def dequantize(q, scale):
    return q.float() * scale
