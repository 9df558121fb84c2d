"""Task ``fp8`` (notebook 10): an fp8 scale from a tensor's largest magnitude, and the write and read of an
fp8 cache: divide by the scale, saturate to the format's finite range, round; multiply back.

Every answer is compared with pagedlib's (``calibration.kv_scale``, ``core.fp8.quantize`` and
``dequantize``) bit for bit: fp8 bytes as ``uint8``, float32 results as ``int32``. Both formats are
graded: torch 2.13's cast saturates e4m3 by itself, so only e5m2 (which has infinities) shows a missing
clamp.
"""

from __future__ import annotations

import math

import torch
from hypothesis import example, given
from hypothesis import strategies as st

from pagedlib.calibration import kv_scale, rounding_bound
from pagedlib.core.fp8 import FP8_DTYPES, dequantize, quantize
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal

E4M3, E5M2 = FP8_DTYPES
formats = st.sampled_from([E4M3, E5M2])
magnitudes = st.floats(2.0**-140, 2.0**100, width=32)      # about 7e-43 (a subnormal) to 1e30
values = st.one_of(st.just(0.0), magnitudes, magnitudes.map(lambda v: -v), st.floats(-600, 600, width=32))
vectors = st.lists(values, min_size=1, max_size=8)
# the bytes of each format that are not NaN (e4m3: all but 0x7F and 0xFF; e5m2 keeps its infinities)
CODES = {d: [c for c in range(256) if not torch.tensor([c], dtype=torch.uint8).view(d).float().isnan()]
         for d in FP8_DTYPES}


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor(x: list[float]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def scale_of(x: list[float], dtype: torch.dtype) -> float:
    """pagedlib's scale for ``x`` (one per tensor)."""
    return kv_scale(tensor(x)[None], dtype)


def float32(value) -> float:
    """A scale as the cache keeps it: the nearest float32."""
    return float(torch.as_tensor(value).float())


def same_bits(what: str, expected: torch.Tensor, got, case: dict) -> None:
    """``Failed`` unless ``got`` is a tensor of ``expected``'s dtype and shape holding the same bits."""
    if not isinstance(got, torch.Tensor):
        raise Failed(f"{what}: not a tensor", expected=f"a {name(expected.dtype)} tensor", got=got, case=case)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        raise Failed(f"{what}: the dtype or shape", expected=(name(expected.dtype), list(expected.shape)),
                     got=(name(got.dtype), list(got.shape)), case=case)
    bits = torch.uint8 if expected.element_size() == 1 else torch.int32
    if not torch.equal(expected.view(bits), got.detach().cpu().view(bits)):
        wanted, found = expected.float().tolist(), got.float().tolist()
        if wanted == found or any(math.isnan(v) for v in wanted + found):   # -0.0 against 0.0, or a NaN
            wanted, found = expected.view(bits).tolist(), got.view(bits).tolist()
        raise Failed(what, expected=wanted, got=found, case=case)


def scale_from_amax(impl) -> None:
    @cases(150)
    @given(x=vectors, dtype=formats)
    @example(x=[1e-40], dtype=E4M3)           # amax / 448 would be a subnormal scale, or 0: the floor holds
    @example(x=[-1e-37, 0.0], dtype=E5M2)
    def prop(x, dtype):
        got = impl.kv_scale(tensor(x), dtype)
        case = {"x": x, "dtype": name(dtype)}
        expect_equal("the scale, as float32 (amax / the format's largest finite value)", scale_of(x, dtype),
                     float32(got), case)
    prop()


def zero_tensor(impl) -> None:
    for dtype in FP8_DTYPES:
        for shape in ([1], [4], [2, 3]):
            for zero in (0.0, -0.0):
                x = torch.full(shape, zero)
                case = {"x": x.tolist(), "dtype": name(dtype)}
                scale = impl.kv_scale(x.clone(), dtype)
                expect_equal("the scale of an all-zero tensor", 1.0, float32(scale), case)
                same_bits("quantize(x, its scale) of an all-zero tensor", quantize(x, 1.0, dtype),
                          impl.quantize(x.clone(), scale, dtype), case)


def quantize_bytes(impl) -> None:
    @cases(150)
    @given(x=vectors, dtype=formats, up=st.integers(0, 12), frac=st.floats(1, 2))
    def prop(x, dtype, up, frac):
        scale = float32(scale_of(x, dtype) * frac * 2**up)     # >= x's own scale: nothing to saturate
        case = {"x": x, "scale": scale, "dtype": name(dtype)}
        got = impl.quantize(tensor(x), scale, dtype)
        same_bits("the values quantize stores", quantize(tensor(x), scale, dtype), got, case)
    prop()
    quantize_near_ties(impl)


# the halfway points between neighbouring finite values of each format, where rounding decides
MIDPOINTS = {d: [(a + b) / 2 for a, b in zip(v, v[1:])]
             for d in FP8_DTYPES for v in [sorted({abs(c) for c in torch.tensor(CODES[d], dtype=torch.uint8)
                                                   .view(d).float().tolist() if math.isfinite(c)})]}


@st.composite
def near_ties(draw) -> tuple[list[float], float, torch.dtype]:
    """``x`` whose ``x / scale`` lie on or next to the format's halfway points: a float32 that is one step off
    a halfway point must round away from it, not first to a coarser float (float16) that lands on it, and a
    product with ``1 / scale`` rounds differently from the division there."""
    dtype = draw(formats)
    powers = st.integers(-20, 20).map(lambda e: 2.0**e)
    scale = draw(st.one_of(powers, st.floats(2.0**-20, 2.0**20, width=32)))
    halves = draw(st.lists(st.tuples(st.sampled_from(MIDPOINTS[dtype]), st.sampled_from([1.0, -1.0]),
                                     st.sampled_from([0, 1, -1])), min_size=1, max_size=8))
    x = [torch.nextafter(torch.tensor(sign * m * scale), torch.tensor(nudge * math.inf)).item() if nudge
         else float32(sign * m * scale) for m, sign, nudge in halves]
    return x, scale, dtype


def quantize_near_ties(impl) -> None:
    @cases(150)
    @given(case=near_ties())
    @example(case=([1.0625 + 2.0**-20], 1.0, E4M3))            # float16 first rounds it to 1.0625, then to 1
    @example(case=([236.98562622070312], 1.0214897394180298, E4M3))   # x * (1 / scale) rounds to 232
    def prop(case):
        x, scale, dtype = case
        readable = {"x": x, "scale": scale, "dtype": name(dtype)}
        got = impl.quantize(tensor(x), scale, dtype)
        same_bits("the values quantize stores, where x / scale is at or next to a halfway point of the "
                  "format", quantize(tensor(x), scale, dtype), got, readable)
    prop()


def saturates(impl) -> None:
    @cases(150)
    @given(x=vectors.filter(any), dtype=formats, down=st.floats(1.5, 1e6),
           infinities=st.lists(st.sampled_from([math.inf, -math.inf]), max_size=2))
    def prop(x, dtype, down, infinities):
        x = x + infinities
        scale = float32(scale_of([v for v in x if math.isfinite(v)], dtype) / down)   # x / scale overflows
        case = {"x": x, "scale": scale, "dtype": name(dtype)}
        got = impl.quantize(tensor(x), scale, dtype)
        top = torch.finfo(dtype).max
        same_bits(f"the values quantize stores (|x| / scale beyond {top:g} must be stored as {top:g}, "
                  "never inf or NaN)", quantize(tensor(x), scale, dtype), got, case)
    prop()


def dequantize_floats(impl) -> None:
    @cases(150)
    @given(data=formats.flatmap(lambda d: st.tuples(st.just(d), st.lists(st.sampled_from(CODES[d]),
                                                                           min_size=1, max_size=8))),
           scale=st.floats(2.0**-64, 2.0**64, width=32))
    def prop(data, scale):
        dtype, codes = data
        q = torch.tensor(codes, dtype=torch.uint8).view(dtype)
        case = {"q": q.float().tolist(), "dtype": name(dtype), "scale": scale}
        got = impl.dequantize(q.clone(), scale)
        same_bits("the float32 values dequantize reads", dequantize(q, scale), got, case)
    prop()


def round_trip(impl) -> None:
    @cases(150)
    @given(x=vectors, dtype=formats)
    def prop(x, dtype):
        scale = impl.kv_scale(tensor(x), dtype)
        back = impl.dequantize(impl.quantize(tensor(x), scale, dtype), scale)
        case = {"x": x, "dtype": name(dtype)}
        if not isinstance(back, torch.Tensor) or not back.is_floating_point() or list(back.shape) != [len(x)]:
            raise Failed("dequantize(quantize(x, scale), scale) is not a float tensor of x's shape",
                         expected=f"a float tensor of shape [{len(x)}]", got=back, case=case)
        fi = torch.finfo(dtype)
        below = fi.smallest_normal * fi.eps / 2 * scale_of(x, dtype)    # half a subnormal step, scaled
        for i, (v, w) in enumerate(zip(x, back.double().tolist())):
            bound = max(rounding_bound(dtype) * abs(v), below) * (1 + 1e-5)
            if not abs(w - v) <= bound:
                raise Failed(f"x[{i}] = {v!r} came back as {w!r}: off by more than half a step of "
                             f"{name(dtype)}", expected=f"|error| <= {bound:.6g}", got=abs(w - v), case=case)
    prop()


TASK = Task("fp8", "10", "fp8.py", "An fp8 cache's scale, its write (divide, saturate, round) and its read", (
    Check("the scale maps the largest magnitude onto the format's largest finite value (448 for e4m3)",
          scale_from_amax, "notebook 10, section 2 (Why a scale): kv_scale"),
    Check("an all-zero tensor gets scale 1.0, never a division by zero", zero_tensor,
          "notebook 10, section 2 (Why a scale): kv_scale gives an all-zero head 1.0"),
    Check("quantize divides by the scale and rounds to the format: the same bytes as pagedlib's",
          quantize_bytes,
          "notebook 10, section 2 (Why a scale): quantize"),
    Check("values beyond the format's range saturate to its largest finite value (never inf or NaN)",
          saturates,
          "notebook 10, section 2 (Why a scale): quantize clamps before it casts"),
    Check("dequantize multiplies by the same scale: the same float32 values as pagedlib's", dequantize_floats,
          "notebook 10, section 4 (The kernel change): load, to float32, times the scale"),
    Check("a round trip with one scale comes back within half a step of the format", round_trip,
          "notebook 10, section 1 (Two formats in one byte): rounding is off by at most half of eps"),
))
