"""Smoke test of ``python -m pagedlib.bench generate`` (speed is measured there, never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedlib.bench.__main__ import main


def test_generate_benchmark_runs_and_every_method_agrees(tmp_path, capsys):
    out = tmp_path / "generate.json"
    threads = torch.get_num_threads()
    argv = ["generate", "--num-requests", "5", "--min-prompt", "3", "--max-prompt", "40",
            "--max-new-tokens", "6", "--hidden", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--intermediate", "64", "--vocab", "64", "--block-size", "8", "--repeats", "1", "--threads", "1",
            "--device", "cpu", "--max-num-batched-tokens", "12", "--json", str(out)]
    assert main(argv) == 0
    assert torch.get_num_threads() == threads                      # restored
    assert "hf_generate_batch" in capsys.readouterr().out
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"engine", "engine_chunked", "engine_cpu", "hf_generate", "hf_generate_batch"}
    assert all(r["same_tokens"] == "yes" and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["engine"]["speedup vs engine"] == 1 and all(r["new_tokens"] == 30 for r in rows.values())
    # the padded contiguous cache holds 5 rows of the longest prompt; the pool fits each request exactly
    assert rows["engine"]["kv_peak_MB"] <= rows["engine"]["kv_alloc_MB"] < rows["hf_generate"]["kv_alloc_MB"]


@pytest.mark.parametrize("flags, message", [
    (["--num-requests", "0"], "argument --num-requests"),
    (["--vocab", "0"], "argument --vocab"),
    (["--max-new-tokens", "-2"], "argument --max-new-tokens"),
    (["--block-size", "0"], "argument --block-size"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens"),
    (["--heads", "two"], "argument --heads"),
    (["--kv-heads", "3"], "--kv-heads 3 must divide --heads 8"),
    (["--hidden", "100"], "--hidden 100 must be --heads 8 x an even head size"),
    (["--hidden", "24"], "--hidden 24 must be --heads 8 x an even head size"),
    (["--min-prompt", "50", "--max-prompt", "10"], "--max-prompt 10 is below --min-prompt 50"),
])
def test_bad_flags_are_usage_errors_before_any_work(flags, message, capsys, monkeypatch):
    from pagedlib.bench import generate

    monkeypatch.setattr(generate, "build", lambda *a: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage:" in err and message in err


def test_measure_steps_counts_each_planned_step():
    """The rows notebook 09 fits its step cost on: per step, the new tokens and the K/V tokens attention
    reads, as the engine's plan has them (a prefill of 3 + 5 tokens, then decodes)."""
    from helpers import tiny_llama

    from pagedlib.bench.generate import measure_steps
    from pagedlib.engine import Engine
    from pagedlib.model import PagedLlama

    engine = Engine(PagedLlama.from_hf(tiny_llama()), 16, 4)
    rows = measure_steps(engine, [[1, 2, 3], [4, 5, 6, 7, 8]], 3)
    assert [(tokens, context) for tokens, context, _ in rows] == [(8, 8), (2, 10), (2, 12)]
    assert all(seconds > 0 for *_, seconds in rows) and "forward" not in vars(engine.model)
