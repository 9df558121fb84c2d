"""``python -m pagedlib.bench serve``: requests arriving in real time (speed is measured there, never asserted
here: every check below holds on a machine of any speed and load)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from pagedlib.bench import serve
from pagedlib.bench.__main__ import main

TINY = ["--min-prompt", "3", "--max-prompt", "40", "--max-new-tokens", "5", "--hidden", "64", "--layers", "2",
        "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--vocab", "64", "--block-size", "8",
        "--max-num-batched-tokens", "16", "--threads", "1", "--device", "cpu", "--no-progress"]


def recomputed(payload: dict, row: dict) -> dict:
    """A row's figures from the JSON's arrivals and the row's token times alone, by hand."""
    arrivals = [r["arrival_s"] for r in payload["requests"]]
    times = row["token_times_s"]
    ttft = [t[0] - a for a, t in zip(arrivals, times)]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    out = {f"ttft_p{q}_ms": np.percentile(ttft, q) * 1e3 for q in (50, 90, 99)}
    out |= {f"itl_p{q}_ms": np.percentile(itl, q) * 1e3 for q in (50, 90, 99)}
    seconds = max(t[-1] for t in times)
    settings = payload["settings"]
    met = sum(t[0] - a <= settings["slo_ttft_ms"] / 1e3
              and (t[-1] - t[0]) / max(len(t) - 1, 1) <= settings["slo_itl_ms"] / 1e3
              for a, t in zip(arrivals, times))
    return out | {"seconds": seconds, "tokens_per_s": sum(map(len, times)) / seconds,
                  "goodput_rps": met / seconds}


