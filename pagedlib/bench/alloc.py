"""``python -m pagedlib.bench alloc``: how fast tokens get *into* the paged cache.

Decode (one new token for each of ``batch`` sequences):
  - ``append_token``  one call per sequence (Python bookkeeping + one small write each);
  - ``append_batch``  one call: bookkeeping for all, then one indexed write per pool via flat slot ids;
  - ``contiguous``    a pre-allocated ``[L, batch, max_len, H, D]`` cache written at one position
                      (what a non-paged cache does; no bookkeeping at all);
  - ``copy_``         a plain ``copy_`` of the same bytes between two contiguous buffers: the physical
                      limit for writing this much data.
Prefill (one prompt of ``--prompt`` tokens): ``append_token`` in a loop, ``append_tokens`` once,
``contiguous`` (a slice write) and ``copy_``.

Bytes written per step: ``2 (K and V) * layers * tokens * kv_heads * head_dim * dtype_bytes``. Each
method's bandwidth is those bytes over its best time (the best of ``--repeats`` calls: on a shared machine
the median picks up other processes' time slices), ``% of copy_`` is ``time(copy_) / time(method)``, and
``x faster than append_token`` is ``time(append_token) / time(method)`` (> 1 is faster).
The decode pool is sized for the whole run and handed out in a shuffled order, so a batch's blocks are
scattered over the pool as they are in a long-running server.
"""

from __future__ import annotations

import argparse
import itertools
import random
from typing import Any

import torch

from pagedlib.bench.timing import (
    DTYPES,
    add_run_arguments,
    check_fits,
    default_device,
    environment,
    int_list,
    non_negative_int,
    num_threads,
    positive_int,
    print_table,
    time_fn,
    write_json,
)
from pagedlib.core.cache import PagedKVCache
from pagedlib.testing import check_invariants
from pagedlib.util import ceil_div

COLUMNS = ["phase", "method", "tokens", "us_per_call", "tokens_per_s", "GB_per_s", "pct_of_copy",
           "x_faster_than_append_token"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=8)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--batches", type=int_list, default=[1, 4, 16, 64, 256],
                   help="decode batch sizes, comma-separated")
    p.add_argument("--prompt", type=non_negative_int, default=512,
                   help="prefill length in tokens (0 to skip)")
    add_run_arguments(p, repeats=20, repeats_help="timed calls per measurement")
    p.set_defaults(usage_error=p.error)  # for main: a run too large for the machine is a usage error too


def peak_bytes(args: argparse.Namespace) -> int:
    """About the most memory the run holds at once, from the flags alone (an upper bound)."""
    token_bytes = 2 * args.layers * args.kv_heads * args.head_dim * DTYPES[args.dtype].itemsize  # K and V
    steps = 3 + args.repeats  # warm-up and timed decode steps
    # decode: two pools (the next is built before the last is freed), rounded up to whole blocks, and the
    # contiguous yardstick; each sequence starts at up to 2 blocks of tokens
    decode_tokens = 3 * max(args.batches) * (3 * args.block_size + steps)
    # prefill: the prompt's pool, its K/V, the contiguous yardstick and the two buffers of copy_
    prefill_tokens = 5 * (args.prompt + args.block_size)
    return max(decode_tokens, prefill_tokens) * token_bytes

def _rows(phase: str, tokens: int, nbytes: int, times: dict[str, float]) -> list[dict[str, Any]]:
    return [{"phase": phase, "method": method, "tokens": tokens, "us_per_call": t * 1e6,
             "tokens_per_s": tokens / t, "GB_per_s": nbytes / t / 1e9,
             "pct_of_copy": 100 * times["copy_"] / t, "x_faster_than_append_token": times["append_token"] / t}
            for method, t in times.items()]


def _baselines(k: torch.Tensor, v: torch.Tensor, max_len: int, start: int, **timing: Any) -> dict[str, float]:
    """Best times of the two yardsticks for writing ``k``, ``v`` (``[L, batch, n, H, D]``): a contiguous
    ``[L, batch, max_len, H, D]`` cache written at positions ``start, start + n, ...`` in turn (no
    bookkeeping at all), and a plain ``copy_`` of the same bytes."""
    kc = k.new_zeros(k.shape[0], k.shape[1], max_len, *k.shape[3:])
    vc = torch.zeros_like(kc)
    positions = itertools.cycle(range(start, max_len - k.shape[2] + 1, k.shape[2]))

    def contiguous() -> None:
        t = next(positions)
        kc[:, :, t : t + k.shape[2]] = k
        vc[:, :, t : t + k.shape[2]] = v

    src = torch.stack([k, v])
    dst = torch.empty_like(src)
    return {"contiguous": time_fn(contiguous, **timing).best,
            "copy_": time_fn(lambda: dst.copy_(src), **timing).best}


