"""``pagedlib.grade.bounds``: every load and store of an interpreted kernel is checked against the tensors it
was given, counting only the lanes whose mask is true, and a stray access is refused before it happens."""

from __future__ import annotations

import pytest
import torch

import pagedlib  # noqa: F401  (before triton: without CUDA it selects Triton's interpreter)
from pagedlib.grade import bounds
from pagedlib.kernels.triton_mode import interpreting

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
pytestmark = pytest.mark.skipif(not interpreting(), reason="the bounds check wraps Triton's interpreter")


@triton.jit
def _copy(x_ptr, y_ptr, n, shift, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if MASKED:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs + shift, mask=offs < n), mask=offs < n)
    else:
        tl.store(y_ptr + offs, tl.load(x_ptr + offs + shift))


def stray(x, y, n, shift=0, masked=True) -> str:
    """The ``OutOfBounds`` message of one launch of ``_copy`` (the interpreter wraps it), or ``""``."""
    try:
        with bounds.watch():
            _copy[(1,)](x, y, n, shift, BLOCK=16, MASKED=masked)
    except Exception as error:
        assert isinstance(error.__cause__, bounds.OutOfBounds), error
        return str(error.__cause__)
    return ""


def test_masked_off_lanes_do_not_count():
    x, y = torch.arange(10.0), torch.zeros(10)
    assert stray(x, y, 10) == ""
    assert torch.equal(y, x)


def test_an_unmasked_load_past_the_end_names_the_load_the_tensor_and_how_far():
    said = stray(torch.arange(10.0), torch.zeros(16), 10, masked=False)
    assert said.startswith("a load of program (0, 0, 0) reaches 6 addresses")
    assert "the farthest 6 elements past the end of x_ptr (float32 [10])" in said


def test_an_access_before_the_start_is_caught():
    said = stray(torch.arange(10.0), torch.zeros(10), 10, shift=-2)
    assert "2 elements before the start of x_ptr" in said


def test_a_stray_store_is_refused_before_it_writes():
    pool = torch.zeros(20)
    y = pool[:4]                                    # the kernel is given 4 elements of a larger buffer
    said = stray(torch.arange(10.0), y, 10)
    assert said.startswith("a store") and "6 elements past the end of y_ptr (float32 [4])" in said
    assert not pool.any()                           # nothing was written, not even the 4 in-bounds lanes


def test_an_address_between_the_elements_of_a_view_is_caught():
    y = torch.zeros(20)[::2]                        # 10 elements, every other float of the buffer
    assert "between the elements of y_ptr" in stray(torch.arange(10.0), y, 10)


def test_the_interpreter_is_restored_after_the_block():
    from triton.runtime import interpreter

    before = (interpreter.GridExecutor._init_args_hst, interpreter.interpreter_builder.create_masked_load)
    stray(torch.arange(10.0), torch.zeros(16), 10, masked=False)
    x, y = torch.arange(10.0), torch.zeros(16)
    _copy[(1,)](x, y, 10, 0, BLOCK=16, MASKED=True)  # unwatched: no check
    assert interpreter.GridExecutor._init_args_hst is before[0]
    assert interpreter.interpreter_builder.create_masked_load == before[1]
