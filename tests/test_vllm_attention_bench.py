"""``bench attention``'s vLLM table: vLLM's fused CPU kernel, timed in a process of its own beside pagedlib's
paths (its own fused CPU kernel among them) on the same pool contents, both fused kernels checked against
the float64 oracle."""

from __future__ import annotations

import json
import os
import sys

import pytest

from pagedlib.bench.__main__ import main
from pagedlib.bench.attention import AttentionConfig, vllm_points, vllm_rows
from pagedlib.vllm.bridge import vllm_available

AVAILABLE, WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not AVAILABLE, reason=WHY)
TINY = ["--batch", "2", "--context", "96", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--block-size", "16", "--no-sweeps", "--repeats", "2"]


@needs_vllm
def test_the_vllm_table_stands_beside_the_others_and_equals_the_oracle(tmp_path, capsys):
    out = tmp_path / "attention.json"
    interpret = os.environ.get("TRITON_INTERPRET")
    assert main(["attention", *TINY, "--vllm-batches", "1,3", "--vllm-contexts", "40,100",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "in vLLM's process" in printed and "vllm-fused" in printed
    result = json.loads(out.read_text())
    rows = result["vllm"]
    points = {(r["batch"], r["context"]) for r in rows}
    assert points == {(1, 40), (1, 100), (3, 40), (3, 100)}
    for point in points:
        impls = [r["impl"] for r in rows if (r["batch"], r["context"]) == point]
        assert impls == ["vllm-fused", "pagedlib-fused", "paged", "contiguous", "copy"]
    fused = [r for r in rows if r["impl"] in ("vllm-fused", "pagedlib-fused")]
    assert len(fused) == 8 and all(r["same_output"] and r["max_abs_error"] < 1e-5 for r in fused)
    assert all(r["block_size"] == 32 and r["vllm"] == "0.32.0" for r in fused)  # 16 -> 32
    assert all(r["isa"] for r in fused if r["impl"] == "vllm-fused")
    assert all(r["ms"] > 0 and r["samples"] == 2 for r in rows)
    # vLLM ran in its own process: this one never imported it, and Triton's mode is as it was
    assert "vllm" not in sys.modules and os.environ.get("TRITON_INTERPRET") == interpret
    assert {"decode", "prefill", "mixed"} <= set(result)  # the other tables are still there


@needs_vllm
def test_points_vllm_cannot_take_are_left_out_with_a_reason():
    cfg = AttentionConfig(batch=2, context=64, q_heads=4, kv_heads=2, head_dim=32, block_size=64)
    points, skipped = vllm_points(cfg, [1, 2], [64], memory=2**40)
    assert [(p.batch, p.context, p.block_size) for p in points] == [(1, 64, 64), (2, 64, 64)] and not skipped
    for bad in (AttentionConfig(head_dim=48), AttentionConfig(dtype="float16")):
        points, skipped = vllm_points(bad, [1], [64], memory=2**40)
        assert points == [] and "no vLLM row" in skipped[0]
    points, skipped = vllm_points(cfg, [1, 2], [64, 10**6], memory=10**8)
    assert [(p.batch, p.context) for p in points] == [(1, 64), (2, 64)]
    assert len(skipped) == 2 and all("left out" in s and "GiB" in s for s in skipped)


@needs_vllm
def test_a_failing_vllm_process_is_reported_with_its_last_words():
    bad = AttentionConfig(batch=1, context=32, q_heads=4, kv_heads=2, head_dim=32, block_size=32,
                          dtype="float16")  # the child has no tolerance for float16: it exits with an error
    with pytest.raises(RuntimeError, match="the vLLM attention process failed"):
        vllm_rows([bad], repeats=1, threads=1)


def test_no_points_start_no_process():
    assert vllm_rows([], repeats=1, threads=1) == []
