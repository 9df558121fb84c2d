"""The engine generates what transformers generates, token for token: one grid of feature x attention path x
pool size.

Features: whole prompts (``plain``), prefix caching with block hashes (``hash``) and with the radix tree
(``radix``), chunked prefill under a token budget (``chunked``, and with each prefix cache), an fp8 KV cache
(``fp8``), tied embeddings (``tied``), Mistral, a Llama whose ``head_dim`` is set apart from its hidden
size, and (notebook 15) a hybrid model whose first layer sees a sliding window of 6 tokens, with a block
table per KV-cache group or one for both, with prefix caching across the groups too (``hybrid-*``),
and a Mistral whose every layer sees 8 (``mistral-window``, and with prefix caching). Attention: the torch
path, the Triton kernel (in the interpreter on a CPU) and the fused CPU kernel. Pool: ``roomy`` holds every
request at once; in ``tight`` the longest request barely fits alone, so requests are preempted and recomputed
(prefix caching: they find their own blocks again).

Every cell steps its engine by hand through the public API and checks the cache's invariants after every
step, the token budget where there is one, that every preempted request came back, and at the end that
every block is free. Its tokens must equal ``generate``'s (greedy, no end-of-sequence stop) on the same
seeded random model; an fp8 cache changes the logits, so there the reference is the fp8 engine serving one
request at a time. The prompts share a 40-token text and leave it on and inside blocks of 4 and 16, so the
prefix caches find whole blocks and the radix tree parts of blocks; the prefix-caching cells run a second
turn whose prompts resend the first turn's prompt and answer."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

import pytest
import torch
from helpers import hf_generate_batch, hf_greedy, tiny_hf_model

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.core.request import Request
from pagedlib.engine import Engine
from pagedlib.testing import check_invariants

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is faster (conftest)

NEW_TOKENS = 12
# The interpreter runs every kernel program in Python (~0.1 s of CPU per sequence and step): the Triton
# cells run three prompts for 3 new tokens, one turn: two of 32 tokens sharing 16 and, between them (so
# that the second finds the first's blocks when two run at a time), one of 1 token.
TRITON_NEW_TOKENS = 3
TRITON_PROMPTS = (2, 7, 4)
# (tokens of the shared 40-token text, own tokens)
SPLITS = [(40, 1), (39, 2), (32, 0), (17, 7), (16, 16), (40, 9), (0, 9), (0, 1), (33, 3)]

# name -> (model, Engine keywords)
FEATURES = {
    "plain": ("llama", {}),
    "hash": ("llama", {"enable_prefix_caching": True, "max_num_seqs": 2}),
    "radix": ("llama", {"enable_prefix_caching": True, "prefix_cache": "radix", "max_num_seqs": 2}),
    "chunked": ("llama", {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 10}),
    "chunked-hash": ("llama", {"max_num_batched_tokens": 11, "enable_prefix_caching": True,
                               "max_num_seqs": 3}),
    # a budget below the running batch: decodes wait their turn too
    "chunked-radix": ("llama", {"max_num_batched_tokens": 5, "enable_prefix_caching": True,
                                "prefix_cache": "radix"}),
    "fp8": ("llama", {"kv_cache_dtype": torch.float8_e4m3fn}),
    "tied": ("tied", {}),
    "mistral": ("mistral", {}),
    "head-dim": ("head-dim", {}),
    # notebook 15: a sliding-window layer and a full one, a block table each (the window's blocks given
    # back) or one table for both (the window masks only); Mistral's one window on every layer: one group
    "hybrid": ("hybrid", {}),
    "hybrid-chunked": ("hybrid", {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 10}),
    "hybrid-fp8": ("hybrid", {"kv_cache_dtype": torch.float8_e4m3fn}),
    "hybrid-one-table": ("hybrid", {"hybrid_kv_cache": False}),
    # prefix caching across the groups: a hit is the prefix both tables serve; chunks after hits too
    "hybrid-hash": ("hybrid", {"enable_prefix_caching": True, "max_num_seqs": 4}),
    "hybrid-chunked-hash": ("hybrid", {"max_num_batched_tokens": 11, "enable_prefix_caching": True,
                                       "max_num_seqs": 3}),
    "mistral-window": ("mistral-window", {}),
    "mistral-window-hash": ("mistral-window", {"enable_prefix_caching": True}),
}
WINDOWED = ("hybrid", "mistral-window")  # the models with sliding-window layers
# name -> block size; roomy: 256 blocks, tight: as many as the longest request needs
POOLS = {"roomy": 16, "tight": 4}
# Triton runs the features whose kernel calls differ: tied embeddings and Mistral make the same calls as
# plain Llama, and chunks after prefix-cache hits the same as chunks and hits apart.
SAME_KERNEL_CALLS = ("tied", "mistral", "chunked-hash", "chunked-radix", "hybrid-one-table",
                     "hybrid-chunked-hash")
CELLS = [(feature, attention, pool) for feature in FEATURES for attention in ("torch", "triton", "cpu")
         for pool in POOLS if attention != "triton" or feature not in SAME_KERNEL_CALLS]


@functools.cache
def hf(name: str):
    """The seeded random transformers model of a feature (``initializer_range=0.25``: varied tokens)."""
    if name == "llama":
        return tiny_hf_model("Llama")
    if name == "tied":
        return tiny_hf_model("Llama", seed=3, tie_word_embeddings=True)
    if name == "mistral":
        return tiny_hf_model("Mistral", seed=1, sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if name == "mistral-window":  # a window of 8, every layer: two blocks of 4, half of one of 16
        return tiny_hf_model("Mistral", seed=5, sliding_window=8)
    if name == "hybrid":  # a window of 6: inside one block of 16, across two of 4
        return tiny_hf_model("Ministral", seed=4, head_dim=16, sliding_window=6,
                             layer_types=["sliding_attention", "full_attention"])
    return tiny_hf_model("Llama", seed=2, head_dim=32)  # not hidden_size / heads = 16


@functools.cache
def prompts(vocab_size: int) -> tuple[tuple[int, ...], ...]:
    g = torch.Generator().manual_seed(7)
    text = torch.randint(0, vocab_size, (40,), generator=g).tolist()
    own = [torch.randint(0, vocab_size, (m,), generator=g).tolist() for _, m in SPLITS]
    return tuple(tuple(text[:n] + tail) for (n, _), tail in zip(SPLITS, own))


@functools.cache
def turn_prompts(model: str, turn: int) -> list[list[int]]:
    """The prompts of a turn: first, ``SPLITS``; second, each of the first four prompts again with
    transformers' answer to it and a new message."""
    hf_model = hf(model)
    vocab_size = hf_model.config.vocab_size
    first = [list(p) for p in prompts(vocab_size)]
    if turn == 0:
        return first
    g = torch.Generator().manual_seed(8)
    answers = [hf_greedy(hf_model, p, NEW_TOKENS)[0] for p in first[:4]]
    return [p + a + torch.randint(0, vocab_size, (3 + i,), generator=g).tolist()
            for i, (p, a) in enumerate(zip(first, answers))]


