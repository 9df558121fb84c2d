"""The notebook-01 memory calculator: numbers from pagedlib.teach.sizing, controls that re-compute."""

from __future__ import annotations

import pytest

from pagedlib.teach.calculator import MemoryCalculator, memory_report
from pagedlib.teach.sizing import PRESETS, contiguous_kv_bytes, paged_kv_bytes, synthetic_seq_lens


def test_default_report_matches_sizing_and_is_deterministic():
    r = memory_report()
    lens = synthetic_seq_lens(256, max_tokens=4096, seed=0)
    spec = PRESETS["llama-3-8b"]
    assert r.contiguous_bytes == contiguous_kv_bytes(spec, 4096, 256) == 128 * 2**30
    assert r.paged_bytes == paged_kv_bytes(spec, lens, 16)
    assert r.paged_bytes < r.contiguous_bytes
    assert r.used_bytes <= r.paged_bytes
    assert r.html() == memory_report().html()
    assert "128 GiB" in r.html()


def test_controls_recompute_the_table():
    calc = MemoryCalculator()
    before = calc.output.value
    assert before == memory_report().html()
    calc.dtype.value = "fp32"
    assert calc.output.value == memory_report(dtype="fp32").html()
    assert "256 GiB" in calc.output.value  # fp32 doubles the reservation
    calc.preset.value = "opt-13b"
    calc.block_size.value = 64
    calc.num_seqs.value = 10
    assert calc.output.value == memory_report("opt-13b", "fp32", 4096, 64, 10).html()


def test_bigger_blocks_waste_more():
    small, big = memory_report(block_size=8), memory_report(block_size=256)
    assert small.paged_bytes < big.paged_bytes
    assert small.table_entries > big.table_entries
    assert small.paged_fit > big.paged_fit


@pytest.mark.parametrize("kwargs, name", [
    ({"preset": "gpt-5"}, "preset"), ({"dtype": "int3"}, "dtype"), ({"num_seqs": 0}, "num_seqs"),
    ({"max_tokens": 10**9, "num_seqs": 64}, "max_tokens"), ({"num_seqs": 5000}, "num_seqs"),
    ({"block_size": 2.0}, "block_size"),
])
def test_bad_settings_raise(kwargs, name):
    with pytest.raises(ValueError, match=name):
        memory_report(**kwargs)  # max_tokens=10**9 once grew a list of requests until memory ran out
    with pytest.raises(ValueError, match=name):
        MemoryCalculator(**kwargs)


def test_calculator_never_clamps_a_setting_silently():
    calc = MemoryCalculator(max_tokens=1_000_000, block_size=48)
    assert calc.max_tokens.value == 1_000_000 and calc.block_size.value == 48
    assert calc.output.value == memory_report(max_tokens=1_000_000, block_size=48).html()
    with pytest.raises(ValueError, match="max_tokens must be <= 1048576, got 2000000"):
        MemoryCalculator(max_tokens=2_000_000)


def test_the_fit_row_explains_itself():
    r = memory_report()
    assert ("requests that fit in 128 GiB, paged vs reserved", f"{r.paged_fit:,} vs 256 "
            f"({r.paged_fit / 256:.1f}x)") in r.rows()


def test_fit_is_not_capped_for_long_reservations():
    # at 128k-token reservations paging fits far more than 64x the requests: the answer must be exact
    from pagedlib.teach.sizing import max_sequences

    r = memory_report(max_tokens=131072, num_seqs=4)
    spec = PRESETS["llama-3-8b"]
    stream = synthetic_seq_lens(r.paged_fit * 2, max_tokens=131072, seed=0)
    assert r.paged_fit == max_sequences(spec, contiguous_kv_bytes(spec, 131072, 4), stream, block_size=16)
    assert r.paged_fit > 64 * 4
    assert "seed 3" in memory_report(seed=3).html()


def test_the_calculator_displays_as_its_widget():
    calc = MemoryCalculator()
    view = calc._repr_mimebundle_()["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == calc.widget.model_id
