"""pagedlib's answer to task ``fp8``: ``calibration.kv_scale`` and ``core.fp8``'s ``quantize`` and
``dequantize`` behind the task's signatures."""

import torch

from pagedlib import calibration
from pagedlib.core import fp8


def kv_scale(x, dtype=torch.float8_e4m3fn):
    return calibration.kv_scale(x.reshape(1, -1), dtype)      # pagedlib's takes [..., kv_heads, head_dim]


def quantize(x, scale, dtype=torch.float8_e4m3fn):
    return fp8.quantize(x, scale, dtype)


def dequantize(q, scale):
    return fp8.dequantize(q, scale)
