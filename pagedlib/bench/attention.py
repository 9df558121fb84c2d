"""``python -m pagedlib.bench attention``: per-token reference vs vectorized paged vs contiguous SDPA.

Decode (one new token per sequence, a batch of sequences) and prefill (causal attention over one prompt)
are measured separately. Every figure is the median of repeated calls, interleaved between the
implementations and with the caches flushed before each call; GB/s is the bytes of K and V that must be
read (``kernels.attention.kv_bytes``: every cached token once) divided by that time, and ``speedup vs SDPA
(x faster)`` is contiguous SDPA's time divided by the row's (> 1: faster).

Decode rows: ``reference`` (the per-token loop), ``paged`` (``paged_attention`` with its default chunks),
``paged-whole-batch`` (the whole batch in one chunk, ``chunk_bytes=math.inf``), ``pagedlib-fused`` (on a
CPU where a C compiler builds it: pagedlib's fused CPU kernel, ``kernels/cpu_varlen.c``, reading the blocks
in place; in the prefill and mixed tables too) and ``contiguous``. The
paged pool is fragmented on purpose: blocks are handed out in a random order, as in a server that has
been running for a while, so a sequence's blocks are scattered over the pool.

Mixed rows (notebook 09): one layer of a step that holds ``batch - 1`` decodes and one prefill chunk,
the last ``chunk`` of the last sequence's ``context`` tokens. ``varlen`` is ``paged_attention_varlen``
(one call for the whole step), ``split`` the two calls of a phase-separated engine (``paged_attention``
for the decodes, ``paged_prefill_attention`` for the chunk), ``contiguous`` SDPA on contiguous copies, two
calls (the chunk with a causal mask aligned to its last positions).

vLLM rows (``--vllm-batches``, ``--vllm-contexts``; ``--no-vllm`` leaves them out): vLLM 0.32.0's fused CPU
paged-attention kernel on the same pool contents, at a block size its CPU backend takes (a multiple of 32),
timed in a process of its own (``bench/vllm_attention.py``) beside ``pagedlib-fused``, ``paged``,
``contiguous`` and ``copy`` (a plain copy of the contiguous K and V: those bytes read and written once, the
memory's own pace), so each ratio is measured side by side; ``same_output``: each fused kernel's result
equals the float64 oracle (max abs error at most 1e-5 in fp32).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pagedlib.bench.timing import (
    DTYPES,
    Timing,
    add_run_arguments,
    check_fits,
    default_device,
    environment,
    int_list,
    memory_bytes,
    num_threads,
    positive_int,
    print_table,
    speedup,
    time_once,
    write_json,
)
from pagedlib.child import ChildError, run_child
from pagedlib.core.cache import PagedKVCache
from pagedlib.kernels.attention import (
    contiguous_attention,
    kv_bytes,
    paged_attention,
    paged_prefill_attention,
    reference_paged_attention,
    sliding_window_mask,
)
from pagedlib.kernels.cpu_varlen import attend_cpu, cpu_kernel_available, paged_attention_varlen_cpu
from pagedlib.kernels.varlen import paged_attention_varlen
from pagedlib.util import ceil_div

SPEEDUP = "speedup vs SDPA (x faster)"  # contiguous SDPA's time / the row's time, at the same point
COLUMNS = ["phase", "impl", "batch", "context", "block_size", "ms", "GB/s", SPEEDUP, "spread"]
MIXED_COLUMNS = ["impl", "batch", "context", "chunk", "ms", "GB/s", SPEEDUP, "spread"]
DECODE_IMPLS = ("reference", "paged", "paged-whole-batch", "pagedlib-fused", "contiguous")
FUSED = "pagedlib-fused"  # pagedlib's fused CPU kernel (attention="cpu")
VLLM_COLUMNS = COLUMNS + ["max_abs_error", "same_output"]
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32.0's CPU backend takes


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


def make_inputs(cfg: AttentionConfig, seed: int = 0) -> dict[str, Any]:
    """A fragmented single-layer pool holding ``batch`` sequences of ``context`` tokens, the same K/V laid
    out contiguously (``k``, ``v`` ``[batch, kv_heads, context, head_dim]``), one query per sequence
    (``q``), the tables and lengths."""
    g = torch.Generator().manual_seed(seed)
    dtype, dev = DTYPES[cfg.dtype], torch.device(cfg.device)
    num_blocks = cfg.batch * ceil_div(cfg.context, cfg.block_size)
    cache = PagedKVCache(num_blocks, 1, cfg.block_size, cfg.kv_heads, cfg.head_dim, dtype=dtype, device=dev,
                         free_order=torch.randperm(num_blocks, generator=g).tolist(), fill=float("nan"))
    seqs = list(range(cfg.batch))
    for s in seqs:
        cache.add_sequence(s)
        k, v = torch.randn(2, 1, cfg.context, cfg.kv_heads, cfg.head_dim, generator=g).to(dev, dtype)
        cache.append_tokens(s, k, v)
    k, v = (torch.cat([cache.gather(s)[i] for s in seqs]).transpose(1, 2).contiguous() for i in (0, 1))
    q = torch.randn(cfg.batch, cfg.q_heads, cfg.head_dim, generator=g).to(dev, dtype)
    return {"cache": cache, "q": q, "tables": cache.block_table(seqs), "lens": cache.seq_lens_tensor(seqs),
            "k": k, "v": v}


_FLUSH: dict[str, torch.Tensor] = {}


def flush_caches(device: str, nbytes: int = 64 * 2**20) -> None:
    """Overwrite ``nbytes`` (more than a CPU's last-level cache or a GPU's L2), so that the next call
    reads its K/V from memory, as a decode step does after the rest of the model ran."""
    if device not in _FLUSH:
        _FLUSH[device] = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    _FLUSH[device].fill_(1.0)


def time_interleaved(fns: dict[str, Callable[[], Any]], repeats: dict[str, int],
                     device: str) -> dict[str, Timing]:
    """Time several callables in rounds, one call of each per round (after one warm-up call each), so
    that load from other processes hits all of them alike; each round starts with the next callable.
    ``fns[name]`` is timed ``repeats[name]`` times; caches are flushed (untimed) before every call."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    names = list(fns)
    for r in range(max(repeats.values())):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if r < repeats[name]:
                flush_caches(device)
                samples[name].append(time_once(fns[name], device))
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def _rows(cfg: AttentionConfig, phase: str, timings: dict[str, Timing], nbytes: int) -> list[dict[str, Any]]:
    """One row per implementation; ``SPEEDUP`` relative to ``contiguous`` of the same call."""
    base = timings["contiguous"].median
    return [{"phase": phase, "impl": impl, "batch": cfg.batch, "context": cfg.context,
             "block_size": cfg.block_size, "ms": t.median * 1e3, "GB/s": nbytes / t.median / 1e9,
             SPEEDUP: speedup(base, t.median), "spread": t.spread, "samples": len(t.samples)}
            for impl, t in timings.items()]


