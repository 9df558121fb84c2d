"""``python -m pagedlib.bench attention``: per-token reference vs vectorized paged vs contiguous SDPA.

Decode (one new token per sequence, a batch of sequences) and prefill (causal attention over one prompt)
are measured separately. Every figure is the median of repeated calls; GB/s is the bytes of K and V that
must be read divided by that time::

    bytes = 2 * sum(seq_lens) * kv_heads * head_dim * dtype_bytes      (K and V, every cached token once)
    GB/s  = bytes / median_seconds / 1e9

The paged pool is fragmented on purpose: blocks are handed out in a random order, as in a server that has
been running for a while, so a sequence's blocks are scattered over the pool.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pagedlib.attention import (
    contiguous_attention,
    kv_bytes,
    paged_attention,
    paged_prefill_attention,
    reference_paged_attention,
)
from pagedlib.bench.timing import DTYPES, Timing, environment, print_table, time_fn, write_json
from pagedlib.cache import PagedKVCache

COLUMNS = ["phase", "impl", "batch", "context", "block_size", "ms", "GB/s", "x_contig", "spread"]


@dataclass(frozen=True)
class AttentionConfig:
    """One benchmark point. ``context`` is every sequence's length (decode) or the prompt length."""

    batch: int = 16
    context: int = 1024
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "float32"
    device: str = "cpu"


@dataclass
class Inputs:
    """Everything one benchmark point needs, built once and reused by every implementation."""

    cache: PagedKVCache          # num_layers = 1; sequences 0 .. batch-1
    q: torch.Tensor              # [batch, q_heads, head_dim]
    block_tables: torch.Tensor   # int32 [batch, max_blocks]
    seq_lens: torch.Tensor       # int32 [batch]
    k: torch.Tensor              # contiguous [batch, kv_heads, context, head_dim]
    v: torch.Tensor


def make_inputs(cfg: AttentionConfig, seed: int = 0) -> Inputs:
    """A fragmented single-layer pool holding ``batch`` sequences of ``context`` tokens, the same K/V laid
    out contiguously, and one query per sequence."""
    g = torch.Generator().manual_seed(seed)
    dtype, dev = DTYPES[cfg.dtype], torch.device(cfg.device)
    blocks_per_seq = math.ceil(cfg.context / cfg.block_size)
    num_blocks = cfg.batch * blocks_per_seq
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = PagedKVCache(num_blocks, 1, cfg.block_size, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=dev,
                         free_order=order, fill=float("nan"))
    shape = (1, cfg.context, cfg.kv_heads, cfg.head_dim)
    for s in range(cfg.batch):
        cache.add_sequence(s)
        k = torch.randn(shape, generator=g).to(dev, dtype)
        v = torch.randn(shape, generator=g).to(dev, dtype)
        cache.append_tokens(s, k, v)
    seqs = list(range(cfg.batch))
    gathered = [cache.gather(s) for s in seqs]                   # each [1, context, kv_heads, head_dim]
    k = torch.cat([kv[0] for kv in gathered]).transpose(1, 2).contiguous()  # [batch, kv_heads, ctx, D]
    v = torch.cat([kv[1] for kv in gathered]).transpose(1, 2).contiguous()
    q = torch.randn(cfg.batch, cfg.q_heads, cfg.head_dim, generator=g).to(dev, dtype)
    return Inputs(cache, q, cache.block_table(seqs), cache.seq_lens_tensor(seqs), k, v)


_FLUSH: dict[str, torch.Tensor] = {}


