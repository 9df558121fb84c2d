"""Smoke test of ``python -m pagedlib.bench alloc`` (speed is measured by the benchmark, never asserted)."""

from __future__ import annotations

import json

from pagedlib.bench.__main__ import main


def test_alloc_benchmark_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "alloc.json"
    argv = ["alloc", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--block-size", "4",
            "--batches", "1,3", "--prompt", "9", "--repeats", "2", "--threads", "1", "--device", "cpu",
            "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "append_batch" in text and "decode, batch 3: append_batch is" in text and "% of a plain" in text
    result = json.loads(out.read_text())
    methods = {(r["phase"], r["method"], r["tokens"]) for r in result["rows"]}
    for b in (1, 3):
        for m in ("append_token", "append_batch", "contiguous", "copy_"):
            assert ("decode", m, b) in methods
    for m in ("append_token", "append_tokens", "contiguous", "copy_"):
        assert ("prefill", m, 9) in methods
    assert all(r["tokens_per_s"] > 0 and r["GB_per_s"] > 0 for r in result["rows"])
    assert result["config"]["threads"] == 1 and result["environment"]["device"] == "cpu"
