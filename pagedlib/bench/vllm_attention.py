"""vLLM's fused CPU paged-attention kernel, timed beside pagedlib's decode paths in a process of its own.

``bench attention`` runs ``python -m pagedlib.bench.vllm_attention`` through ``pagedlib.child``: one job, the
benchmark points, repeats and threads; its answer, vLLM's version and the rows. Importing vLLM switches
Triton out of its interpreter and logs to the console, so it never happens in the caller's process (as
``vllm.bridge`` keeps vLLM in a worker).

For each point the child builds the same fragmented pool as ``bench attention`` (``make_inputs``, same seed),
writes every sequence's K/V once into vLLM 0.32.0's CPU layout (untimed): the per-layer cache ``[num_blocks,
kv_heads, block_size, 2 * head_dim]`` seen as ``[num_blocks, kv_heads, 2 * block_size, head_dim]`` and cut
into K and V halves on that dimension, filled by ``cpu_attn_reshape_and_cache``, whose inner order depends on
the ISA (``vllm/v1/attention/backends/cpu_attn.py``). It then times, interleaved in this one process,
``cpu_attention_with_kv_cache`` (``vllm-fused``), pagedlib's fused CPU kernel (``pagedlib-fused``, on
pagedlib's own pool), its ``paged_attention``, contiguous SDPA and a plain copy of the contiguous K and V
(``copy``: those bytes read once and written once, the memory's own pace; its GB/s counts the bytes read, as
every row's does), and checks both fused kernels' outputs against the float64 oracle."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

import torch

from pagedlib.bench.attention import (
    FUSED,
    AttentionConfig,
    _rows,
    fused_call,
    make_inputs,
    one_token_each,
    time_interleaved,
)
from pagedlib.bench.timing import DTYPES
from pagedlib.child import serve
from pagedlib.kernels.attention import contiguous_attention, kv_bytes, paged_attention

TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}  # max abs error against the float64 oracle


def vllm_cache(x: dict[str, Any], cfg: AttentionConfig, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K/V written once into vLLM's CPU layout: its K and V halves (views of one cache)."""
    from vllm import _custom_ops as ops

    cache = x["cache"]
    num_blocks = cache.num_blocks
    layout = torch.zeros(num_blocks, cfg.kv_heads, cfg.block_size, 2 * cfg.head_dim, dtype=cache.dtype)
    layout = layout.view(num_blocks, cfg.kv_heads, 2 * cfg.block_size, cfg.head_dim)
    k_half, v_half = layout.chunk(2, dim=2)  # each [num_blocks, kv_heads, block_size, head_dim]
    for seq_id in range(cfg.batch):
        k, v = cache.gather(seq_id)  # [1, context, kv_heads, head_dim]: what the pool holds
        slots = torch.tensor(cache.manager.slots(seq_id), dtype=torch.long)
        ops.cpu_attn_reshape_and_cache(k[0].contiguous(), v[0].contiguous(), k_half, v_half, slots, isa)
    return k_half, v_half


def max_error(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """The largest absolute difference between ``out`` ``[batch, q_heads, head_dim]`` and the float64 oracle
    (SDPA on the contiguous ``k``, ``v`` in float64), one sequence at a time to bound the memory."""
    errors = [(out[b].double() - contiguous_attention(q[b:b + 1, :, None].double(), k[b:b + 1].double(),
                                                      v[b:b + 1].double())[0, :, 0]).abs().max().item()
              for b in range(q.shape[0])]
    return max(errors)


def point_rows(cfg: AttentionConfig, repeats: int) -> list[dict[str, Any]]:
    """The rows of one decode point: vLLM's fused kernel, ``paged``, ``contiguous`` and ``copy``."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = DTYPES[cfg.dtype]
    isa = _get_attn_isa(dtype, cfg.block_size, cfg.head_dim)
    x = make_inputs(cfg)
    k_half, v_half = vllm_cache(x, cfg, isa)
    q, tables, lens = x["q"], x["tables"], x["lens"]
    starts = torch.arange(cfg.batch + 1, dtype=torch.int32)  # one query token per sequence
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=cfg.batch, num_heads=cfg.q_heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
        seq_lens=lens, dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    out = torch.empty_like(q)

    def fused() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=k_half, value_cache=v_half, output=out, query_start_loc=starts, seq_lens=lens,
            scale=cfg.head_dim ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=tables, softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return out

    layer = x["cache"].layer(0)
    copies = torch.empty_like(x["k"]), torch.empty_like(x["v"])  # allocated once: no page faults timed
    ours = fused_call(cfg, q, *layer, tables, lens, one_token_each(cfg))
    fns = {"vllm-fused": fused, **({FUSED: ours} if ours else {}),
           "paged": lambda: paged_attention(q, *layer, tables, lens),
           "contiguous": lambda: contiguous_attention(q[:, :, None], x["k"], x["v"]),
           "copy": lambda: (copies[0].copy_(x["k"]), copies[1].copy_(x["v"]))}
    timings = time_interleaved(fns, dict.fromkeys(fns, repeats), cfg.device)
    errors = {name: max_error(fns[name]().clone(), q, x["k"], x["v"]) for name in ("vllm-fused", FUSED)
              if name in fns}
    rows = _rows(cfg, "decode", timings, kv_bytes(lens, cfg.kv_heads, cfg.head_dim, dtype))
    for row in rows:
        if row["impl"] in errors:
            error = errors[row["impl"]]
            row.update(max_abs_error=error, same_output=error <= TOLERANCE[cfg.dtype])
        if row["impl"] == "vllm-fused":
            row["isa"] = isa
    return rows


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The child's answer to ``vllm_rows``' request: vLLM's version and every point's rows."""
    torch.set_num_threads(request["threads"])
    import vllm

    rows = []
    for point in request["points"]:
        cfg = AttentionConfig(**point)
        print(f"vllm-fused: {asdict(cfg)}", file=sys.stderr, flush=True)
        rows += point_rows(cfg, request["repeats"])
    return {"vllm": vllm.__version__, "rows": rows}


if __name__ == "__main__":
    serve(answer)
