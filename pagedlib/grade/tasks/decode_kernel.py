"""Task ``decode_kernel`` (notebook 05): the fused Triton decode kernel's body, an online softmax over tiles
of keys read through the block table. It runs in Triton's interpreter on a short list of seeded cases,
smallest first (the interpreter is slow), held to pagedlib's float64 oracle, with every load and store
checked against the tensors the kernel was given (``pagedlib.grade.bounds``)."""

from __future__ import annotations

import numpy as np
import torch

from pagedlib.grade import bounds
from pagedlib.grade.framework import Check, Failed, Task
from pagedlib.grade.paged_inputs import Case, build, check_heads, compare, head_probe, rising_scores

ORACLE = [Case((1,), 1, 1, 1, 16, seed=1), Case((5,), 4, 1, 2, 16, seed=2), Case((3, 17), 4, 2, 1, 8, seed=3),
          Case((20, 9), 8, 1, 8, 24, seed=4),                                  # MQA; head_dim 24 pads to 32
          Case((33, 1), 16, 2, 3, 16, scale=0.3, layers=2, seed=5)]            # group 3; a strided K, V apart
RAGGED = [Case((5,), 4, 1, 1, 16, seed=7), Case((17,), 16, 1, 2, 16, seed=8),
          Case((2, 35), 8, 2, 1, 16, seed=9)]
GARBAGE = [Case((3,), 4, 1, 2, 16, garbage="nan", seed=10),
           Case((6, 19), 4, 2, 2, 16, garbage="nan", table_garbage=True, seed=11),
           Case((13,), 8, 1, 4, 16, garbage="1e4", table_garbage=True, seed=12)]
RISING = [Case((40,), 16, 1, 1, 16, seed=13), Case((300,), 16, 1, 2, 16, seed=14)]   # 300: 3 tiles of 128
# (case, first score, last score): falling from 300 (a max that follows each tile down overflows), and all
# scores far below 0 (a max that starts at 0 underflows every exp to 0: 0 / 0)
RAMPS = [(Case((300,), 16, 1, 2, 16, seed=14), 300.0, 0.0),
         (Case((40,), 16, 1, 1, 16, seed=13), -400.0, -300.0)]
EDGES = [Case((1,), 1, 1, 1, 8, exact_width=True, last_block_at_end=True, seed=15),
         Case((3, 8), 4, 2, 3, 24, exact_width=True, last_block_at_end=True, seed=16)]
# float32 logits of a few hundred are themselves off by ~1e-5 (an ulp of 300 is 3e-5): pagedlib's kernel
# misses the float32 tolerance there by that much; an overflow gives NaN or inf, far outside this
LOOSE = {"atol": 1e-3, "rtol": 1e-3}
SECONDS = 90.0          # the interpreter runs a kernel 10^4-10^5 times slower than a GPU


def launch(impl, case: Case, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The reader's ``decode_attention`` on ``args``, every load and store watched. What the kernel raised
    comes out unwrapped from the interpreter's ``InterpreterError`` (so ``NotImplementedError`` is a todo and
    an error names the kernel's line); a stray access is a ``Failed`` naming ``case``."""
    from pagedlib.kernels.triton_mode import interpreting

    if not interpreting():
        raise RuntimeError("this grader runs kernels in Triton's interpreter: set TRITON_INTERPRET=1 before "
                           "triton is imported (pagedlib does it on a machine without CUDA)")
    extra = {} if case.scale is None else {"scale": case.scale}
    try:
        with bounds.watch(), np.errstate(all="ignore"):       # an overflow shows in the output anyway
            return impl.decode_attention(*args, **extra)
    except Exception as error:
        inner = error
        while type(inner).__name__ == "InterpreterError" and inner.__cause__ is not None:
            inner = inner.__cause__
        if isinstance(inner, bounds.OutOfBounds):
            raise Failed(str(inner), case=case.shown()) from None
        raise inner from None


def each(cases: list[Case], what: str, make=build, tol: dict | None = None):
    """A check: the reader's output on each case in turn, held to the oracle (``make`` builds the inputs)."""
    def run(impl) -> None:
        for case in cases:
            args = make(case)
            compare(what, lambda case=case, args=args: launch(impl, case, args), args, case, tol)
    return run


def rising(top: float, what: str, tol: dict | None = None):
    return each(RISING, what, lambda case: rising_scores(case, top), tol)


def ramps(impl) -> None:
    for case, first, last in RAMPS:
        args = rising_scores(case, last, first)
        compare(f"with scores from {first:g} to {last:g}, the output", lambda case=case, args=args: launch(
            impl, case, args), args, case, LOOSE)


def v_apart(case: Case) -> tuple[torch.Tensor, ...]:
    """``build(case)``, with V laid out apart from K when the case's cache is a strided view: K keeps the
    view, V is a contiguous copy, so V's strides differ from K's."""
    q, k_cache, v_cache, tables, seq_lens = build(case)
    return q, k_cache, v_cache.contiguous() if case.layers > 1 else v_cache, tables, seq_lens


def heads(impl) -> None:
    for kv_heads, group in [(2, 2), (4, 4)]:
        for read in ("values", "keys"):
            args = head_probe(kv_heads, group, 16, read)
            case = Case((kv_heads,), kv_heads, kv_heads, group, 16)
            check_heads(launch(impl, case, args), kv_heads, group, read)


def in_bounds(impl) -> None:
    for case in EDGES:
        launch(impl, case, build(case))


HINT = "notebook 05, section 3 (The kernel, block by block)"
TASK = Task("decode_kernel", "05", "decode_kernel.py",
            "the Triton decode kernel: an online softmax over the block table's tiles", (
    Check("equals the float64 oracle on a few cases, smallest first (GQA groups 1-8, MQA, a strided cache)",
          each(ORACLE, "the output", v_apart),
          "notebook 05, section 4 (Run it: the interpreter against notebook 04's path)", SECONDS),
    Check("query head h reads KV head h // group (query head 13 of 16 reads KV head 3 of 4)", heads,
          HINT + ": 3.2, the GQA group", SECONDS),
    Check("every token counts when the length is not a multiple of the block size or the tile",
          each(RAGGED, "with a ragged last block and tile, the output"), HINT + ": 3.3, the table walk",
          SECONDS),
    Check("garbage past each length never changes the result (NaN, 1e4, table entries naming garbage blocks)",
          each(GARBAGE, "with garbage past the lengths, the output"), HINT + ": 3.4, masking", SECONDS),
    Check("when a later tile raises the max, the running sum and accumulator are rescaled",
          rising(30.0, "with scores rising tile after tile, the output"),
          "notebook 05, section 2 (Online softmax: attention one tile at a time)", SECONDS),
    Check("scores in the hundreds do not overflow (the running max is subtracted before exp)",
          rising(300.0, "with scores up to 300, the output", LOOSE),
          "notebook 05, section 2 (Online softmax: attention one tile at a time)", SECONDS),
    Check("the running max starts at -inf and only rises: scores falling from 300, or all far below 0",
          ramps, "notebook 05, section 2 (Online softmax: attention one tile at a time)", SECONDS),
    Check("every load and store stays inside its tensor", in_bounds, HINT + ": 3.4, masking", SECONDS),
))
