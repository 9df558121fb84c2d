"""Build it yourself, notebook 10: an fp8 KV cache's scale, its write and its read.

Write the three functions below, then grade them:  python -m pagedlib.grade fp8
(or, in a notebook: ``from pagedlib.grade import grade; grade("fp8")``).

The cache stores ``x / scale``, saturated to the format's finite range and rounded to one byte; attention
reads the byte back as float32 and multiplies by the same ``scale``. One scale per tensor (vLLM's default).
Both formats are graded: ``torch.float8_e4m3fn`` (e4m3: largest finite value 448, no infinities) and
``torch.float8_e5m2`` (e5m2: 57344, with infinities). ``torch.finfo(dtype).max`` is the largest finite value.
Round with torch's cast, ``.to(dtype)`` (round to nearest even): the lesson is the scale and the clamp.
torch 2.13's cast saturates e4m3 by itself (earlier versions gave NaN from 480 up), but sends e5m2 to inf from
61440 up (half a step past 57344): clamp first, and rely on no version's cast.

Checked, against pagedlib's ``kv_scale``, ``quantize`` and ``dequantize`` bit for bit, on float32 vectors of
1 to 8 values (each 0 or of magnitude 2**-140 to 2**100, about 7e-43 to 1e30): the scale (compared as
float32), an all-zero tensor, the bytes quantize stores (compared as uint8), values beyond the range
saturating (infinities included), the float32 values dequantize reads (compared bit for bit), and a round
trip within half a step of the format.
"""

import torch


def kv_scale(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    """The scale that maps ``x``'s largest magnitude onto ``dtype``'s largest finite value: ``max |x|``
    divided by ``torch.finfo(dtype).max``, as a Python float (the grader compares it as float32), and never
    below float32's smallest normal number, ``torch.finfo(torch.float32).tiny`` (a tiny ``x`` would give a
    subnormal scale, or 0, and dividing by it would not do). An all-zero ``x`` gets 1.0 (there is nothing
    to scale). ``x``: float32, any shape, not empty, finite."""
    raise NotImplementedError


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """``x`` (float32, any shape) as ``dtype``, same shape: ``x / scale`` (a division, not a product with
    ``1 / scale``: the bytes are compared), clamped to ``[-finfo(dtype).max, finfo(dtype).max]`` (so an
    infinity, too, is stored as the largest finite value), then cast to ``dtype``. ``scale`` > 0."""
    raise NotImplementedError


def dequantize(q: torch.Tensor, scale: float) -> torch.Tensor:
    """What the fp8 tensor ``q`` stands for: its values as float32, times ``scale`` (the one ``q`` was
    quantized with); a float32 tensor of ``q``'s shape."""
    raise NotImplementedError
