"""``python -m pagedlib.bench gpu``: the fused Triton decode kernel on a CUDA GPU (notebook 05).

1. Correctness first: on fresh random inputs (fp16, bf16; mixed lengths; NaN in unused slots) the kernel,
   with and without split-K, must meet ``REL_ERROR_LIMITS`` against the float64 oracle. Nothing is timed
   if it does not.
2. Copy bandwidth: a large device-to-device ``copy_``, the ceiling a decode kernel is judged against.
3. Decode step, for batch x context: 32 query / 8 KV heads, head_dim 128, fp16, block size 16, K/V in a
   pool of random blocks far larger than L2. Rows: the Triton kernel without and with split-K, the
   torch gather path (``paged_attention``), the unified varlen kernel (``paged_attention_varlen_triton``,
   a decode step is its case of one token per sequence), and SDPA's flash backend on contiguous K/V.
4. Prefill (notebook 09): ``batch`` whole prompts of ``context`` tokens in one flat batch, tokens/s of the
   unified kernel, of the torch varlen path (eager), and of SDPA's flash backend (causal, contiguous).

Each row's GB/s is the K/V bytes a decode step must read (``kernels.attention.kv_bytes``) over its time,
and ``speedup vs SDPA (x faster)`` is SDPA's time divided by the row's (> 1: faster than SDPA).

Times are medians over CUDA-event measurements of CUDA-graph replays (so Python launch overhead is not
counted; the torch gather path reads lengths on the host and runs eagerly, as its note says); each replay
cycles through enough independent inputs that nothing is served from L2. Results go to
``benchmarks/results/gpu-<device>-<date>.json`` and ``.md``. Without CUDA the command refuses.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedlib.bench.timing import (
    environment,
    int_list,
    markdown_table,
    positive_float,
    positive_int,
    print_table,
    speedup,
    write_json,
)
from pagedlib.core.cache import PagedKVCache
from pagedlib.kernels.attention import (
    REL_ERROR_LIMITS,
    kv_bytes,
    paged_attention,
    paged_attention_oracle,
    rel_error,
)
from pagedlib.util import ceil_div

RESULTS_DIR = Path("benchmarks/results")
PREFILL_SHAPES = ((1, 4096), (8, 2048), (32, 512))  # (prompts, tokens each) of the prefill table
METHODS = ("triton", "triton split-K", "triton varlen", "torch gather", "sdpa contiguous")
PREFILL_METHODS = ("triton varlen", "torch varlen", "sdpa contiguous")
SPEEDUP = "speedup vs SDPA (x faster)"  # SDPA's time / the row's time, at the same batch and context
PREFILL_COLUMNS = ("batch", "context", "method", "us", "tokens/s", SPEEDUP, "note")
COLUMNS = ("batch", "context", "method", "us", "GB/s", "% copy BW", SPEEDUP, "splits", "note")
CHECK_COLUMNS = ("case", "splits", "rel_err", "limit", "ok")
NO_CUDA_MESSAGE = (
    "python -m pagedlib.bench gpu needs a CUDA GPU, and torch.cuda.is_available() is False here.\n"
    "On a CPU the kernel runs through Triton's interpreter, which checks correctness but says nothing about\n"
    "speed. Run the tests (make test) for correctness; run this command on a machine with an NVIDIA GPU."
)


@dataclass(frozen=True)
class Shape:
    """One decode step's size. ``kv_bytes`` is what the step must read from memory."""

    batch: int
    context: int
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.float16

    @property
    def kv_bytes(self) -> int:
        return kv_bytes([self.context] * self.batch, self.kv_heads, self.head_dim, self.dtype)


