"""Catches: quantize divides by the scale and rounds to the format: the same bytes as pagedlib's

Rounds x / scale to float16 before fp8: a value one float32 step past a halfway point of the format
first lands on that point, then rounds to the even neighbour instead of away from it."""

import torch


def kv_scale(x, dtype=torch.float8_e4m3fn):
    amax = x.abs().max().item()
    if amax == 0:
        return 1.0
    return amax / torch.finfo(dtype).max


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    top = torch.finfo(dtype).max
    return (x / scale).clamp(-top, top).half().to(dtype)


def dequantize(q, scale):
    return q.float() * scale