@functools.cache
def want(model: str, turn: int, index: int, fp8: bool) -> tuple[int, ...]:
    """``NEW_TOKENS`` greedy tokens for one prompt: transformers' ``generate``, or (``fp8``) the fp8
    engine's with the request alone in a roomy pool."""
    prompt = turn_prompts(model, turn)[index]
    if fp8:
        engine = Engine.from_hf(hf(model), 64, 16, kv_cache_dtype=torch.float8_e4m3fn)
        return tuple(engine.generate([prompt], NEW_TOKENS)[0])
    return tuple(hf_greedy(hf(model), prompt, NEW_TOKENS)[0])


def run_to_end(engine: Engine, prompts: list[list[int]], new_tokens: int,
               budget: int | None) -> list[list[int]]:
    """Every prompt added, then steps until none is left, each checked: the cache is consistent and holds
    each running request's computed tokens (never its last sampled one), a step computes at most ``budget``
    tokens, every preempted request is prefilled again."""
    ids = [engine.add_request(p, new_tokens) for p in prompts]
    preempted, readmitted = set(), set()
    while engine.has_unfinished():
        before = engine.stats.prefill_tokens + engine.stats.decode_tokens
        out = engine.step()
        check_invariants(engine.cache)
        for request in engine.scheduler.running:  # the cache holds what the request says it computed
            assert engine.cache.seq_lens[request.req_id] == request.num_computed_tokens < request.num_tokens
        if budget is not None:
            assert engine.stats.prefill_tokens + engine.stats.decode_tokens - before <= budget
        readmitted |= preempted & set(out.prefilled + out.decoded)  # all found again: only a decode left
        preempted |= set(out.preempted)
    assert readmitted == preempted
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    return [engine.output(i) for i in ids]


@dataclasses.dataclass
class Run:
    """What a cell ran: the prompts of each turn, and the engine's counts after each (cumulative)."""

    turns: list[list[list[int]]]
    stats: list    # copies of engine.stats


