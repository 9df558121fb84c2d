"""``python -m pagedlib.bench gpu``: the fused Triton decode kernel on a CUDA GPU (notebook 05).

1. Correctness first: on fresh random inputs (fp16, bf16; mixed lengths; NaN in unused slots) the kernel,
   with and without split-K, must match the float64 oracle. Nothing is timed if it does not.
2. Copy bandwidth: a large device-to-device ``copy_``, the ceiling a decode kernel is judged against.
3. Decode step, for batch x context: 32 query / 8 KV heads, head_dim 128, fp16, block size 16, K/V in a
   pool of random blocks far larger than L2. Rows: the Triton kernel without and with split-K, the
   torch gather path (``paged_attention``), SDPA's flash backend on contiguous K/V of the same data, and
   FlexAttention with a paged block mask when this torch has it.

Each row's bandwidth counts the K/V bytes a decode step must read::

    kv_bytes = 2 (K and V) * batch * context * kv_heads * head_dim * bytes_per_element
    GB/s     = kv_bytes / seconds / 1e9

Times are medians over CUDA-event measurements of CUDA-graph replays (so Python launch overhead is not
counted); each replay cycles through enough independent inputs that nothing is served from L2.
Results go to ``benchmarks/results/gpu-<device>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pagedlib.attention import kv_bytes
from pagedlib.bench.timing import environment, print_table, write_json

BATCHES = (1, 8, 64, 256)
CONTEXTS = (512, 4096, 32768)
Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
FLEX_SHAPES = ((1, 32768), (8, 4096), (64, 4096))  # each new shape costs a torch.compile
RESULTS_DIR = Path("benchmarks/results")
METHODS = ("triton", "triton split-K", "torch gather", "sdpa contiguous", "flex paged")
COLUMNS = ("batch", "context", "method", "us", "GB/s", "% copy BW", "x SDPA", "splits", "note")

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
    q_heads: int = Q_HEADS
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE
    dtype: torch.dtype = torch.float16

    @property
    def blocks_per_seq(self) -> int:
        return math.ceil(self.context / self.block_size)

    @property
    def kv_bytes(self) -> int:
        return kv_bytes([self.context] * self.batch, self.kv_heads, self.head_dim, self.dtype)


def shapes(batches: Sequence[int] = BATCHES, contexts: Sequence[int] = CONTEXTS) -> list[Shape]:
    """The benchmark grid, smallest first."""
    return [Shape(b, c) for c in contexts for b in batches]


def replay_plan(kv_bytes: int, l2_bytes: int, *, target_s: float = 2e-3, est_gbps: float = 3000.0,
                max_inner: int = 64) -> tuple[int, int]:
    """``(inner, sets)``: calls per timed CUDA-graph replay, and how many independent input sets they
    cycle through so that the working set of one replay is at least 3x the L2 cache."""
    est_s = kv_bytes / (est_gbps * 1e9) + 5e-6
    inner = max(1, min(max_inner, round(target_s / est_s)))
    sets = max(1, min(inner, math.ceil(3 * l2_bytes / max(kv_bytes, 1))))
    return inner, sets


def finish_rows(rows: list[dict[str, Any]], copy_gbps: float) -> list[dict[str, Any]]:
    """Fill the derived columns: GB/s, % of copy bandwidth, throughput relative to contiguous SDPA
    (``x SDPA`` > 1 means faster than SDPA) for every timed row."""
    sdpa = {(r["batch"], r["context"]): r["seconds"] for r in rows
            if r["method"] == "sdpa contiguous" and r.get("seconds")}
    for r in rows:
        s = r.get("seconds")
        if not s:
            continue
        r["us"] = s * 1e6
        r["GB/s"] = r["kv_bytes"] / s / 1e9
        r["% copy BW"] = 100 * r["GB/s"] / copy_gbps
        base = sdpa.get((r["batch"], r["context"]))
        if base:
            r["x SDPA"] = base / s
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets for an H100/H200-class GPU, each with the measured value and pass/fail."""
    out = []
    for r in rows:
        if r["method"] not in ("triton", "triton split-K") or "GB/s" not in r:
            continue
        if r["batch"] >= 8 and r["context"] >= 4096:
            out.append({"target": f"{r['method']} b{r['batch']} ctx{r['context']} >= 70% copy BW",
                        "value": round(r["% copy BW"], 1), "ok": r["% copy BW"] >= 70})
            if "x SDPA" in r:
                out.append({"target": f"{r['method']} b{r['batch']} ctx{r['context']} >= 0.9x SDPA",
                            "value": round(r["x SDPA"], 2), "ok": r["x SDPA"] >= 0.9})
    by = {(r["method"], r["batch"], r["context"]): r.get("seconds") for r in rows}
    no, yes = by.get(("triton", 1, 32768)), by.get(("triton split-K", 1, 32768))
    if no and yes:
        out.append({"target": "split-K >= 3x faster than no-split at b1 ctx32768",
                    "value": round(no / yes, 2), "ok": no / yes >= 3})
    return out


