"""Task ``paged_attention`` (notebook 04): one decode step of attention through block tables, GQA included,
held to pagedlib's float64 oracle (``paged_attention_oracle``) on generated batches."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from pagedlib.grade.framework import Check, Task, cases
from pagedlib.grade.paged_inputs import DTYPES, Case, build, check_heads, compare, head_probe


@st.composite
def lengths(draw, block_size: int, first: int | None = None) -> list[int]:
    """1-4 context lengths, most at a block boundary or one token either side of one; ``first``: put that
    length in, at a drawn place."""
    def one() -> int:
        blocks = draw(st.integers(0, 4))
        offset = draw(st.sampled_from([0, 1, -1]) | st.integers(-block_size + 1, block_size - 1))
        return max(1, blocks * block_size + offset)
    lens = [one() for _ in range(draw(st.integers(1, 4)))]
    if first is not None:
        lens.insert(draw(st.integers(0, len(lens))), first)
    return lens


@st.composite
def batches(draw, garbage: bool = False, scale: bool = False, length_one: bool = False) -> Case:
    """A ``Case``: block sizes 1-32, GQA groups 1, 2, 4, 8 (MQA when ``kv_heads`` is 1), three dtypes,
    contiguous caches or a strided layer view; ``garbage``: NaN or 1e4 in every unused slot, and maybe
    unused table entries naming free blocks; ``scale``: a given scale or None; ``length_one``: a sequence
    of one token among the batch."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 32]))
    return Case(tuple(draw(lengths(block_size, 1 if length_one else None))), block_size,
                kv_heads=draw(st.integers(1, 4)), group=draw(st.sampled_from([1, 2, 4, 8])),
                head_dim=draw(st.sampled_from([2, 8, 16, 80])), dtype=draw(st.sampled_from(list(DTYPES))),
                scale=draw(st.none() | st.floats(0.01, 4.0).map(lambda x: round(x, 3))) if scale else None,
                seed=draw(st.integers(0, 2**16)), layers=draw(st.integers(1, 2)),
                garbage=draw(st.sampled_from(["nan", "1e4"])) if garbage else None,
                table_garbage=draw(st.booleans()) if garbage else False)


def attend(impl, case: Case, what: str) -> None:
    """Run the reader's ``paged_attention`` on ``case`` (``scale`` given only when the case has one) and
    hold it to the oracle."""
    args = build(case)
    extra = {} if case.scale is None else {"scale": case.scale}
    compare(what, lambda: impl.paged_attention(*args, **extra), args, case)


def matches_oracle(impl) -> None:
    @cases(60)
    @given(case=batches())
    @example(case=Case((5,), 4, kv_heads=1, group=8, head_dim=8))                   # MQA
    @example(case=Case((3, 9), 4, kv_heads=2, group=4, head_dim=8, layers=2))       # a strided view
    def prop(case):
        attend(impl, case, "the output")
    prop()


def heads(impl) -> None:
    @cases(40)
    @given(kv_heads=st.integers(1, 8), group=st.sampled_from([1, 2, 3, 4, 8]),
           head_dim=st.sampled_from([1, 4, 16]), read=st.sampled_from(["values", "keys"]))
    @example(kv_heads=4, group=4, head_dim=16, read="values")
    @example(kv_heads=4, group=4, head_dim=16, read="keys")
    def prop(kv_heads, group, head_dim, read):
        check_heads(impl.paged_attention(*head_probe(kv_heads, group, head_dim, read)), kv_heads, group, read)
    prop()


def garbage(impl) -> None:
    @cases(60)
    @given(case=batches(garbage=True))
    @example(case=Case((3, 8), 4, kv_heads=2, group=2, head_dim=8, garbage="nan", table_garbage=True))
    def prop(case):
        attend(impl, case, "with garbage past the lengths, the output")
    prop()


def length_one(impl) -> None:
    @cases(30)
    @given(case=batches(length_one=True))
    @example(case=Case((1,), 1, kv_heads=1, group=1, head_dim=8))
    @example(case=Case((1,), 16, kv_heads=2, group=2, head_dim=8))
    def prop(case):
        attend(impl, case, "with a sequence of one token, the output")
    prop()


def scale(impl) -> None:
    @cases(40)
    @given(case=batches(scale=True))
    @example(case=Case((9,), 4, kv_heads=1, group=2, head_dim=16, scale=1.0))
    def prop(case):
        attend(impl, case, f"with scale={case.scale}, the output")
    prop()


HINT = "notebook 04, section 2 (Gather whole blocks, then mask)"
TASK = Task("paged_attention", "04", "paged_attention.py",
            "decode attention through a block table, GQA included, in torch", (
    Check("equals the float64 oracle (block sizes 1-32, lengths at block boundaries, GQA 1-8, MQA, 3 dtypes)",
          matches_oracle, "notebook 04, section 3 (Equivalence, numerically)"),
    Check("query head h reads KV head h // group (query head 13 of 16 reads KV head 3 of 4)", heads,
          HINT + ": step 3, grouped heads"),
    Check("garbage past each length never changes the result (NaN, 1e4, table entries naming garbage blocks)",
          garbage, HINT + ": why masking the scores is not enough"),
    Check("a sequence of one token attends to that token", length_one,
          "notebook 04, section 1 (The gather loop: attention the obvious way)"),
    Check("the softmax scale is honoured: a given scale is used, and None means head_dim ** -0.5", scale,
          "notebook 04, section 1 (The gather loop: attention the obvious way): step 3"),
))