def one_token_each(cfg: AttentionConfig) -> torch.Tensor:
    """``query_start_loc`` of a decode step: one new token per sequence."""
    return torch.arange(cfg.batch + 1, dtype=torch.int32, device=cfg.device)


def fused_call(cfg: AttentionConfig, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor, qsl: torch.Tensor) -> Callable[[], Any] | None:
    """pagedlib's fused CPU kernel on these varlen arguments, its checks made once here, not timed (as the
    engine calls it); ``None`` off the CPU or where no C compiler builds it."""
    if cfg.device != "cpu" or not cpu_kernel_available()[0]:
        return None
    paged_attention_varlen_cpu(q, k_cache, v_cache, tables, lens, qsl)       # checks the arguments
    return lambda: attend_cpu(q, k_cache, v_cache, tables, lens, qsl, cfg.head_dim ** -0.5)


def decode_rows(cfg: AttentionConfig, impls: tuple[str, ...] = DECODE_IMPLS, repeats: int = 20) -> list[dict]:
    """Time one decode step (one layer) of ``cfg.batch`` sequences with each implementation in ``impls``
    (``contiguous`` is always timed: it is the baseline of ``SPEEDUP``)."""
    x = make_inputs(cfg)
    layer = x["cache"].layer(0)
    args = (x["q"], *layer, x["tables"], x["lens"])
    fns = {
        "reference": lambda: [reference_paged_attention(x["cache"], s, x["q"][s][None, None])
                              for s in range(cfg.batch)],
        "paged": lambda: paged_attention(*args),
        "paged-whole-batch": lambda: paged_attention(*args, chunk_bytes=math.inf),
        "contiguous": lambda: contiguous_attention(x["q"][:, :, None], x["k"], x["v"]),
        FUSED: fused_call(cfg, x["q"], *layer, x["tables"], x["lens"], one_token_each(cfg)),
    }
    impls = tuple(dict.fromkeys(i for i in (*impls, "contiguous") if fns[i] is not None))
    limits = {impl: max(3, repeats // 4) if impl == "reference" else repeats for impl in impls}
    timings = time_interleaved({impl: fns[impl] for impl in impls}, limits, cfg.device)
    return _rows(cfg, "decode", timings, kv_bytes(x["lens"], cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype]))


def prefill_rows(cfg: AttentionConfig, repeats: int = 10) -> list[dict[str, Any]]:
    """Time causal attention over one prompt of ``cfg.context`` tokens already written to the cache:
    ``paged_prefill_attention`` vs contiguous SDPA with ``is_causal``. (``cfg.batch`` is ignored.)"""
    cfg = replace(cfg, batch=1)
    x = make_inputs(cfg)
    g = torch.Generator().manual_seed(1)
    qp = torch.randn(cfg.context, cfg.q_heads, cfg.head_dim, generator=g).to(cfg.device, DTYPES[cfg.dtype])
    qsl = torch.tensor([0, cfg.context], dtype=torch.int32, device=cfg.device)
    fns = {"paged": lambda: paged_prefill_attention(qp, *x["cache"].layer(0), x["tables"][0], cfg.context),
           FUSED: fused_call(cfg, qp, *x["cache"].layer(0), x["tables"], x["lens"], qsl),
           "contiguous": lambda: contiguous_attention(qp.transpose(0, 1)[None], x["k"], x["v"], causal=True)}
    fns = {name: fn for name, fn in fns.items() if fn is not None}
    timings = time_interleaved(fns, dict.fromkeys(fns, repeats), cfg.device)
    return _rows(cfg, "prefill", timings, kv_bytes(x["lens"], cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype]))


