"""Helpers shared by the test modules (imported as ``from helpers import ...``; pytest puts tests/ on
``sys.path`` because the folder has no ``__init__.py``)."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from pagedlib.core.cache import PagedKVCache
from pagedlib.kernels.attention import REL_ERROR_LIMITS, TOLERANCES, rel_error
from pagedlib.kernels.varlen import paged_attention_varlen_oracle
from pagedlib.testing import check_invariants, state_diff
from pagedlib.util import ceil_div


def snapshot(c: PagedKVCache) -> PagedKVCache:
    """Everything a failed call must leave untouched: a deep copy of the cache (bookkeeping and pools)."""
    return copy.deepcopy(c)


def assert_unchanged(c: PagedKVCache, snap: PagedKVCache) -> None:
    """``c`` is bit-for-bit what ``snapshot`` saw (NaN slots included), and still consistent."""
    assert state_diff(c, snap) == [], f"changed: {state_diff(c, snap)}"
    check_invariants(c)


def arrival_steps(sched, requests) -> Iterator[int]:
    """Each step's number, once the ``requests`` arriving by it are added to ``sched``, until every request
    has finished (the caller plans and runs the step)."""
    pending = sorted(requests, key=lambda r: (r.arrival, r.req_id))
    for step in range(10_000):
        while pending and pending[0].arrival <= step:
            sched.add(pending.pop(0))
        if not (pending or sched.has_unfinished):
            return
        yield step
    raise AssertionError("the requests did not finish in 10,000 steps")


def write_step_kv(sched, plan, value: str) -> None:
    """What a forward pass writes into each KV-cache group's new slots of ``plan``, for the group's layers
    (1 head, head_dim 1): K = the token's position, V = its request's id (``value="request"``) or the token's
    id (``value="token"``, the same for every request that shares the token)."""
    cache, batch = sched.cache, plan.batch
    positions, values = [], []
    for request, n in plan.work:
        positions += range(request.num_computed_tokens, request.num_computed_tokens + n)
        values += [request.req_id] * n if value == "request" else request.next_token_ids(n)
    group_slots = batch.group_slots if batch.group_slots is not None else [batch.slots]
    for group, slots in zip(cache.groups, group_slots):
        shape = (len(group.layers), len(positions), 1, 1)
        k = torch.tensor(positions, dtype=cache.dtype).view(1, -1, 1, 1).expand(shape).contiguous()
        v = torch.tensor(values, dtype=cache.dtype).view(1, -1, 1, 1).expand(shape).contiguous()
        cache.pool.write([slot for row in slots for slot in row], k, v)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def varlen_case(cached: list[int], new: list[int], *, block_size: int, kv_heads: int = 2, group: int = 2,
                head_dim: int = 16, dtype: torch.dtype = torch.float32, share: bool = False, seed: int = 0,
                device: str = DEVICE) -> tuple[PagedKVCache, tuple[torch.Tensor, ...]]:
    """A 2-layer cache (blocks in a random order, NaN in every unused slot) where sequence ``s`` holds
    ``cached[s]`` tokens then its ``new[s]`` new ones, and the varlen arguments for layer 1. ``share``:
    sequences 1.. are forks of sequence 0 taken after its cached tokens (a prefix-cache hit: their first
    blocks are sequence 0's), so their cached tokens are ``cached[0] + cached[s]``."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(cached[0] + c + n) // block_size) + 1 for c, n in zip(cached, new)) + 3
    cache = PagedKVCache(num_blocks, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device,
                         free_order=torch.randperm(num_blocks, generator=g).tolist(), fill=float("nan"))

    def append(s: int, n: int) -> None:
        if n:
            k, v = torch.randn(2, 2, n, kv_heads, head_dim, generator=g).to(device, dtype)
            cache.append_tokens(s, k, v)

    cache.add_sequence(0)
    append(0, cached[0])
    for s in range(1, len(cached)):
        cache.fork(0, s) if share else cache.add_sequence(s)
        append(s, cached[s])
    for s, n in enumerate(new):
        append(s, n)
    seqs = list(range(len(new)))
    q = torch.randn(sum(new), kv_heads * group, head_dim, generator=g).to(device, dtype)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return cache, (q, *cache.layer(1), cache.block_table(seqs), cache.seq_lens_tensor(seqs), qsl)


def sdpa_reference(cache: PagedKVCache, args: tuple) -> torch.Tensor:
    """Per sequence, SDPA in float32 on contiguous copies of its K/V with a causal mask aligned to its
    last positions (query ``i`` of ``m`` new tokens sits at ``n - m + i``)."""
    q, starts = args[0], args[5].tolist()
    out = []
    for s in range(len(starts) - 1):
        k, v = (x[1].float().transpose(0, 1)[None] for x in cache.gather(s))   # [1, kv_heads, n, D]
        m, n = starts[s + 1] - starts[s], k.shape[2]
        mask = torch.arange(n, device=q.device) <= torch.arange(n - m, n, device=q.device)[:, None]  # [m, n]
        qs = q[starts[s]:starts[s + 1]].float().transpose(0, 1)[None]          # [1, q_heads, m, D]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)  # [1, q_heads, m, D]
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def check(out: torch.Tensor, cache: PagedKVCache, args: tuple) -> None:
    q = args[0]
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from an unused slot leaked into the result"
    assert rel_error(out, paged_attention_varlen_oracle(*args)) < REL_ERROR_LIMITS[q.dtype]
    torch.testing.assert_close(out.float(), sdpa_reference(cache, args), **TOLERANCES[q.dtype])


TINY_SIZES = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_hf_model(family: str = "Llama", seed: int = 0, **overrides):
    """A seeded random transformers ``<family>ForCausalLM`` (``"Llama"``, ``"Mistral"``, ...) of
    ``TINY_SIZES`` built from a local config (no download), fp32, eval; ``overrides``: config fields.

    ``initializer_range=0.25``: with the default 0.02 a random tiny Llama soon repeats one token forever,
    and token equality with it would prove little; at 0.25 greedy decoding wanders over the vocabulary."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(seed)
    return model_class(config_class(**{**TINY_SIZES, "initializer_range": 0.25, **overrides})).eval()


def tiny_llama(seed: int = 0, **overrides):
    """``tiny_hf_model("Llama", seed, **overrides)``: the course's oracle model."""
    return tiny_hf_model("Llama", seed, **overrides)


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """``hf_model.generate(do_sample=False)`` for one prompt, exactly ``max_new_tokens`` (no EOS stop): (new
    tokens, logits ``[max_new_tokens, vocab]`` of every step). The attention mask is passed explicitly:
    inferred, it would hide every prompt token equal to the pad id."""
    cfg = hf_model.generation_config
    cfg.eos_token_id, cfg.pad_token_id, cfg.do_sample = None, 0, False
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


def hf_generate_batch(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own paged continuous batching (sdpa attention on the CPU), greedy, no EOS stop."""
    import logging

    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # "eos_token_id not set"
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    # explicit sizes: left to infer them on a CPU, it takes ~30 s to set up
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=256, max_batch_tokens=512)
    out = hf_model.generate_batch(inputs=prompts, generation_config=gen, continuous_batching_config=cb,
                                  warmup=False)
    return [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]


# the oracle prompts: lengths around block boundaries of block sizes 4, 8 and 16, plus odd ones
ORACLE_LENGTHS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 23, 24, 25, 31, 32, 33, 40, 47, 48, 49, 63, 64)
ORACLE_NEW_TOKENS = 32


def oracle_prompts(vocab_size: int = 200, seed: int = 1) -> list[list[int]]:
    """One seeded random prompt per length in ``ORACLE_LENGTHS``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in ORACLE_LENGTHS]


_ORACLE: dict = {}


def oracle():
    """``(hf_model, prompts, [(tokens, logits)] per prompt)`` for ``tiny_llama()``: greedy ``generate`` of
    ``ORACLE_NEW_TOKENS`` tokens per prompt, computed once per test process (several test files share it)."""
    if not _ORACLE:
        hf = tiny_llama()
        prompts = oracle_prompts(hf.config.vocab_size)
        _ORACLE["value"] = hf, prompts, [hf_greedy(hf, p, ORACLE_NEW_TOKENS) for p in prompts]
    return _ORACLE["value"]


def random_kv(n: int | None, num_layers: int, kv_heads: int, head_dim: int, *, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded random K and V for ``append_tokens``: ``[num_layers, n, kv_heads, head_dim]`` each, or one
    token's ``[num_layers, kv_heads, head_dim]`` for ``append_token`` when ``n`` is None."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, kv_heads, head_dim)
    if n is not None:
        shape = (num_layers, n, kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    return k.to(dtype), v.to(dtype)


def filled_cache(lens: list[int], block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, *, num_layers: int = 2, fill: float = float("nan"),
                 seed: int = 0, device: str = "cpu") -> PagedKVCache:
    """A cache holding sequences ``0 .. len(lens) - 1`` of random K/V, its blocks handed out in a random
    order, three spare free blocks, and ``fill`` (NaN by default) in every slot that holds no token."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(ceil_div(n, block_size) for n in lens) + 3
    cache = PagedKVCache(num_blocks, num_layers, block_size, kv_heads, head_dim, dtype=dtype, device=device,
                         free_order=torch.randperm(num_blocks, generator=g).tolist(), fill=fill)
    for s, n in enumerate(lens):
        cache.add_sequence(s)
        k, v = torch.randn(2, num_layers, n, kv_heads, head_dim, generator=g).to(device, dtype)
        cache.append_tokens(s, k, v)
    return cache


def decode_args(cache: PagedKVCache, q_heads: int, *, layer: int = 1, seed: int = 1,
                width: int | None = None) -> tuple[torch.Tensor, ...]:
    """``(q, k_cache, v_cache, block_tables, seq_lens)`` for one decode step of every sequence of ``cache``
    (as ``filled_cache`` builds it) at ``layer``: the arguments of ``paged_attention``."""
    seqs = sorted(cache.tables)
    q = torch.randn(len(seqs), q_heads, cache.k.shape[-1], generator=torch.Generator().manual_seed(seed))
    k_cache, v_cache = cache.layer(layer)
    return (q.to(cache.k.device, cache.k.dtype), k_cache, v_cache, cache.block_table(seqs, width=width),
            cache.seq_lens_tensor(seqs))