def bench_decode(batch: int, *, layers: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: str, repeats: int, warmup: int = 3,
                 seed: int = 0) -> list[dict[str, Any]]:
    """Time one decode step for ``batch`` sequences, each method on its own cache."""
    steps, rng = warmup + repeats, random.Random(seed)
    start_lens = [rng.randint(1, 2 * block_size) for _ in range(batch)]  # offsets differ per sequence
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, batch, kv_heads, head_dim, generator=g).to(device, dtype)  # [L, batch, H, D]
    v = torch.randn(layers, batch, kv_heads, head_dim, generator=g).to(device, dtype)
    ids = list(range(batch))
    k_rows, v_rows = [k[:, i] for i in ids], [v[:, i] for i in ids]  # [L, H, D], sliced outside the timing

    def fresh_cache() -> PagedKVCache:  # blocks handed out in a shuffled order, as in a long-running server
        order = list(range(sum(ceil_div(n + steps, block_size) for n in start_lens)))
        rng.shuffle(order)
        cache = PagedKVCache(len(order), layers, block_size, kv_heads, head_dim, dtype=dtype, device=device,
                             free_order=order)
        for s, n in zip(ids, start_lens):
            cache.add_sequence(s)
            cache.append_tokens(s, k[:, s : s + 1].expand(-1, n, -1, -1).contiguous(),
                                v[:, s : s + 1].expand(-1, n, -1, -1).contiguous())
        return cache

    methods = {"append_token": lambda c: [c.append_token(i, k_rows[i], v_rows[i]) for i in ids],
               "append_batch": lambda c: c.append_batch(ids, k, v)}
    times: dict[str, float] = {}
    for name, step in methods.items():
        cache = fresh_cache()  # the previous pool is released here
        timing = time_fn(lambda c=cache, f=step: f(c), repeats=repeats, warmup=warmup, device=device)
        times[name] = timing.best
        check_invariants(cache)
    cache = None
    times |= _baselines(k[:, :, None], v[:, :, None], max(start_lens) + steps, max(start_lens),
                        repeats=repeats, warmup=warmup, device=device)
    return _rows("decode", batch, 2 * k.numel() * k.element_size(), times)


def bench_prefill(n: int, *, layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                  device: str, repeats: int, warmup: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    """Time writing one ``n``-token prompt (each timed call adds a sequence, fills it, frees it)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, n, kv_heads, head_dim, generator=g).to(device, dtype)  # [L, n, H, D]
    v = torch.randn(layers, n, kv_heads, head_dim, generator=g).to(device, dtype)
    cache = PagedKVCache(ceil_div(n, block_size), layers, block_size, kv_heads, head_dim, dtype=dtype,
                         device=device)
    k_rows, v_rows = [k[:, i] for i in range(n)], [v[:, i] for i in range(n)]

    def per_token() -> None:
        cache.add_sequence(0)
        for i in range(n):
            cache.append_token(0, k_rows[i], v_rows[i])
        cache.free_sequence(0)

    def prompt() -> None:
        cache.add_sequence(0)
        cache.append_tokens(0, k, v)
        cache.free_sequence(0)

    times = {
        "append_token": time_fn(per_token, repeats=max(3, repeats // 4), warmup=1, device=device).best,
        "append_tokens": time_fn(prompt, repeats=repeats, warmup=warmup, device=device).best,
    }
    times |= _baselines(k[:, None], v[:, None], n, 0, repeats=repeats, warmup=warmup, device=device)
    return _rows("prefill", n, 2 * k.numel() * k.element_size(), times)


def run(*, layers: int = 4, kv_heads: int = 8, head_dim: int = 64, block_size: int = 16,
        dtype: torch.dtype = torch.float32, device: str | None = None,
        batches: tuple[int, ...] = (1, 4, 16, 64, 256), prompt: int = 512,
        repeats: int = 20, threads: int | None = None) -> dict[str, Any]:
    """Run the whole benchmark with ``threads`` torch threads (on a busy CPU, a multi-threaded ``copy_``
    can wait milliseconds for a descheduled worker); returns ``{"config", "environment", "rows", "summary"}``.
    """
    device = default_device(device)
    geometry = dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                    device=device, repeats=repeats)
    with num_threads(threads):
        env = environment(device)
        rows: list[dict[str, Any]] = []
        for b in batches:
            rows += bench_decode(b, **geometry)
        if prompt:
            rows += bench_prefill(prompt, **geometry)
    config = dict(geometry, batches=list(batches), prompt=prompt, threads=env["torch_threads"])
    return {"config": config, "environment": env, "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict[str, Any]]) -> str:
    """One sentence on the largest decode batch: speedup over per-token appends, fraction of ``copy_``."""
    decode = [r for r in rows if r["phase"] == "decode"]
    if not decode:
        return ""
    b = max(r["tokens"] for r in decode)
    by = {r["method"]: r for r in decode if r["tokens"] == b}
    ab = by["append_batch"]
    return (f"decode, batch {b}: append_batch is {ab['x_faster_than_append_token']:.1f}x faster than {b} "
            f"append_token calls; it writes {ab['GB_per_s']:.2f} GB/s = {ab['pct_of_copy']:.0f}% of a plain "
            f"copy_ of the same bytes ({by['copy_']['GB_per_s']:.2f} GB/s)")


def main(args: argparse.Namespace) -> int:
    usage_error = vars(args).pop("usage_error")
    device = default_device(args.device)
    check_fits(peak_bytes(args), "this run (--batches, --prompt, --block-size, --layers, --kv-heads, "
               "--head-dim)", device, usage_error)
    batches = tuple(args.batches)
    result = run(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                 block_size=args.block_size, dtype=DTYPES[args.dtype], device=device, batches=batches,
                 prompt=args.prompt, repeats=args.repeats, threads=args.threads)
    c = result["config"]
    title = (f"KV-cache writes: layers={c['layers']} kv_heads={c['kv_heads']} head_dim={c['head_dim']} "
             f"block_size={c['block_size']} {args.dtype} on {c['device']}, {c['threads']} CPU threads "
             f"(best of {c['repeats']} calls)")
    print_table(result["rows"], COLUMNS, title=title)
    print(result["summary"])
    if args.json:
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