def markdown_report(rows: list[dict[str, Any]], env: dict[str, Any], copy_gbps: float,
                    correctness: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    """The markdown file written next to the JSON."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return "" if v is None else str(v)

    lines = [f"# Paged decode on {env.get('device_name', env.get('device'))}", ""]
    lines += [f"- {k}: {env.get(k)}" for k in ("device_name", "driver", "cuda", "torch", "triton", "date")]
    lines += [f"- measured copy bandwidth (device-to-device `copy_`, read + write): {copy_gbps:,.0f} GB/s",
              f"- shape: {Q_HEADS} query / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, fp16, block size "
              f"{BLOCK_SIZE}; GB/s = K/V bytes one decode step must read / time", ""]
    lines += ["## Correctness (relative error against the float64 oracle)", "",
              "| case | splits | rel. error | limit | ok |", "|---|---|---|---|---|"]
    lines += [f"| {c['case']} | {c['splits']} | {c['rel_err']:.2e} | {c['limit']:.0e} | {c['ok']} |"
              for c in correctness]
    lines += ["", "## Decode step", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    lines += ["", "## Targets", "", "| target | value | ok |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {t['ok']} |" for t in targets]
    return "\n".join(lines) + "\n"


def result_stem(device_name: str, date: dt.date) -> str:
    """``gpu-<device>-<date>``, the device name lower-cased with runs of other characters as ``-``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return f"gpu-{slug}-{date.isoformat()}"


def write_results(out_dir: Path, payload: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    stem = result_stem(payload["environment"].get("device_name", "unknown"),
                       dt.date.fromisoformat(payload["environment"]["date"]))
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    write_json(json_path, payload)
    md_path.write_text(markdown)
    return json_path, md_path


# ---------------------------------------------------------------------------------------------------
# the parts that need a GPU
# ---------------------------------------------------------------------------------------------------


def time_cuda(calls: Sequence[Callable[[], Any]], inner: int, repeats: int, *, graph: bool = True
              ) -> tuple[float, str]:
    """Median seconds per call. ``calls`` are independent inputs; a replay runs ``inner`` of them in turn.

    With ``graph`` the replay is a captured CUDA graph ("graph"); otherwise (calls that synchronise with
    the host cannot be captured) an eager loop ("eager": includes Python launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[: min(len(calls), 3)]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def run_all() -> None:
        for i in range(inner):
            calls[i % len(calls)]()

    how, step = "eager", run_all
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_all()
        how, step = "graph", g.replay
    step()
    torch.cuda.synchronize()
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
    seconds, _ = time_cuda([lambda: dst.copy_(src)], inner=1, repeats=repeats)
    return 2 * nbytes / seconds / 1e9


# dtype, head_dim, block_size, group, lengths: the benchmark's shape first, then odd ones
CORRECTNESS_CASES = [
    (torch.float16, 128, 16, 4, [1, 16, 300, 4097, 2000]),
    (torch.bfloat16, 128, 16, 4, [1, 16, 300, 4097, 2000]),
    (torch.float16, 80, 1, 8, [33, 700]),
    (torch.bfloat16, 256, 32, 1, [64, 1500]),
    (torch.float16, 64, 128, 16, [129, 5000]),
]


def correctness(device: str = "cuda", cases: Sequence[tuple] = CORRECTNESS_CASES) -> list[dict[str, Any]]:
    """The kernel against the float64 oracle on fresh random inputs (mixed lengths, NaN in free slots),
    without split-K, with the heuristic's choice, and with 7 splits."""
    from pagedlib.attention import paged_attention_oracle
    from pagedlib.triton_attention import paged_attention_triton

    limits = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    out = []
    for dtype, head_dim, block_size, group, lens in cases:
        kv_heads = 2
        need = sum(math.ceil(n / block_size) for n in lens)
        num_blocks = need + 17
        k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
        v = k.clone()
        ids = torch.randperm(num_blocks).to(device)
        width = max(math.ceil(n / block_size) for n in lens)
        tables = torch.full((len(lens), width), -1, dtype=torch.int32, device=device)
        used = 0
        for b, n in enumerate(lens):
            c = math.ceil(n / block_size)
            blocks = ids[used: used + c]
            used += c
            tables[b, :c] = blocks.int()
            pos = torch.arange(n, device=device)
            k[blocks[pos // block_size], pos % block_size] = torch.randn(n, kv_heads, head_dim, device=device,
                                                                         dtype=dtype)
            v[blocks[pos // block_size], pos % block_size] = torch.randn(n, kv_heads, head_dim, device=device,
                                                                         dtype=dtype)
        q = torch.randn(len(lens), kv_heads * group, head_dim, device=device, dtype=dtype)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        ref = paged_attention_oracle(q.double(), k.double(), v.double(), tables, lens_t)
        for splits in (1, None, 7):
            got = paged_attention_triton(q, k, v, tables, lens_t, num_splits=splits).double()
            err = ((got - ref).norm() / ref.norm()).item()
            out.append({"case": f"{str(dtype)[6:]} d{head_dim} bs{block_size} g{group} lens {lens}",
                        "splits": "auto" if splits is None else splits, "rel_err": err,
                        "limit": limits[dtype], "ok": bool(err < limits[dtype])})
    return out


class Pool:
    """K/V pools ``[num_blocks, block_size, kv_heads, head_dim]`` of random data, ``gib`` in total."""

    def __init__(self, gib: float, shape: Shape, device: str = "cuda") -> None:
        elem = torch.empty((), dtype=shape.dtype).element_size()
        per_block = shape.block_size * shape.kv_heads * shape.head_dim * elem  # bytes of K in one block
        self.num_blocks = int(gib * 2**30 / 2 / per_block)
        self.device = device
        dims = (self.num_blocks, shape.block_size, shape.kv_heads, shape.head_dim)
        self.k = torch.empty(dims, dtype=shape.dtype, device=device).normal_()
        self.v = torch.empty(dims, dtype=shape.dtype, device=device).normal_()

    def tables(self, shape: Shape, gen: torch.Generator) -> torch.Tensor:
        """Random block ids, int32 ``[batch, blocks_per_seq]``: distinct while the pool has enough."""
        need = shape.batch * shape.blocks_per_seq
        perms = [torch.randperm(self.num_blocks, generator=gen, device=self.device)
                 for _ in range(math.ceil(need / self.num_blocks))]
        return torch.cat(perms)[:need].view(shape.batch, shape.blocks_per_seq).int()


def _contiguous(pool: torch.Tensor, tables: torch.Tensor, shape: Shape) -> torch.Tensor:
    """``[batch, kv_heads, context, head_dim]`` contiguous copy of the same tokens (SDPA's input)."""
    g = pool[tables.long()]  # [batch, blocks, block_size, kv_heads, head_dim]
    g = g.flatten(1, 2)[:, : shape.context]
    return g.transpose(1, 2).contiguous()


def _sdpa_call(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Callable[[], Any], str]:
    """SDPA on the flash backend (the math backend on a CPU); GQA through ``enable_gqa`` or, if flash
    rejects that, by folding the query heads of a group into query rows (exact for decode: one query
    token, no causal mask).

    Args: q4 ``[batch, q_heads, 1, head_dim]``; k, v ``[batch, kv_heads, context, head_dim]``.
    Returns the call and a note naming the backend and the GQA route."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = SDPBackend.FLASH_ATTENTION if q4.is_cuda else SDPBackend.MATH
    name = "flash" if q4.is_cuda else "math (cpu)"
    q4 = q4.contiguous()
    b, h, _, d = q4.shape
    qg = q4.view(b, k.shape[1], h // k.shape[1], d)  # [batch, kv_heads, group, head_dim]

    def call() -> Any:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

    def call_rows() -> Any:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qg, k, v)

    try:
        call()
        return call, f"{name}, enable_gqa"
    except RuntimeError:
        call_rows()
        return call_rows, f"{name}, group folded into query rows"


def _flex_setup(pool: Pool, shape: Shape) -> tuple[Callable[..., Any], Callable[[torch.Tensor], Any]] | str:
    """FlexAttention with torch's experimental ``PagedAttention`` block-mask conversion, or why not."""
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return f"FlexAttention paged helper not available: {e}"
    nb, bs = pool.num_blocks, shape.block_size
    # flex wants [1, kv_heads, num_blocks * block_size, head_dim]: the same pool in head-major layout
    k_flex = pool.k.permute(2, 0, 1, 3).reshape(1, shape.kv_heads, nb * bs, shape.head_dim)
    v_flex = pool.v.permute(2, 0, 1, 3).reshape(1, shape.kv_heads, nb * bs, shape.head_dim)
    compiled = torch.compile(flex_attention, dynamic=False)
    context = shape.context  # the last page may be partly filled: mask the positions past the end
    logical = create_block_mask(lambda b, h, q, kv: kv < context, shape.batch, None, 1, shape.context,
                                device="cuda", BLOCK_SIZE=(128, bs))

    def mask_for(tables: torch.Tensor) -> Any:
        # a fresh helper per table set: the converted mask reads its helper's mapping at call time
        paged = PagedAttention(nb, bs, shape.batch, device="cuda")
        paged.page_table.fill_(-1)
        paged.physical_to_logical.fill_(-1)
        paged.page_table[:, : tables.shape[1]] = tables.long()
        rows = torch.arange(shape.batch, device="cuda")[:, None]
        paged.physical_to_logical[rows, tables.long()] = torch.arange(tables.shape[1], device="cuda")
        return paged.convert_logical_block_mask(logical)

    def call(q4: torch.Tensor, mask: Any) -> Any:
        return compiled(q4, k_flex, v_flex, block_mask=mask, enable_gqa=True)

    return call, mask_for


def run_shape(shape: Shape, pool: Pool, l2_bytes: int, args: argparse.Namespace, gen: torch.Generator,
              timer: Callable[..., tuple[float, str]] = time_cuda) -> list[dict[str, Any]]:
    """Time every method on one shape; returns one row per method (skipped ones say why).

    ``timer(calls, inner, repeats, graph=...)`` is ``time_cuda`` on a GPU; a test passes a CPU stand-in
    to run this whole function on tiny CPU tensors through the interpreter."""
    from pagedlib.attention import paged_attention
    from pagedlib.triton_attention import _launch, _sm_count, choose_num_splits, paged_attention_triton

    inner, sets = replay_plan(shape.kv_bytes, l2_bytes)
    repeats = args.repeats if shape.kv_bytes < 2**30 else max(3, args.repeats // 3)
    device = pool.device
    lens = torch.full((shape.batch,), shape.context, dtype=torch.int32, device=device)
    tables = [pool.tables(shape, gen) for _ in range(sets)]
    q_shape = (shape.batch, shape.q_heads, shape.head_dim)
    qs = [torch.randn(q_shape, device=device, generator=gen).to(shape.dtype) for _ in range(sets)]
    base = {"batch": shape.batch, "context": shape.context, "kv_bytes": shape.kv_bytes}
    rows: list[dict[str, Any]] = []
    splits = choose_num_splits(shape.batch, shape.kv_heads, shape.context, _sm_count(torch.device(device)))
    first = paged_attention_triton(qs[0], pool.k, pool.v, tables[0], lens)  # validates once (host sync)
    for method, n in (("triton", 1), ("triton split-K", splits)):
        if method == "triton split-K" and n == 1:
            rows.append({**base, "method": method, "splits": 1, "note": "heuristic chose 1 split: as above"})
            continue
        calls = [lambda i=i, n=n: _launch(qs[i], pool.k, pool.v, tables[i], lens, None, n)
                 for i in range(sets)]
        seconds, how = timer(calls, inner, repeats)
        rows.append({**base, "method": method, "seconds": seconds, "splits": n, "note": how})

    if shape.kv_bytes > args.gather_budget_gib * 2**30:
        rows.append({**base, "method": "torch gather",
                     "note": f"skipped: a {shape.kv_bytes / 2**30:.0f} GiB copy > --gather-budget-gib"})
    else:
        calls = [lambda i=i: paged_attention(qs[i], pool.k, pool.v, tables[i], lens) for i in range(sets)]
        # paged_attention validates values and reads seq_lens on the host: not capturable
        seconds, how = timer(calls, inner, max(3, repeats // 2), graph=False)
        rows.append({**base, "method": "torch gather", "seconds": seconds, "note": how})

    ks = [_contiguous(pool.k, t, shape) for t in tables]
    vs = [_contiguous(pool.v, t, shape) for t in tables]
    sdpa = [_sdpa_call(q[:, :, None, :], k, v) for q, k, v in zip(qs, ks, vs)]
    ref = sdpa[0][0]().reshape(first.shape).double()  # same data as the Triton kernel's first call
    err = ((first.double() - ref).norm() / ref.norm()).item()
    seconds, how = timer([c for c, _ in sdpa], inner, repeats)
    rows.append({**base, "method": "sdpa contiguous", "seconds": seconds,
                 "note": f"{how}; {sdpa[0][1]}; triton rel. diff {err:.1e}"})
    del ks, vs, sdpa

    if args.flex == "none" or (args.flex == "some" and (shape.batch, shape.context) not in FLEX_SHAPES):
        rows.append({**base, "method": "flex paged", "note": f"not run for this shape (--flex {args.flex})"})
    else:
        try:
            setup = _flex_setup(pool, shape)
            if isinstance(setup, str):
                rows.append({**base, "method": "flex paged", "note": setup})
            else:
                call, mask_for = setup
                masks = [mask_for(t) for t in tables]
                q4s = [q[:, :, None, :] for q in qs]
                t0 = time.perf_counter()
                got = call(q4s[-1], masks[-1])[:, :, 0]
                compile_s = time.perf_counter() - t0
                want = paged_attention_triton(qs[-1], pool.k, pool.v, tables[-1], lens)
                err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                calls = [lambda i=i: call(q4s[i], masks[i]) for i in range(sets)]
                seconds, how = timer(calls, inner, repeats, graph=False)
                rows.append({**base, "method": "flex paged", "seconds": seconds,
                             "note": f"{how}; compile {compile_s:.0f} s; rel. err {err:.1e}"})
        except Exception as e:  # record, do not abort the run
            rows.append({**base, "method": "flex paged", "note": f"failed: {type(e).__name__}: {e}"[:200]})
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--pool-gib", type=float, default=8.0,
                        help="K+V pool size in GiB (>= 4: far beyond L2)")
    parser.add_argument("--repeats", type=int, default=15,
                        help="timed graph replays per row (fewer for big rows)")
    parser.add_argument("--gather-budget-gib", type=float, default=24.0,
                        help="skip the torch gather path when its gathered copy would exceed this")
    parser.add_argument("--flex", choices=("none", "some", "all"), default="some",
                        help="FlexAttention rows: none, a few shapes (each compiles), or all")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE, file=sys.stderr)
        return 2
    import triton

    from pagedlib.triton_attention import interpreting

    if interpreting():
        print("TRITON_INTERPRET=1 is set: unset it to benchmark the compiled kernel.", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    env = environment("cuda")
    env.update(date=dt.date.today().isoformat(), triton=triton.__version__, l2_bytes=props.L2_cache_size,
               driver=_driver_version())
    print(f"{env['device_name']}: {props.multi_processor_count} SMs, "
          f"L2 {props.L2_cache_size / 2**20:.0f} MiB, torch {torch.__version__}, triton {triton.__version__}")

    checks = correctness()
    print_table(checks, ["case", "splits", "rel_err", "limit", "ok"], title="correctness (float64 oracle)")
    if not all(c["ok"] for c in checks):
        print("correctness failed: nothing timed", file=sys.stderr)
        return 1

    copy_gbps = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbps:,.0f} GB/s")
    pool = Pool(args.pool_gib, Shape(1, 1))
    rows: list[dict[str, Any]] = []
    for shape in shapes(args.batches, args.contexts):
        t0 = time.perf_counter()
        new = finish_rows(run_shape(shape, pool, props.L2_cache_size, args, gen), copy_gbps)
        rows += new
        print_table(new, COLUMNS, title=f"batch {shape.batch}, context {shape.context} "
                                        f"({time.perf_counter() - t0:.0f} s)")
        # written after every shape: a run cut short (lease over, time limit) keeps what it measured
        targets = check_targets(rows)
        payload = {"environment": env, "copy_gbps": copy_gbps, "correctness": checks, "rows": rows,
                   "targets": targets, "shape": asdict(Shape(0, 0))}
        json_path, md_path = write_results(args.out_dir, payload,
                                           markdown_report(rows, env, copy_gbps, checks, targets))
        sys.stdout.flush()
    print_table(targets, ["target", "value", "ok"], title="targets (H100/H200 class)")
    if args.json:
        write_json(args.json, payload)
    print(f"wrote {json_path} and {md_path}")
    return 0


def _driver_version() -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.strip().splitlines()[0]
    except Exception:  # nvidia-smi missing: record that instead of failing the benchmark
        return "unknown"