def replay_plan(kv_bytes: int, l2_bytes: int, *, target_s: float = 2e-3, est_gbps: float = 3000.0,
                max_inner: int = 64) -> tuple[int, int]:
    """``(inner, sets)``: calls per timed CUDA-graph replay, and how many independent input sets they
    cycle through so that the working set of one replay is at least 3x the L2 cache."""
    inner = max(1, min(max_inner, round(target_s / (kv_bytes / (est_gbps * 1e9) + 5e-6))))
    return inner, max(1, min(inner, math.ceil(3 * l2_bytes / max(kv_bytes, 1))))


def finish_rows(rows: list[dict[str, Any]], copy_gbps: float) -> list[dict[str, Any]]:
    """Fill the derived columns of every timed row: us, GB/s, % of copy bandwidth, speedup vs SDPA."""
    sdpa = {(r["batch"], r["context"]): r["seconds"] for r in rows if r["method"] == "sdpa contiguous"
            and r.get("seconds")}
    for r in (r for r in rows if r.get("seconds")):
        r.update({"us": r["seconds"] * 1e6, "GB/s": r["kv_bytes"] / r["seconds"] / 1e9})
        r["% copy BW"] = 100 * r["GB/s"] / copy_gbps
        if (r["batch"], r["context"]) in sdpa:
            r[SPEEDUP] = speedup(sdpa[(r["batch"], r["context"])], r["seconds"])
    return rows


def markdown_report(rows: list[dict[str, Any]], env: dict[str, Any], copy_gbps: float,
                    checks: list[dict[str, Any]], prefill: Sequence[dict[str, Any]] = ()) -> str:
    """The markdown file written next to the JSON."""
    head = [f"# Paged decode on {env.get('device_name', env.get('device'))}", ""]
    head += [f"- {k}: {env.get(k)}" for k in ("device_name", "cuda", "torch", "triton", "date")]
    head += [f"- measured copy bandwidth (device-to-device `copy_`, read + write): {copy_gbps:,.0f} GB/s",
             "- shape: 32 query / 8 KV heads, head_dim 128, fp16, block size 16; GB/s = K/V bytes one "
             f"decode step must read / time; {SPEEDUP} = SDPA's time / the row's (> 1: faster)", "",
             "## Correctness (relative error against the float64 oracle)", "",
             markdown_table(checks, CHECK_COLUMNS), "", "## Decode step", "", markdown_table(rows, COLUMNS)]
    if prefill:
        head += ["", "## Prefill (whole prompts, one flat batch; tokens/s = prompt tokens / time)", "",
                 markdown_table(prefill, PREFILL_COLUMNS)]
    return "\n".join(head) + "\n"