def mixed_rows(cfg: AttentionConfig, chunk: int, repeats: int = 10) -> list[dict[str, Any]]:
    """Time one layer of a mixed step (see the module docstring): ``cfg.batch - 1`` decodes of
    ``cfg.context`` tokens and a prefill chunk of ``chunk`` new tokens (``chunk <= cfg.context``)."""
    x, d = make_inputs(cfg), cfg.batch - 1
    (k_cache, v_cache), tables, lens, k, v = x["cache"].layer(0), x["tables"], x["lens"], x["k"], x["v"]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(d + chunk, cfg.q_heads, cfg.head_dim, generator=g).to(cfg.device, DTYPES[cfg.dtype])
    qsl = torch.tensor([*range(d + 1), d + chunk], dtype=torch.int32, device=cfg.device)   # [batch + 1]
    mask = sliding_window_mask(chunk, cfg.context, cfg.context, device=cfg.device)  # [chunk, context]
    qc = q[d:].transpose(0, 1)[None]                                           # [1, q_heads, chunk, D]

    def split() -> None:
        if d:
            paged_attention(q[:d], k_cache, v_cache, tables[:d], lens[:d])
        paged_prefill_attention(q[d:], k_cache, v_cache, tables[d], cfg.context)

    def contiguous() -> None:
        if d:
            contiguous_attention(q[:d, :, None], k[:d], v[:d])
        torch.nn.functional.scaled_dot_product_attention(qc, k[d:], v[d:], attn_mask=mask, enable_gqa=True)

    fns = {"varlen": lambda: paged_attention_varlen(q, k_cache, v_cache, tables, lens, qsl), "split": split,
           FUSED: fused_call(cfg, q, k_cache, v_cache, tables, lens, qsl), "contiguous": contiguous}
    fns = {name: fn for name, fn in fns.items() if fn is not None}
    timings = time_interleaved(fns, dict.fromkeys(fns, repeats), cfg.device)
    rows = _rows(cfg, "mixed", timings, kv_bytes(lens, cfg.kv_heads, cfg.head_dim, DTYPES[cfg.dtype]))
    return [{**r, "chunk": chunk} for r in rows]


def sweep(cfg: AttentionConfig, field: str, values: list[int], repeats: int = 20) -> list[dict[str, Any]]:
    """Decode, paged vs contiguous, for each value of ``field`` (``"block_size"`` or ``"context"``).
    Contiguous SDPA does not depend on the block size: there it is a control."""
    return [row for value in values
            for row in decode_rows(replace(cfg, **{field: value}), ("paged",), repeats)]