def flush_caches(device: str, nbytes: int = 64 * 2**20) -> None:
    """Overwrite ``nbytes`` (more than a CPU's last-level cache or a GPU's L2), so that the next call
    reads its K/V from memory, as a decode step does after the rest of the model ran."""
    buf = _FLUSH.get(device)
    if buf is None:
        buf = _FLUSH[device] = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    buf.fill_(1.0)


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: dict[str, int], min_time: float,
                     device: str, flush: bool = True) -> dict[str, Timing]:
    """Time several callables in rounds, one call of each per round (after one warm-up call each), so
    that load from other processes hits all of them alike; each round starts with the next callable, so
    none always runs right after the same neighbour. ``fns[name]`` is timed ``repeats[name]`` times, and
    up to ten times as often while fewer than ``min_time`` seconds have passed. With ``flush``, caches
    are flushed (untimed) before every call."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    names = list(fns)
    start = time.perf_counter()
    for r in range(10 * max(repeats.values())):
        more_time = time.perf_counter() - start < min_time
        order = names[r % len(names):] + names[: r % len(names)]
        todo = [name for name in order if r < repeats[name] or (more_time and r < 10 * repeats[name])]
        if not todo:
            break
        for name in todo:
            if flush:
                flush_caches(device)
            samples[name].append(time_fn(fns[name], repeats=1, warmup=0, device=device).samples[0])
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def _row(cfg: AttentionConfig, phase: str, impl: str, timing: Any, nbytes: int) -> dict[str, Any]:
    return {"phase": phase, "impl": impl, "batch": cfg.batch, "context": cfg.context,
            "block_size": cfg.block_size, "ms": timing.median * 1e3, "GB/s": nbytes / timing.median / 1e9,
            "spread": timing.spread, "samples": len(timing.samples)}


def _add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``x_contig``: time relative to contiguous SDPA at the same phase, batch, context and block size."""
    key = ("phase", "batch", "context", "block_size")
    base = {tuple(r[k] for k in key): r["ms"] for r in rows if r["impl"] == "contiguous"}
    for r in rows:
        ref = base.get(tuple(r[k] for k in key))
        r["x_contig"] = r["ms"] / ref if ref else float("nan")
    return rows