def write_results(out_dir: Path, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """``gpu-<device>-<date>.json`` and ``.md`` in ``out_dir`` (device lower-cased, other runs as ``-``)."""
    env = payload["environment"]
    slug = re.sub(r"[^a-z0-9]+", "-", env.get("device_name", "unknown").lower()).strip("-")
    json_path, md_path = (out_dir / f"gpu-{slug}-{env['date']}{ext}" for ext in (".json", ".md"))
    write_json(json_path, payload)
    md_path.write_text(markdown)
    return json_path, md_path


# ---------------------------------------------------------------------------------------------------
# the parts that need a GPU (or, for tests, a CPU stand-in)


def time_cuda(calls: Sequence[Callable[[], Any]], inner: int, repeats: int, *, graph: bool = True
              ) -> tuple[float, str]:
    """Median seconds per call. ``calls`` are independent inputs; a replay runs ``inner`` of them in turn,
    as a captured CUDA graph (``graph``), or as an eager loop (calls that synchronise with the host
    cannot be captured; the time then includes Python launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:3]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    run_all = lambda: [calls[i % len(calls)]() for i in range(inner)]
    step, how = run_all, "eager"
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_all()
        step, how = g.replay, "graph"
    step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        step()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(samples), how


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """GB/s of a device-to-device ``copy_`` of ``nbytes`` (bytes read + bytes written, per second)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / time_cuda([lambda: dst.copy_(src)], inner=1, repeats=repeats)[0] / 1e9


# dtype, head_dim, block_size, group, lengths: the benchmark's shape first, then odd ones
CORRECTNESS_CASES = [
    (torch.float16, 128, 16, 4, [1, 16, 300, 4097, 2000]),
    (torch.bfloat16, 128, 16, 4, [1, 16, 300, 4097, 2000]),
    (torch.float16, 80, 1, 8, [33, 700]),
    (torch.bfloat16, 256, 32, 1, [64, 1500]),
    (torch.float16, 64, 128, 16, [129, 5000]),
]


def _random_cache(lens: Sequence[int], dtype: torch.dtype, head_dim: int, block_size: int,
                  device: str) -> PagedKVCache:
    """Sequences 0.. of random K/V (2 KV heads) in shuffled blocks, NaN in every unused slot."""
    num_blocks = sum(ceil_div(n, block_size) for n in lens) + 17
    cache = PagedKVCache(num_blocks, 1, block_size, 2, head_dim, dtype=dtype, device=device,
                         free_order=torch.randperm(num_blocks).tolist(), fill=float("nan"))
    for s, n in enumerate(lens):
        cache.add_sequence(s)
        cache.append_tokens(s, *torch.randn(2, 1, n, 2, head_dim, device=device, dtype=dtype))
    return cache


def correctness(device: str = "cuda", cases: Sequence[tuple] = CORRECTNESS_CASES) -> list[dict[str, Any]]:
    """The kernel against the float64 oracle on fresh random inputs (mixed lengths, NaN in unused slots,
    2 KV heads), without split-K, with the heuristic's choice, and with 7 splits."""
    from pagedlib.kernels.triton_decode import paged_attention_triton

    out = []
    for dtype, head_dim, block_size, group, lens in cases:
        cache = _random_cache(lens, dtype, head_dim, block_size, device)
        seqs = list(range(len(lens)))
        q = torch.randn(len(lens), 2 * group, head_dim, device=device, dtype=dtype)
        args = (q, *cache.layer(0), cache.block_table(seqs), cache.seq_lens_tensor(seqs))
        ref = paged_attention_oracle(*args)
        for splits in (1, None, 7):
            err = rel_error(paged_attention_triton(*args, num_splits=splits), ref)
            out.append({"case": f"{str(dtype)[6:]} d{head_dim} bs{block_size} g{group} lens {lens}",
                        "splits": "auto" if splits is None else splits, "rel_err": err,
                        "limit": REL_ERROR_LIMITS[dtype], "ok": err < REL_ERROR_LIMITS[dtype]})
    return out


# dtype, head_dim, block_size, group, (cached, new) per sequence: decodes, whole prompts, chunks mid-block
VARLEN_CASES = [
    (torch.float16, 128, 16, 4, [(100, 1), (0, 517), (2000, 300), (37, 1), (15, 64)]),
    (torch.bfloat16, 128, 16, 4, [(100, 1), (0, 517), (2000, 300), (37, 1), (15, 64)]),
    (torch.float16, 80, 1, 8, [(33, 1), (0, 129), (700, 40)]),
    (torch.bfloat16, 256, 128, 2, [(129, 1), (300, 200)]),
]


def varlen_correctness(device: str = "cuda", cases: Sequence[tuple] = VARLEN_CASES) -> list[dict[str, Any]]:
    """The unified kernel against the float64 varlen oracle on mixed batches (NaN in unused slots)."""
    from pagedlib.kernels.triton_varlen import paged_attention_varlen_triton
    from pagedlib.kernels.varlen import paged_attention_varlen_oracle

    out = []
    for dtype, head_dim, block_size, group, seqs in cases:
        lens, new = [c + n for c, n in seqs], [n for _, n in seqs]
        cache = _random_cache(lens, dtype, head_dim, block_size, device)
        ids = list(range(len(seqs)))
        q = torch.randn(sum(new), 2 * group, head_dim, device=device, dtype=dtype)
        qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
        args = (q, *cache.layer(0), cache.block_table(ids), cache.seq_lens_tensor(ids), qsl)
        err = rel_error(paged_attention_varlen_triton(*args), paged_attention_varlen_oracle(*args))
        case = f"varlen {str(dtype)[6:]} d{head_dim} bs{block_size} g{group} (cached, new) {seqs}"
        out.append({"case": case,
                    "splits": "-", "rel_err": err, "limit": REL_ERROR_LIMITS[dtype],
                    "ok": err < REL_ERROR_LIMITS[dtype]})
    return out


def prefill_rows(shape: Shape, pool: Pool, gen: torch.Generator, *, repeats: int = 15,
                 timer: Callable[..., tuple[float, str]] = time_cuda) -> list[dict[str, Any]]:
    """``shape.batch`` whole prompts of ``shape.context`` tokens as one flat batch (their K/V already in the
    pool): tokens/s of the unified kernel, of the torch varlen path and of SDPA (flash, causal) on
    contiguous copies with the KV heads repeated for their query heads. ``timer``: as in ``run_shape``."""
    from pagedlib.kernels.triton_varlen import launch_varlen
    from pagedlib.kernels.varlen import paged_attention_varlen

    b, n, dev = shape.batch, shape.context, pool.device
    tables, lens = pool.tables(shape, gen), torch.full((b,), n, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=dev)          # [batch + 1]
    q = torch.randn(b * n, shape.q_heads, shape.head_dim, device=dev, generator=gen).to(shape.dtype)
    group = shape.q_heads // shape.kv_heads
    k, v = (x.repeat_interleave(group, 1) for x in pool.contiguous(tables, n))  # [batch, q_heads, n, D]
    qc = q.view(b, n, shape.q_heads, shape.head_dim).transpose(1, 2)             # [batch, q_heads, n, D]
    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH

    def sdpa() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qc, k, v, is_causal=True)

    calls = {"triton varlen": (lambda: launch_varlen(q, pool.k, pool.v, tables, lens, qsl, None), True),
             "torch varlen": (lambda: paged_attention_varlen(q, pool.k, pool.v, tables, lens, qsl), False),
             "sdpa contiguous": (sdpa, True)}
    rows = []
    for method, (call, graph) in calls.items():  # the torch path reads lengths on the host: eager
        seconds, how = timer([call], 1, repeats if graph else max(3, repeats // 3), graph=graph)
        rows.append({"batch": b, "context": n, "method": method, "seconds": seconds, "us": seconds * 1e6,
                     "tokens/s": b * n / seconds, "note": how})
    sdpa_s = rows[-1]["seconds"]
    return [{**r, SPEEDUP: speedup(sdpa_s, r["seconds"])} for r in rows]


class Pool:
    """K/V pools ``[num_blocks, block_size, kv_heads, head_dim]`` of random data, ``gib`` in total."""

    def __init__(self, gib: float, shape: Shape, device: str = "cuda") -> None:
        per_block = shape.block_size * shape.kv_heads * shape.head_dim * shape.dtype.itemsize  # bytes of K
        self.num_blocks, self.device = int(gib * 2**30 / 2 / per_block), device
        dims = (self.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
        self.k = torch.empty(dims, dtype=shape.dtype, device=device).normal_()
        self.v = torch.empty(dims, dtype=shape.dtype, device=device).normal_()

    def tables(self, shape: Shape, gen: torch.Generator) -> torch.Tensor:
        """Random block ids, int32 ``[batch, blocks_per_seq]``: distinct while the pool has enough."""
        per_seq = ceil_div(shape.context, shape.block_size)
        need = shape.batch * per_seq
        perms = [torch.randperm(self.num_blocks, generator=gen, device=self.device)
                 for _ in range(ceil_div(need, self.num_blocks))]
        return torch.cat(perms)[:need].view(shape.batch, per_seq).int()

    def contiguous(self, tables: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[batch, kv_heads, context, head_dim]``: a contiguous copy of the same tokens."""
        return tuple(p[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
                     for p in (self.k, self.v))


def sdpa_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable[[], torch.Tensor]:
    """SDPA's flash backend (math on a CPU) for ``q`` ``[batch, q_heads, head_dim]`` and contiguous
    ``k``, ``v`` ``[batch, kv_heads, context, head_dim]``. The query heads of a GQA group become query
    rows, ``[batch, kv_heads, group, head_dim]``: exact for decode (one token, no causal mask)."""
    backend = SDPBackend.FLASH_ATTENTION if q.is_cuda else SDPBackend.MATH
    qg = q.reshape(q.shape[0], k.shape[1], -1, q.shape[2])

    def call() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qg, k, v).reshape(q.shape)

    return call


def run_shape(shape: Shape, pool: Pool, l2_bytes: int, gen: torch.Generator, *, repeats: int = 15,
              timer: Callable[..., tuple[float, str]] = time_cuda) -> list[dict[str, Any]]:
    """Time every method on one shape; returns one row per method (a skipped one says why in ``note``).

    ``timer(calls, inner, repeats, graph=...)`` is ``time_cuda`` on a GPU; a test passes a CPU stand-in
    to run this whole function on tiny CPU tensors through the interpreter."""
    from pagedlib.kernels.triton_decode import paged_attention_triton

    inner, sets = replay_plan(shape.kv_bytes, l2_bytes)
    repeats = repeats if shape.kv_bytes < 2**30 else max(3, repeats // 3)
    base = {"batch": shape.batch, "context": shape.context, "kv_bytes": shape.kv_bytes}

    def timed(method: str, calls: list[Callable[[], Any]], graph: bool = True, **extra: Any) -> dict:
        seconds, how = timer(calls, inner, repeats if graph else max(3, repeats // 2), graph=graph)
        return {**base, "method": method, "seconds": seconds, "note": how, **extra}

    lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=pool.device)
    x = [(torch.randn(shape.batch, shape.q_heads, shape.head_dim, device=pool.device, generator=gen)
          .to(shape.dtype), pool.tables(shape, gen)) for _ in range(sets)]  # (q, tables) per input set
    first = paged_attention_triton(x[0][0], pool.k, pool.v, x[0][1], lens)  # validates once (host sync)
    rows = _triton_rows(shape, pool, x, lens, base, timed)
    # paged_attention (chunks of at most 64 MiB of gathered K/V on a GPU) reads seq_lens on the host: it
    # cannot be captured in a CUDA graph
    rows.append(timed("torch gather", [lambda q=q, t=t: paged_attention(q, pool.k, pool.v, t, lens)
                                       for q, t in x], graph=False))
    sdpa = [sdpa_call(q, *pool.contiguous(t, shape.context)) for q, t in x]
    rows.append(timed("sdpa contiguous", sdpa))
    rows[-1]["note"] += f"; triton rel. diff {rel_error(first, sdpa[0]()):.1e}"
    return rows


def _triton_rows(shape: Shape, pool: Pool, x: list[tuple[torch.Tensor, torch.Tensor]], lens: torch.Tensor,
                 base: dict[str, Any], timed: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernel without split-K, and with the heuristic's number of splits (when it chooses > 1)."""
    from pagedlib.kernels.triton_decode import choose_num_splits, launch_decode, sm_count
    from pagedlib.kernels.triton_varlen import launch_varlen

    sms = sm_count(torch.device(pool.device))
    splits = choose_num_splits(shape.batch, shape.kv_heads, shape.context, sms)
    rows = []
    for method, n in (("triton", 1), ("triton split-K", splits)):
        if method == "triton split-K" and n == 1:
            rows.append({**base, "method": method, "splits": 1, "note": "heuristic chose 1 split: as above"})
        else:
            calls = [lambda q=q, t=t, n=n: launch_decode(q, pool.k, pool.v, t, lens, None, n) for q, t in x]
            rows.append(timed(method, calls, splits=n))
    qsl = torch.arange(shape.batch + 1, dtype=torch.int32, device=pool.device)  # one token per sequence
    rows.append(timed("triton varlen", [lambda q=q, t=t: launch_varlen(q, pool.k, pool.v, t, lens, qsl, None)
                                        for q, t in x], splits=1))
    return rows


def benchmark(batches: Sequence[int] = (1, 8, 64, 256), contexts: Sequence[int] = (512, 4096, 32768), *,
              pool_gib: float = 8.0, repeats: int = 15, out_dir: Path = RESULTS_DIR,
              prefill: Sequence[tuple[int, int]] = PREFILL_SHAPES) -> dict[str, Any]:
    """The whole GPU benchmark (see the module docstring); prints each table as it goes and rewrites the
    result files after every shape, so a run cut short keeps what it measured. Returns the payload."""
    import triton

    props = torch.cuda.get_device_properties(0)
    env = {**environment("cuda"), "date": dt.date.today().isoformat(), "triton": triton.__version__,
           "l2_bytes": props.L2_cache_size}
    print(f"{env['device_name']}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    checks = correctness() + varlen_correctness()
    print_table(checks, CHECK_COLUMNS, title="correctness (float64 oracle)")
    payload: dict[str, Any] = {"environment": env, "correctness": checks, "rows": []}
    if not all(c["ok"] for c in checks):
        return payload
    payload["copy_gbps"] = copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:,.0f} GB/s")
    pool, gen = Pool(pool_gib, Shape(1, 1)), torch.Generator(device="cuda").manual_seed(0)
    for shape in (Shape(b, c) for c in contexts for b in batches):
        t0 = time.perf_counter()
        new = finish_rows(run_shape(shape, pool, props.L2_cache_size, gen, repeats=repeats), copy_gbps)
        payload["rows"] += new
        print_table(new, COLUMNS, title=f"batch {shape.batch}, context {shape.context} "
                                        f"({time.perf_counter() - t0:.0f} s)")
        paths = write_results(out_dir, payload, markdown_report(payload["rows"], env, copy_gbps, checks))
        torch.cuda.empty_cache()
    payload["prefill"] = []
    for b, n in prefill:
        payload["prefill"] += prefill_rows(Shape(b, n), pool, gen, repeats=repeats)
        print_table(payload["prefill"][-len(PREFILL_METHODS):], PREFILL_COLUMNS, title=f"prefill: {b} x {n}")
        paths = write_results(out_dir, payload, markdown_report(payload["rows"], env, copy_gbps, checks,
                                                                payload["prefill"]))
    print(f"wrote {paths[0]} and {paths[1]}")
    return payload


def writable_dir(text: str) -> Path:
    """argparse ``type=``: a folder that is, or can be created, writable (checked before the run)."""
    path = existing = Path(text).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write results to {text!r}: {str(existing)!r} is not a "
                                         "writable folder")
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int_list, default=[1, 8, 64, 256], help="comma-separated")
    parser.add_argument("--contexts", type=int_list, default=[512, 4096, 32768], help="comma-separated")
    parser.add_argument("--pool-gib", type=positive_float, default=8.0,
                        help="K+V pool in GiB (>= 4: far beyond L2)")
    parser.add_argument("--repeats", type=positive_int, default=15,
                        help="timed replays per row (fewer for big rows)")
    parser.add_argument("--out-dir", type=writable_dir, default=RESULTS_DIR)


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    from pagedlib.kernels.triton_mode import interpreting

    if interpreting():
        print("TRITON_INTERPRET=1 is set: unset it to benchmark the compiled kernel.", file=sys.stderr)
        return 2
    payload = benchmark(args.batches, args.contexts, pool_gib=args.pool_gib, repeats=args.repeats,
                        out_dir=args.out_dir)
    if not payload["rows"]:
        print("correctness failed: nothing timed", file=sys.stderr)
        return 1
    return 0