def vllm_points(cfg: AttentionConfig, batches: list[int], contexts: list[int],
                memory: int) -> tuple[list[AttentionConfig], list[str]]:
    """The points of the vLLM table: ``cfg`` at each batch and context, at a block size vLLM's CPU backend
    takes (``cfg.block_size`` if a multiple of 32, else 32), those whose pools fit in ``memory`` bytes (with
    vLLM's copy); and a sentence for each point or setting left out."""
    from pagedlib.vllm.bridge import vllm_available

    ok, why = vllm_available()
    if not ok:
        return [], [f"no vLLM row: {why}"]
    if cfg.device != "cpu" or cfg.dtype not in ("float32", "bfloat16") or cfg.head_dim not in VLLM_HEAD_DIMS:
        return [], [f"no vLLM row: its CPU kernel takes float32 or bfloat16 on the CPU and head_dim in "
                    f"{VLLM_HEAD_DIMS}, this run is {cfg.dtype} on {cfg.device}, head_dim {cfg.head_dim}"]
    block_size = cfg.block_size if cfg.block_size % 32 == 0 else 32
    points, skipped = [], []
    for batch in batches:
        for context in contexts:
            point = replace(cfg, batch=batch, context=context, block_size=block_size)
            if point_bytes(point, 0) * 5 // 4 > memory:  # the pool, the copies, and vLLM's own cache
                skipped.append(f"vLLM row at batch {batch}, context {context} left out: it needs about "
                               f"{point_bytes(point, 0) * 5 / 4 / 2**30:.1f} GiB")
            else:
                points.append(point)
    return points, skipped


VLLM_CHILD = "pagedlib.bench.vllm_attention"   # the process vLLM's kernel is timed in (``python -m``)


def vllm_rows(points: list[AttentionConfig], repeats: int, threads: int,
              timeout: float = 3600.0) -> list[dict[str, Any]]:
    """Time vLLM's fused CPU kernel at ``points`` in a process of its own (``bench/vllm_attention.py``,
    started and guarded by ``pagedlib.child``), with pagedlib's ``paged``, contiguous SDPA and a copy measured
    beside it there; ``RuntimeError`` with the child's last words if it fails, ``TimeoutError`` (the child
    stopped) after ``timeout`` seconds."""
    if not points:
        return []
    request = {"points": [asdict(p) for p in points], "repeats": repeats, "threads": threads}
    try:
        answer = run_child(VLLM_CHILD, request, timeout)
    except ChildError as error:
        raise RuntimeError(f"the vLLM attention process failed: {error}") from None
    return [{**row, "vllm": answer["vllm"]} for row in answer["rows"]]