def test_serve_runs_prints_every_column_and_its_json_can_be_recomputed(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["serve", "--num-requests", "6", "--rate", "200", "--methods", "engine", "engine_chunked",
            *TINY, "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.split()[:2] == ["method", "source"])
    assert header.split() == serve.COLUMNS
    payload = json.loads(out.read_text())
    assert {"settings", "environment", "cost_model", "requests", "rows"} <= set(payload)
    rows = payload["rows"]
    assert [(r["method"], r["source"]) for r in rows] == [
        ("engine", "measured"), ("engine", "cost model"), ("engine_chunked", "measured"),
        ("engine_chunked", "cost model")]
    for row in rows:
        assert [len(t) for t in row["token_times_s"]] == [5] * 6            # every token stamped
        assert all(a <= b for t in row["token_times_s"] for a, b in zip(t, t[1:]))
        assert row["new_tokens"] == 30 and row["requests"] == 6
        for key, value in recomputed(payload, row).items():
            assert row[key] == pytest.approx(value), key
    # arrivals on the wall clock batch the requests differently from run to run, and the batch's shape
    # changes fp32 rounding: a near-tie may flip a greedy token (bench generate's docstring), so "yes" is
    # asserted where the batches are fixed (rate inf, below)
    assert all(r["same_tokens"] in ("yes", "NO") for r in rows if r["source"] == "measured")
    arrivals = [r["arrival_s"] for r in payload["requests"]]
    assert arrivals == [a.arrival_s for a in serve.poisson_arrivals(6, 200.0, 0)]
    # the first token of each request comes after it arrived
    assert all(t[0] >= a for row in rows for a, t in zip(arrivals, row["token_times_s"]))


def test_a_trace_run_takes_the_traces_timestamps_scaled_and_its_lengths_clamped(tmp_path):
    from pagedlib.sim.trace import MOONCAKE_TRACE, read_trace

    out = tmp_path / "trace.json"
    argv = ["serve", "--trace", "mooncake", "--time-scale", "0.001", "--num-requests", "5", "--methods",
            "engine", *TINY, "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    trace = read_trace(MOONCAKE_TRACE, limit=5)
    assert [r["arrival_s"] for r in payload["requests"]] == pytest.approx(
        [(t.timestamp - trace[0].timestamp) / 1000 * 0.001 for t in trace])
    requests = payload["requests"]
    assert [r["prompt_tokens"] for r in requests] == [min(max(t.input_length, 3), 40) for t in trace]
    assert [r["max_new_tokens"] for r in requests] == [min(max(t.output_length, 1), 5) for t in trace]
    measured = payload["rows"][0]
    assert [len(t) for t in measured["token_times_s"]] == [r["max_new_tokens"] for r in payload["requests"]]
    assert measured["same_tokens"] in ("yes", "NO")


def test_poisson_arrivals_are_deterministic_for_a_seed():
    first = serve.poisson_arrivals(500, 10.0, 3)
    assert first == serve.poisson_arrivals(500, 10.0, 3)
    assert first != serve.poisson_arrivals(500, 10.0, 4)
    times = [a.arrival_s for a in first]
    assert times[0] == 0 and times == sorted(times)
    assert 0.08 < np.mean(np.diff(times)) < 0.12                 # gaps of 1/rate on average (seed 3: 0.099)
    assert {a.arrival_s for a in serve.poisson_arrivals(4, float("inf"), 0)} == {0.0}


def test_the_cost_model_replays_the_arrivals_on_a_modelled_clock():
    """One second a step, nothing else: a lone request's tokens come 1, 2, 3 s after it arrives; a second
    request arriving at 10 s (the engine idle) starts then."""
    from pagedlib.sim.simulate import StepCost

    arrivals = [serve.Arrival(0.0, [1] * 5, 3), serve.Arrival(10.0, [2] * 7, 2)]
    args = SimpleNamespace(block_size=4)
    times = serve.predict(arrivals, StepCost(1.0, 0.0, 0.0), args, None)
    assert times == [[1.0, 2.0, 3.0], [11.0, 12.0]]
    chunked = serve.predict(arrivals, StepCost(1.0, 0.0, 0.0), args, 4)      # 5 prompt tokens: two steps
    assert chunked == [[2.0, 3.0, 4.0], [12.0, 13.0]]


def test_figures_by_hand():
    row = serve.figures([0.0, 1.0], [[0.5, 0.6, 0.7], [3.0, 4.0]], slo_ttft_ms=600, slo_itl_ms=200)
    assert row["ttft_p50_ms"] == pytest.approx(1250) and row["itl_p50_ms"] == pytest.approx(100)
    assert row["seconds"] == 4.0 and row["tokens_per_s"] == 5 / 4
    assert row["slo_met"] == "1/2" and row["goodput_rps"] == 1 / 4      # the second: TTFT 2 s


@pytest.mark.parametrize("flags, message", [
    (["--rate", "0"], "argument --rate"),
    (["--rate", "fast"], "argument --rate"),
    (["--num-requests", "0"], "argument --num-requests"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens"),
    (["--slo-ttft-ms", "-5"], "argument --slo-ttft-ms"),
    (["--slo-itl-ms", "0"], "argument --slo-itl-ms"),
    (["--methods", "sglang"], "argument --methods"),
    (["--trace", "sharegpt"], "argument --trace"),
    (["--time-scale", "0", "--trace", "mooncake"], "argument --time-scale"),
    (["--time-scale", "2"], "--time-scale scales a trace's timestamps"),
    (["--trace", "mooncake", "--rate", "3"], "--rate and --trace"),
    (["--trace", "mooncake", "--num-requests", "20000"], "--num-requests 20000: the Mooncake trace has"),
    (["--rate", "0.001"], "over the 3,600 s a run may take: change --rate"),
    (["--trace", "mooncake", "--time-scale", "1000"], "change --time-scale"),
    (["--kv-heads", "3"], "--kv-heads 3 must divide --heads 8"),
    (["--min-prompt", "50", "--max-prompt", "10"], "--max-prompt 10 is below --min-prompt 50"),
    (["--max-new-tokens", "1000000000"], "exceeds the model's 4096 positions"),
    (["--threads", "0"], "argument --threads"),
    (["--json", "/nonexistent-folder/x.json"], "argument --json"),
])
def test_bad_flags_are_usage_errors_before_any_work(flags, message, capsys, monkeypatch):
    from pagedlib.bench import generate

    monkeypatch.setattr(generate, "build", lambda *a: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage:" in err and message in err


@pytest.mark.slow
def test_vllm_serves_the_same_arrivals(tmp_path, capsys):
    """vLLM in its worker process on the same tiny model (head size 32: one vLLM's CPU attention takes),
    the same Poisson arrivals; skipped, with the reason, where vLLM does not run."""
    from pagedlib.vllm.bridge import vllm_available

    available, why = vllm_available()
    if not available:
        pytest.skip(why)
    out = tmp_path / "vllm.json"
    argv = ["serve", "--num-requests", "4", "--rate", "inf", "--methods", "vllm", *TINY, "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    (row,) = payload["rows"]
    assert row["method"] == "vllm" and row["source"] == "measured" and row["startup_s"] > 0
    assert [len(t) for t in row["token_times_s"]] == [5] * 4
    assert row["same_tokens"] == "yes"
    for key, value in recomputed(payload, row).items():
        assert row[key] == pytest.approx(value), key


def test_vllm_is_skipped_with_its_reason_where_it_cannot_run(tmp_path, capsys, monkeypatch):
    """Where vLLM cannot run (here: faked) the run goes on without its row and says why. All at once (rate
    inf), every method's batches are fixed: the same tokens as the offline run."""
    from pagedlib.bench import generate

    out = tmp_path / "no-vllm.json"
    monkeypatch.setattr(generate, "vllm_unavailable", lambda args: "no vllm here (test)")
    assert main(["serve", "--num-requests", "3", "--rate", "inf", *TINY, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no vllm row: no vllm here (test)" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"engine", "engine_chunked"}
    assert all(r["same_tokens"] == "yes" for r in rows if r["source"] == "measured")
