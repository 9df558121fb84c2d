import torch


def kv_scale(x, dtype=torch.float8_e4m3fn):
    amax = x.abs().max().item()
    if amax == 0:
        return 1.0
    return max(amax / torch.finfo(dtype).max, torch.finfo(torch.float32).tiny)


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    top = torch.finfo(dtype).max
    return (x / scale).clamp(-top, top).to(dtype)


def dequantize(q, scale):
    return q.float() * scale