def run(cfg: AttentionConfig, block_sizes: list[int], contexts: list[int], repeats: int = 20,
        sweeps: bool = True, chunks: list[int] | None = None,
        vllm: list[AttentionConfig] | None = None) -> dict[str, Any]:
    """The whole benchmark: decode at batch 1 and ``cfg.batch``, prefill, mixed steps with prefill chunks
    of ``chunks`` tokens (default: a quarter of the context and all of it), and (with ``sweeps``) the
    block-size and context sweeps. Returns rows grouped by table, with the environment."""
    decode = decode_rows(replace(cfg, batch=1), repeats=repeats)
    if cfg.batch != 1:
        decode += decode_rows(cfg, repeats=repeats)
    result: dict[str, Any] = {"environment": environment(cfg.device),
                              "config": asdict(cfg), "decode": decode,
                              "prefill": prefill_rows(cfg, repeats=max(3, repeats // 2))}
    chunks = chunks or [max(1, cfg.context // 4), cfg.context]
    result["mixed"] = [r for c in chunks for r in mixed_rows(cfg, c, repeats=max(3, repeats // 2))]
    if sweeps:
        result["block_size_sweep"] = sweep(cfg, "block_size", block_sizes, repeats)
        result["context_sweep"] = sweep(cfg, "context", contexts, repeats)
    if vllm:
        result["vllm"] = vllm_rows(vllm, repeats, torch.get_num_threads())
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AttentionConfig()
    parser.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPES))
    for name in ("batch", "context", "q_heads", "kv_heads", "head_dim", "block_size"):
        parser.add_argument("--" + name.replace("_", "-"), type=positive_int, default=getattr(d, name))
    parser.add_argument("--block-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32, 64, 128],
                        help="block sizes of the sweep, comma-separated")
    parser.add_argument("--contexts", type=int_list, default=[128, 256, 512, 1024, 2048, 4096],
                        help="contexts of the sweep, comma-separated")
    parser.add_argument("--chunks", type=int_list, default=None,
                        help="prefill chunks of the mixed table, comma-separated, each <= --context "
                             "(default: context/4 and context)")
    parser.add_argument("--no-sweeps", action="store_true", help="only the decode, prefill and mixed tables")
    parser.add_argument("--vllm-batches", type=int_list, default=[1, 16, 64],
                        help="batches of the vLLM table (vLLM's fused CPU kernel beside pagedlib's paths)")
    parser.add_argument("--vllm-contexts", type=int_list, default=[512, 1024, 8192],
                        help="contexts of the vLLM table, comma-separated")
    parser.add_argument("--no-vllm", action="store_true", help="leave out the vLLM table")
    add_run_arguments(parser, repeats=20, repeats_help="timed calls per implementation")
    parser.set_defaults(usage_error=parser.error)  # for main: combinations are usage errors too


def point_bytes(cfg: AttentionConfig, chunk: int) -> int:
    """About the most memory one benchmark point holds at once (an upper bound): the pool, the contiguous
    copy of K and V, the gathered K and V of one call and the mask of a mixed step's chunk."""
    token_bytes = 2 * cfg.kv_heads * cfg.head_dim * DTYPES[cfg.dtype].itemsize  # K and V of one token
    padded = ceil_div(cfg.context, cfg.block_size) * cfg.block_size
    return 4 * cfg.batch * padded * token_bytes + chunk * cfg.context


def peak_bytes(cfg: AttentionConfig, block_sizes: list[int], contexts: list[int], chunks: list[int],
               sweeps: bool) -> int:
    """The largest ``point_bytes`` of the run ``run(cfg, ...)`` would make."""
    points = [point_bytes(cfg, max(chunks))]
    if sweeps:
        points += [point_bytes(replace(cfg, block_size=size), 0) for size in block_sizes]
        points += [point_bytes(replace(cfg, context=context), 0) for context in contexts]
    return max(points)


def main(args: argparse.Namespace) -> int:
    usage_error = vars(args).pop("usage_error")
    if args.q_heads % args.kv_heads:
        usage_error(f"--q-heads ({args.q_heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.chunks and max(args.chunks) > args.context:
        usage_error(f"argument --chunks: each chunk must be <= --context ({args.context}), got "
                    f"{max(args.chunks)}")
    cfg = AttentionConfig(args.batch, args.context, args.q_heads, args.kv_heads, args.head_dim,
                          args.block_size, args.dtype, default_device(args.device))
    chunks = args.chunks or [args.context]
    check_fits(peak_bytes(cfg, args.block_sizes, args.contexts, chunks, not args.no_sweeps),
               "this run (--batch, --context, --contexts, --block-sizes, --kv-heads, --head-dim)", cfg.device,
               usage_error)
    points, skipped = [], []
    if not args.no_vllm:
        points, skipped = vllm_points(cfg, args.vllm_batches, args.vllm_contexts, memory_bytes(cfg.device))
    with num_threads(args.threads):
        result = run(cfg, args.block_sizes, args.contexts, args.repeats, sweeps=not args.no_sweeps,
                     chunks=args.chunks, vllm=points)
    env = result["environment"]
    print(f"{cfg.device} ({env.get('device_name', env['processor'])}), torch {env['torch']}, "
          f"{env['torch_threads']} threads, load average {env['load_average'][0]:.1f}; {asdict(cfg)}; "
          f"medians of interleaved calls, caches flushed; {SPEEDUP} = contiguous SDPA's time / the row's\n")
    titles = {"decode": "decode (one layer)", "prefill": "prefill (causal, one prompt)",
              "mixed": "mixed step (one layer): batch - 1 decodes + one prefill chunk",
              "block_size_sweep": "decode vs block size", "context_sweep": "decode vs context",
              "vllm": "decode (one layer) in vLLM's process: its fused CPU kernel, pagedlib's fused CPU "
                      "kernel and gather path, SDPA, a copy of K and V; same_output: a fused kernel's result "
                      "equals the float64 oracle"}
    columns = {"mixed": MIXED_COLUMNS, "vllm": VLLM_COLUMNS}
    for name in [n for n in titles if n in result]:
        print_table(result[name], columns.get(name, COLUMNS), title=titles[name])
        print()
    for sentence in skipped:
        print(sentence)
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