def decode_rows(cfg: AttentionConfig, impls: tuple[str, ...] = ("reference", "paged", "contiguous"),
                repeats: int = 20, min_time: float = 0.5) -> list[dict[str, Any]]:
    """Time one decode step (one layer) of ``cfg.batch`` sequences with each implementation in ``impls``:
    ``reference`` (per-token gather loop, one sequence after another), ``paged`` (``paged_attention``),
    ``paged-whole-batch`` (the same, gathering the whole batch at once) and ``contiguous`` (SDPA)."""
    x = make_inputs(cfg)
    layer = x.cache.layer(0)
    fns = {
        "reference": lambda: [reference_paged_attention(x.cache, s, x.q[s][None, None]) for s in
                              range(cfg.batch)],
        "paged": lambda: paged_attention(x.q, *layer, x.block_tables, x.seq_lens),
        "paged-whole-batch": lambda: paged_attention(x.q, *layer, x.block_tables, x.seq_lens,
                                                   chunk_bytes=math.inf),
        "contiguous": lambda: contiguous_attention(x.q[:, :, None], x.k, x.v),
    }
    nbytes = kv_bytes(x.seq_lens, cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype])
    limits = {impl: max(3, repeats // 4) if impl == "reference" else repeats for impl in impls}
    timings = time_interleaved({impl: fns[impl] for impl in impls}, limits, min_time, cfg.device)
    return [_row(cfg, "decode", impl, timings[impl], nbytes) for impl in impls]


def prefill_rows(cfg: AttentionConfig, repeats: int = 10, min_time: float = 0.5) -> list[dict[str, Any]]:
    """Time causal attention over one prompt of ``cfg.context`` tokens already written to the cache:
    ``paged_prefill_attention`` vs contiguous SDPA with ``is_causal``. (``cfg.batch`` is ignored.)"""
    cfg = replace(cfg, batch=1)
    x = make_inputs(cfg)
    g = torch.Generator().manual_seed(1)
    qp = torch.randn(cfg.context, cfg.q_heads, cfg.head_dim, generator=g).to(cfg.device, DTYPES[cfg.dtype])
    layer = x.cache.layer(0)
    fns = {
        "paged": lambda: paged_prefill_attention(qp, *layer, x.block_tables[0], cfg.context),
        "contiguous": lambda: contiguous_attention(qp.transpose(0, 1)[None], x.k, x.v, causal=True),
    }
    nbytes = kv_bytes(x.seq_lens, cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype])
    timings = time_interleaved(fns, dict.fromkeys(fns, repeats), min_time, cfg.device)
    return [_row(cfg, "prefill", impl, t, nbytes) for impl, t in timings.items()]


def block_size_sweep(cfg: AttentionConfig, block_sizes: list[int], **kw: Any) -> list[dict[str, Any]]:
    """Decode, paged vs contiguous, for each block size (contiguous does not depend on it: a control)."""
    rows = []
    for bs in block_sizes:
        rows += decode_rows(replace(cfg, block_size=bs), impls=("paged", "contiguous"), **kw)
    return _add_ratios(rows)


def context_sweep(cfg: AttentionConfig, contexts: list[int], **kw: Any) -> list[dict[str, Any]]:
    """Decode, paged vs contiguous, for each context length."""
    rows = []
    for n in contexts:
        rows += decode_rows(replace(cfg, context=n), impls=("paged", "contiguous"), **kw)
    return _add_ratios(rows)


def run(cfg: AttentionConfig, block_sizes: list[int], contexts: list[int], repeats: int = 20,
        min_time: float = 0.5, sweeps: bool = True) -> dict[str, Any]:
    """The whole benchmark: decode at batch 1 and ``cfg.batch`` (reference, paged, paged-whole-batch,
    contiguous), prefill, and the block-size and context sweeps. Returns rows grouped by table."""
    kw = {"repeats": repeats, "min_time": min_time}
    impls = ("reference", "paged", "paged-whole-batch", "contiguous")
    decode = decode_rows(replace(cfg, batch=1), impls=impls, **kw)
    if cfg.batch != 1:
        decode += decode_rows(cfg, impls=impls, **kw)
    result: dict[str, Any] = {
        "environment": {**environment(cfg.device), "load_average": os.getloadavg()},
        "config": asdict(cfg),
        "timing": "median of calls interleaved between implementations, caches flushed before each call",
        "decode": _add_ratios(decode),
        "prefill": _add_ratios(prefill_rows(cfg, repeats=max(3, repeats // 2), min_time=min_time)),
    }
    if sweeps:
        result["block_size_sweep"] = block_size_sweep(cfg, block_sizes, **kw)
        result["context_sweep"] = context_sweep(cfg, contexts, **kw)
    return result


QUICK = {"batch": 4, "context": 256, "block_sizes": [1, 4, 16, 64], "contexts": [64, 256, 1024],
         "repeats": 7, "min_time": 0.05}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AttentionConfig()
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=None, help=f"sequences per decode step ({d.batch})")
    parser.add_argument("--context", type=int, default=None, help=f"tokens per sequence ({d.context})")
    parser.add_argument("--q-heads", type=int, default=d.q_heads)
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads)
    parser.add_argument("--head-dim", type=int, default=d.head_dim)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=None,
                        help="block-size sweep (default: 1 2 4 ... 128)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="context sweep (default: 128 256 ... 4096)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (20)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-sweeps", action="store_true", help="only the decode and prefill tables")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few repeats (seconds, for notebooks and smoke tests)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def main(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = dict(QUICK) if args.quick else {}
    d = AttentionConfig()
    cfg = AttentionConfig(
        batch=args.batch or quick.get("batch", d.batch),
        context=args.context or quick.get("context", d.context),
        q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
        dtype=args.dtype, device=device)
    block_sizes = args.block_sizes or quick.get("block_sizes", [1, 2, 4, 8, 16, 32, 64, 128])
    contexts = args.contexts or quick.get("contexts", [128, 256, 512, 1024, 2048, 4096])
    result = run(cfg, block_sizes, contexts, repeats=args.repeats or quick.get("repeats", 20),
                 min_time=quick.get("min_time", 0.5), sweeps=not args.no_sweeps)
    env = result["environment"]
    print(f"device {device} ({env.get('device_name', env['processor'])}), torch {env['torch']}, "
          f"{env['torch_threads']} threads, load average {env['load_average'][0]:.1f}; {cfg.dtype}, "
          f"q_heads {cfg.q_heads}, kv_heads {cfg.kv_heads}, "
          f"head_dim {cfg.head_dim}; decode batch 1 and {cfg.batch}, prefill 1 prompt; "
          f"every sequence {cfg.context} tokens unless swept; {result['timing']}\n")
    titles = {"decode": f"decode (one layer, block size {cfg.block_size})",
              "prefill": f"prefill (causal, one prompt, block size {cfg.block_size})",
              "block_size_sweep": f"decode vs block size (batch {cfg.batch}, context {cfg.context})",
              "context_sweep": f"decode vs context length (batch {cfg.batch}, block size {cfg.block_size})"}
    for name, title in titles.items():
        if name in result:
            print_table(result[name], COLUMNS, title=title)
            print()
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