@functools.cache
def run_cell(feature: str, attention: str, pool: str) -> Run:
    """Build the cell's engine and run its turns, checking every turn's tokens."""
    model, options = FEATURES[feature]
    block_size = POOLS[pool]
    new_tokens = NEW_TOKENS
    picked = range(len(SPLITS))
    if attention == "triton":
        new_tokens = TRITON_NEW_TOKENS
        picked = TRITON_PROMPTS
    keys = [[(0, i) for i in picked]]
    if options.get("enable_prefix_caching") and attention != "triton":
        keys.append([(1, i) for i in picked if i < 4])
    longest = max(len(turn_prompts(model, t)[i]) for turn in keys for t, i in turn) + new_tokens
    num_blocks = 256
    if pool == "tight":  # the blocks of the longest alone, every KV-cache group's (a window's capped)
        probe = Engine.from_hf(hf(model), num_blocks, block_size, **options).scheduler
        num_blocks = probe.blocks_alone(Request(0, 0, longest - new_tokens, new_tokens))
    if pool == "tight" and options.get("max_num_batched_tokens"):
        # admitted on their first chunk (vLLM admits on the whole prompt), requests are also preempted in the
        # middle of their prefill: the option's path, checked against transformers too
        options = {**options, "full_prompt_must_fit": False}
    engine = Engine.from_hf(hf(model), num_blocks, block_size, attention, **options)
    fp8 = options.get("kv_cache_dtype") is not None
    if fp8:
        assert engine.cache.dtype == torch.float8_e4m3fn and engine.cache.k.element_size() == 1
    run = Run([], [])
    for turn in keys:
        batch = [turn_prompts(model, t)[i] for t, i in turn]
        got = run_to_end(engine, batch, new_tokens, options.get("max_num_batched_tokens"))
        assert got == [list(want(model, t, i, fp8)[:new_tokens]) for t, i in turn]
        if options.get("enable_prefix_caching"):
            # the cache's count of tokens found and the engine's agree
            assert engine.cache.prefix_cache_stats()["hit_tokens"] == engine.stats.cached_tokens
        run.turns.append(batch)
        run.stats.append(copy.copy(engine.stats))      # a copy: the engine's counts go on
    return run


@pytest.mark.parametrize("feature, attention, pool", CELLS)
def test_engine_equals_transformers(feature, attention, pool):
    if attention == "triton":
        pytest.importorskip("triton", reason="Triton ships Linux wheels only")
    run = run_cell(feature, attention, pool)                        # the tokens are checked in there
    options = FEATURES[feature][1]
    caching = options.get("enable_prefix_caching", False)
    first = run.stats[0]
    prompt_tokens = sum(map(len, run.turns[0]))
    if pool == "roomy":
        assert first.preemptions == 0
        assert first.prefill_tokens + first.cached_tokens == prompt_tokens   # nothing computed twice
    # a window group gives blocks back as requests run: Triton's three short prompts then fit together
    crowded = pool == "tight" and (attention != "triton" or FEATURES[feature][0] not in WINDOWED)
    if crowded:
        assert first.preemptions > 0, first
    if crowded and not caching:
        assert first.prefill_tokens > prompt_tokens                          # recomputed
    if not caching:
        assert first.cached_tokens == 0
    if caching:
        assert first.cached_tokens > 0                                       # later prompts find earlier ones
    if caching and pool == "roomy" and len(run.turns) == 2:
        # the second turn finds at least the full blocks of the first turn's prompts it resends
        block_size = POOLS[pool]
        resent = sum(len(p) // block_size * block_size for p in run.turns[0][:4])
        assert run.stats[1].cached_tokens - first.cached_tokens >= resent
    if options.get("prefix_cache") == "radix" and attention == "torch" and pool == "roomy":
        # prompts leave the shared text inside a block: the tree finds those parts too, block hashes do not
        assert first.cached_tokens % POOLS[pool] != 0
    if feature == "hash" and pool == "tight":
        # preempted requests find what was not evicted: less recomputed than without caching
        assert first.prefill_tokens < run_cell("plain", attention, pool).stats[0].prefill_tokens
    if feature == "plain" and attention == "torch" and pool == "roomy":
        # transformers' own paged continuous batching agrees as well
        batch = run.turns[0]
        assert hf_generate_batch(hf("llama"), batch, NEW_TOKENS) == [list(want("llama", 0, i, False))
                                                                     for i in range(len(batch))]
