"""Colocated against disaggregated serving, priced (notebook 14): time to first token (TTFT) and the time
between output tokens (ITL, inter-token latency) when every GPU both prefills and decodes, against GPUs
that only prefill handing their K/V over a network link to GPUs that only decode.

The model is the course's step cost (``StepCost``: ``fixed + per_token * new tokens + per_context * K/V
tokens read``, notebook 09) with datasheet figures, and a steady fluid workload: requests of ``prompt``
tokens and ``output`` new tokens arrive evenly at ``rate`` a second (no queueing), each decoding one token a
step. A GPU serving ``r`` requests a second holds ``N = r * output * t`` of them (Little's law), so its step
time ``t`` solves ``t = fixed + t * r * work``, where ``work`` is what one request adds per second of steps:

- colocated: its prompt's tokens and its decodes, ``per_token * (prompt + output)``, and the K/V its
  decodes read, ``per_context * output * (prompt + output / 2)``; prompts are cut into chunks that fill a
  step's token budget beside the decodes (chunked prefill), so a decode that shares a step with a chunk
  waits for all of it (the longest gap, ``itl``), and TTFT is the chunk steps its prompt takes;
- disaggregated: a decode GPU's ``work`` has no prompt tokens; a prefill GPU runs one prompt a step,
  ``fixed + (per_token + per_context) * prompt``, and its K/V crosses the link (``prompt *
  kv_bytes_per_token / bandwidth``) before the first decode.

``t`` is finite only while ``r * work < 1``: beyond, the GPU cannot keep up (``None``). Every figure is a
lower bound from peaks; the comparison, not the milliseconds, is what the notebook reads."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlib.sim.offload import LLAMA_3_8B, Link
from pagedlib.sim.simulate import StepCost
from pagedlib.util import ceil_div

#: NVIDIA H100 SXM datasheet: 3.35 TB/s of HBM3, 989 TFLOP/s of dense fp16/bf16 tensor-core arithmetic.
H100_HBM_BYTES_PER_SECOND = 3.35e12
H100_FLOPS = 989e12
#: A 400 Gb/s port (InfiniBand NDR; NVIDIA ConnectX-7 datasheet), one direction.
NDR_400 = Link("InfiniBand NDR 400 Gb/s", 400e9 / 8, "NVIDIA ConnectX-7 datasheet: 400 Gb/s a port")


def step_cost() -> StepCost:
    """A step's cost from peaks, Llama-3-8B on an H100: the weights read once (``fixed``), 2 FLOPs a weight
    per new token, a K/V token's bytes read per token of context."""
    model, bandwidth = LLAMA_3_8B, H100_HBM_BYTES_PER_SECOND
    return StepCost(fixed=model.params * model.bytes_per_value / bandwidth,
                    per_token=2 * model.params / H100_FLOPS, per_context=model.kv_bytes_per_token / bandwidth)


@dataclass(frozen=True)
class Latency:
    ttft: float      # seconds from arrival to the first token
    itl: float       # the longest gap between two output tokens
    mean_itl: float  # the mean gap


def _step_time(cost: StepCost, rate: float, work: float) -> float | None:
    load = rate * work
    return cost.fixed / (1 - load) if load < 1 else None


def colocated(cost: StepCost, prompt: int, output: int, rate: float, *, gpus: int = 2,
              budget: int = 2048) -> Latency | None:
    """Each of ``gpus`` GPUs serves ``rate / gpus`` requests a second with chunked prefill: a step takes
    its decodes and fills its ``budget`` of tokens with a prompt's next chunk. A decode that shares a step
    with a chunk waits for the whole step: that is ``itl``. ``None``: it cannot keep up."""
    r = rate / gpus
    work = cost.per_token * (prompt + output) + cost.per_context * output * (prompt + output / 2)
    t = _step_time(cost, r, work)
    if t is None:
        return None
    decoding = r * output * t  # requests decoding at once (Little's law)
    if decoding >= budget - 1:
        return None
    chunk_step = cost.fixed + cost.per_token * budget + cost.per_context * decoding * (prompt + output / 2)
    steps = ceil_div(prompt, int(budget - decoding))
    return Latency(ttft=steps * chunk_step, itl=max(t, chunk_step), mean_itl=t)


def disaggregated(cost: StepCost, prompt: int, output: int, rate: float, *, prefill_gpus: int = 1,
                  decode_gpus: int = 1) -> Latency | None:
    """``prefill_gpus`` GPUs prefill (one prompt a step), Llama-3-8B's K/V crosses ``NDR_400``,
    ``decode_gpus`` GPUs decode. ``None``: one side cannot keep up."""
    prefill = cost.fixed + (cost.per_token + cost.per_context) * prompt
    if rate / prefill_gpus * prefill >= 1:
        return None
    work = cost.per_token * output + cost.per_context * output * (prompt + output / 2)
    t = _step_time(cost, rate / decode_gpus, work)
    if t is None:
        return None
    transfer = prompt * LLAMA_3_8B.kv_bytes_per_token / NDR_400.bytes_per_second
    return Latency(ttft=prefill + transfer, itl=t, mean_itl=t)


def goodput(serve, prompt: int, output: int, *, ttft_slo: float, itl_slo: float, most: float = 1e4,
            **options) -> float:
    """The highest rate (requests a second, to 0.1%) at which ``serve`` (``colocated`` or
    ``disaggregated``, with ``options``) meets both latency objectives; 0.0 if none does."""
    def meets(rate: float) -> bool:
        latency = serve(prompt=prompt, output=output, rate=rate, **options)
        return latency is not None and latency.ttft <= ttft_slo and latency.itl <= itl_slo

    if not meets(1e-9):
        return 0.0
    low, high = 1e-9, most
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (mid, high) if meets(mid) else (low, mid)
    return low


BUDGETS = (128, 256, 512, 1024, 2048, 4096, 8192)


def best_colocated(cost: StepCost, prompt: int, output: int, *, ttft_slo: float, itl_slo: float,
                   budgets: tuple[int, ...] = BUDGETS, **options) -> tuple[float, int]:
    """Colocated serving's goodput at its best token budget among ``budgets``: ``(rate, budget)`` (a small
    budget keeps a chunk's step short, a large one a prompt's chunks few)."""
    return max((goodput(colocated, prompt, output, ttft_slo=ttft_slo, itl_slo=itl_slo, cost=cost,
                        budget=budget, **options), budget) for budget in budgets)
