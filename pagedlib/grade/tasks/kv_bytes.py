"""Task ``kv_bytes`` (notebook 01): what one token's K and V cost, and what a paged cache holds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal
from pagedlib.teach.sizing import PRESETS, ModelSpec, blocks_needed, kv_bytes_per_token

sizes = st.integers(1, 256)


def exactly(what: str, expected: int, got, case: dict) -> None:
    """``got`` is the int ``expected``: a float equal to it fails too (a count of bytes is an int, and a
    float past 2**53 rounds)."""
    if isinstance(got, float):
        raise Failed(f"{what}: an int, not a float", expected=expected, got=got, case=case)
    expect_equal(what, expected, got, case)


def per_token(impl) -> None:
    @cases(200)
    @given(layers=sizes, kv_heads=sizes, group=st.integers(1, 8), head_dim=sizes,
           dtype_bytes=st.sampled_from([1, 2, 4]))
    def prop(layers, kv_heads, group, head_dim, dtype_bytes):
        spec = ModelSpec("case", layers, kv_heads, head_dim, kv_heads * group)
        case = dict(num_layers=layers, num_q_heads=kv_heads * group, num_kv_heads=kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes)
        expected = kv_bytes_per_token(spec, dtype_bytes)
        exactly("bytes per token", expected, impl.kv_bytes_per_token(**case), case)
    prop()


def presets(impl) -> None:
    for spec in PRESETS.values():
        case = dict(num_layers=spec.num_layers, num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, dtype_bytes=2)
        exactly(f"{spec.name} in bf16, bytes per token", kv_bytes_per_token(spec, 2),
                impl.kv_bytes_per_token(**case), case)


def whole_blocks(impl) -> None:
    @cases(300)
    @given(lens=st.lists(st.integers(0, 2**62), max_size=6), block_size=st.integers(1, 1024),
           per_token=st.integers(1, 2**20))
    def prop(lens, block_size, per_token):
        expected = sum(blocks_needed(n, block_size) for n in lens) * block_size * per_token
        case = dict(seq_lens=lens, block_size=block_size, bytes_per_token=per_token)
        exactly("bytes a paged cache holds", expected, impl.paged_kv_bytes(**case), case)
    prop()


TASK = Task("kv_bytes", "01", "kv_bytes.py", "KV bytes per token, and the whole blocks a paged cache holds", (
    Check("a token costs K and V in every layer, for every KV head (never the query heads)", per_token,
          "notebook 01, section 1 (A KV cache is a stack of tensors)"),
    Check("the six models of notebook 01 cost what its table says", presets,
          "notebook 01, section 1 (A KV cache is a stack of tensors): its table of models"),
    Check("a paged cache holds whole blocks, and a sequence of 0 tokens none, exactly (no floats)",
          whole_blocks,
          "notebook 01, section 2 (Paging: hold whole blocks, only as many as needed)"),
))
