"""Hybrid-model sizing: a window layer holds the blocks vLLM 0.32.0's ``SlidingWindowManager`` holds, step for
step; the bytes match arithmetic written out by hand; vLLM's RFC #11382 figures come out to the digit."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlib.core.groups import FULL, SLIDING
from pagedlib.teach.hybrid_sizing import (
    HYBRID_PRESETS,
    HybridSpec,
    SequenceKV,
    repeat_pattern,
    sequence_kv_bytes,
    window_blocks_held,
)
from pagedlib.teach.sizing import ModelSpec, paged_kv_bytes
from pagedlib.util import ceil_div
from pagedlib.vllm.bridge import vllm_available

GiB = 2**30
AVAILABLE, WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not AVAILABLE, reason=WHY)

# vLLM 0.32.0's answers, computed in a child: importing vLLM changes process-wide settings (environment
# variables, Triton turned off) that later tests in this process must not see. Its input: the presets'
# shapes, the seeded window-manager trials, the (length, window, block) triples of the admission bound.
VLLM_FACTS = """
import json, random, sys, torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_page_size
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
job = json.loads(sys.stdin.read())
pages, groups = {}, {}
for name, (kinds, window, heads, head_dim) in job["presets"].items():
    kw = dict(block_size=16, num_kv_heads=heads, head_size=head_dim, dtype=torch.bfloat16)
    pages[name] = FullAttentionSpec(**kw).page_size_bytes
    layers = {f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(sliding_window=window, **kw)
              if kind == "sliding_attention" else FullAttentionSpec(**kw) for i, kind in enumerate(kinds)}
    groups[name] = [(getattr(g.kv_cache_spec, "sliding_window", None), len(g.layer_names),
                     g.kv_cache_spec.page_size_bytes) for g in _get_kv_cache_groups_uniform_page_size(layers)]
held = []   # per trial: (window, block_size, [(computed, new, blocks held)])
for trial, (window, block_size, steps) in enumerate(job["trials"]):
    spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16,
                             sliding_window=window)
    pool = BlockPool(num_gpu_blocks=4096, enable_caching=False, hash_block_size=block_size)
    manager = SlidingWindowManager(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                   scheduler_block_size=block_size)
    req, computed, seen = f"r{trial}", 0, []
    for new in steps:   # as allocate_slots: give back behind the window of the computed, then allocate
        manager.remove_skipped_blocks(req, computed)
        manager.allocate_new_blocks(req, computed + new, computed + new)
        computed += new
        seen.append((computed, new, sum(not b.is_null for b in manager.req_to_blocks[req])))
    manager.free(req)
    held.append((window, block_size, seen))
bounds = [SlidingWindowSpec(block_size=b, num_kv_heads=1, head_size=1, dtype=torch.float16, sliding_window=w)
          .max_admission_blocks_per_request(max_in_flight_tokens=1, max_model_len=10**9)
          for n, w, b in job["bounds"]]
print(json.dumps({"pages": pages, "groups": groups, "held": held, "bounds": bounds}))
"""


def _trials() -> list:
    """Seeded chunked prefills and decodes: (window, block size, each step's new tokens)."""
    rng = random.Random(1154)
    trials = []
    for _ in range(60):
        window, block_size = rng.choice([1, 2, 5, 16, 17, 48, 64, 100]), rng.choice([1, 2, 4, 16, 32])
        steps = [rng.choice([1, 1, 1, rng.randint(1, 3 * window + block_size)])
                 for _ in range(rng.randint(1, 30))]
        trials.append((window, block_size, steps))
    return trials


_rng = random.Random(11)
BOUNDS = [(_rng.randint(1, 5000), _rng.randint(1, 600), _rng.randint(1, 64)) for _ in range(400)]  # n, w, b


@pytest.fixture(scope="module")
def vllm_facts() -> dict:
    job = {"presets": {name: (spec.layer_types, spec.sliding_window, spec.num_kv_heads, spec.head_dim)
                       for name, spec in HYBRID_PRESETS.items()},
           "trials": _trials(), "bounds": BOUNDS}
    done = subprocess.run([sys.executable, "-c", VLLM_FACTS], input=json.dumps(job), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the facts table ---------------------------------------------------------------------------------------

def test_presets_hold_the_published_architectures():
    expected = {  # name: (layers, sliding layers, window, kv heads, head_dim, context)
        "gemma-2-9b": (42, 21, 4096, 8, 256, 8192),
        "gemma-2-27b": (46, 23, 4096, 16, 128, 8192),
        "gemma-3-12b": (48, 40, 1024, 8, 256, 131072),
        "gemma-3-27b": (62, 52, 1024, 16, 128, 131072),
        "gpt-oss-120b": (36, 18, 128, 8, 64, 131072),
        "gpt-oss-20b": (24, 12, 128, 8, 64, 131072),
        "ministral-8b": (36, 27, 32768, 8, 128, 131072),
    }
    got = {name: (s.num_layers, s.num_sliding, s.sliding_window, s.num_kv_heads, s.head_dim, s.max_model_len)
           for name, s in HYBRID_PRESETS.items()}
    assert got == expected


def test_layer_patterns():
    gemma3 = HYBRID_PRESETS["gemma-3-27b"].layer_types
    assert [i for i, kind in enumerate(gemma3) if kind == FULL] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert gemma3[60:] == (SLIDING, SLIDING)  # 62 = 10 x 6 + 2: the last repeat cut short
    assert HYBRID_PRESETS["gpt-oss-20b"].layer_types[:3] == (SLIDING, FULL, SLIDING)  # sliding first
    assert HYBRID_PRESETS["ministral-8b"].layer_types[:5] == (FULL, SLIDING, SLIDING, SLIDING, FULL)
    assert repeat_pattern(("a", "b", "c"), 7) == ("a", "b", "c", "a", "b", "c", "a")


@needs_vllm
def test_layer_bytes_equal_vllm_page_size(vllm_facts):
    # vLLM's page: one block of one layer, K and V (AttentionSpec.page_size_bytes)
    for name, spec in HYBRID_PRESETS.items():
        assert spec.layer_bytes_per_token(2) * 16 == vllm_facts["pages"][name]


# --- one window layer's blocks, against vLLM's manager ----------------------------------------------------

def test_issue_example_300_token_prompt():
    """Issue 54's numbers (block 16, window 64): 19 blocks for a 300-token prompt, 5 after one decode step."""
    assert window_blocks_held(300, 64, 16, num_new_tokens=300) == 19
    assert window_blocks_held(301, 64, 16, num_new_tokens=1) == 5


@needs_vllm
def test_equal_to_vllm_sliding_window_manager_step_by_step(vllm_facts):
    """Seeded chunked prefills and decodes: before each step vLLM gives back the blocks behind the window of
    the computed tokens (``remove_skipped_blocks``, as ``KVCacheManager.allocate_slots`` calls it), then
    allocates up to the step's last token; the blocks it then holds are ``window_blocks_held``'s."""
    checked = 0
    for window, block_size, steps in vllm_facts["held"]:
        for computed, new, held in steps:
            want = window_blocks_held(computed, window, block_size, new)
            assert held == want, (window, block_size, computed)
            checked += 1
    assert checked > 600


@needs_vllm
def test_decode_never_exceeds_vllm_admission_bound(vllm_facts):
    """vLLM sizes a window group for ``SlidingWindowSpec.max_admission_blocks_per_request`` blocks a
    request (one token in flight); a decode step never holds more (400 seeded lengths, windows, blocks)."""
    for (n, w, b), bound in zip(BOUNDS, vllm_facts["bounds"], strict=True):
        assert window_blocks_held(n, w, b) <= bound, (n, w, b)


def test_window_blocks_by_hand():
    # gpt-oss's window 128, block 16, 1000 tokens, one decode step: tokens 872..999 are in the window of the
    # token at 999; blocks 0..53 end before 872 (53 * 16 + 15 = 863 < 872 <= 54 * 16 + 15), so 54..62 stay
    assert window_blocks_held(1000, 128, 16) == 63 - 54 == 9
    assert window_blocks_held(1000, None, 16) == 63  # full attention: ceil(1000 / 16)
    assert window_blocks_held(1000, 128, 16, num_new_tokens=1000) == 63  # one step: nothing behind yet
    assert window_blocks_held(1000, 128, 1) == 128  # block 1: exactly the window
    # a dip: at 304 tokens the window (241..304) has left block 14 while the 304th token fits block 18
    assert window_blocks_held(303, 64, 16) == 5 and window_blocks_held(304, 64, 16) == 4


# --- one sequence's bytes, by hand -------------------------------------------------------------------------

def test_gemma_2_9b_at_8192_tokens_by_hand():
    spec = HYBRID_PRESETS["gemma-2-9b"]
    per_token_layer = 2 * 8 * 256 * 2  # K and V x 8 KV heads x head_dim 256 x bf16 = 8 KiB
    got = sequence_kv_bytes(spec, 8192, block_size=16)
    assert got.uniform == 42 * 8192 * per_token_layer == int(2.625 * GiB)
    # 21 full layers keep 8192 tokens; 21 sliding keep 4096 (4096 is a multiple of 16: 256 whole blocks)
    assert got.per_layer == (21 * 8192 + 21 * 4096) * per_token_layer
    assert got.grouped == got.per_layer  # two groups of 21 layers: no padding
    # and the uniform figure is chapter 01's paged cache of the same model
    as_dense = ModelSpec("gemma-2-9b", num_layers=42, num_kv_heads=8, head_dim=256, num_q_heads=16)
    assert got.uniform == paged_kv_bytes(as_dense, [8192], block_size=16)


def test_gemma_3_27b_pays_for_vllm_padding_by_hand():
    spec = HYBRID_PRESETS["gemma-3-27b"]
    per_token_layer = 2 * 16 * 128 * 2
    got = sequence_kv_bytes(spec, 32768, block_size=16)
    full_blocks, window_blocks = 32768 // 16, 32768 // 16 - (32768 - 1024) // 16  # 2048, 64
    block_bytes = 16 * per_token_layer
    assert got.uniform == 62 * full_blocks * block_bytes
    assert got.per_layer == (10 * full_blocks + 52 * window_blocks) * block_bytes
    # vLLM: one full group of 10 and six sliding groups padded to 10 layers each (52 -> 60)
    assert got.grouped == 10 * (full_blocks + 6 * window_blocks) * block_bytes
    assert got.per_layer < got.grouped < got.uniform


def test_gemma_3_27b_short_sequence_costs_more_in_vllm_groups():
    """Below the window no block goes back, and vLLM's 7 groups of 10 layers pay for 70 layers, not 62."""
    got = sequence_kv_bytes(HYBRID_PRESETS["gemma-3-27b"], 1000, block_size=16)
    block_bytes = 16 * 2 * 16 * 128 * 2
    assert got.uniform == got.per_layer == 62 * 63 * block_bytes  # ceil(1000 / 16) = 63 blocks a layer
    assert got.grouped == 7 * 10 * 63 * block_bytes
    assert got.grouped_saving == 1 - Fraction(70, 62) < 0


@needs_vllm
def test_grouped_equals_vllm_groups(vllm_facts):
    """The grouped bytes, from the groups vLLM 0.32.0 itself forms (``kv_cache_utils``'s
    ``_get_kv_cache_groups_uniform_page_size``): each group's table holds its blocks, every block as large as
    the largest group's layers."""
    rng = random.Random(54)
    for name, spec in HYBRID_PRESETS.items():
        groups = vllm_facts["groups"][name]
        size = max(layers for _, layers, _ in groups)
        for n in [1, spec.sliding_window, spec.sliding_window + 17, rng.randint(1, spec.max_model_len)]:
            blocks = sum(window_blocks_held(n, window, 16) for window, _, _ in groups)
            assert sequence_kv_bytes(spec, n, 16).grouped == blocks * size * groups[0][2], (name, n)


# --- vLLM's RFC #11382 -------------------------------------------------------------------------------------

def test_rfc_11382_figures():
    """"The memory waste can be ... 25% in Gemma-2, and 56.25% in Ministral" (vLLM RFC #11382): what uniform
    allocation wastes for one sequence at the model's full context, token by token (the RFC's figure uses
    BLOCK_SIZE=1), a sliding layer keeping its window: (sliding layers / layers) x (1 - window / length)."""
    gemma2, ministral = HYBRID_PRESETS["gemma-2-9b"], HYBRID_PRESETS["ministral-8b"]
    assert Fraction(21, 42) * (1 - Fraction(4096, 8192)) == Fraction(25, 100)
    assert Fraction(27, 36) * (1 - Fraction(32768, 131072)) == Fraction(5625, 10000)
    assert sequence_kv_bytes(gemma2, 8192, block_size=1).saving == Fraction(25, 100)
    assert sequence_kv_bytes(HYBRID_PRESETS["gemma-2-27b"], 8192, block_size=1).saving == Fraction(25, 100)
    assert sequence_kv_bytes(ministral, 131072, block_size=1).saving == Fraction(5625, 10000)
    # the same with vLLM's default block of 16 (both windows are multiples of 16) and in vLLM's groups
    assert sequence_kv_bytes(gemma2, 8192, block_size=16).grouped_saving == Fraction(1, 4)
    assert sequence_kv_bytes(ministral, 131072, block_size=16).grouped_saving == Fraction(9, 16)


def test_rfc_figures_need_the_full_context():
    """At half of Gemma-2's context nothing is saved yet: the figure is a long sequence's, not every one's."""
    assert sequence_kv_bytes(HYBRID_PRESETS["gemma-2-9b"], 4096, block_size=16).saving == 0
    assert sequence_kv_bytes(HYBRID_PRESETS["ministral-8b"], 32768, block_size=16).saving == 0


def test_other_models_at_full_context():
    # gpt-oss: half the layers keep 128 of 131072 tokens; Gemma 3 27B: 52 of 62 keep 1024
    assert sequence_kv_bytes(HYBRID_PRESETS["gpt-oss-120b"], 131072, 1).saving == \
        Fraction(18, 36) * (1 - Fraction(128, 131072))
    assert sequence_kv_bytes(HYBRID_PRESETS["gemma-3-27b"], 131072, 1).saving == \
        Fraction(52, 62) * (1 - Fraction(1024, 131072))


# --- properties --------------------------------------------------------------------------------------------

@st.composite
def hybrid_specs(draw):
    kinds = draw(st.lists(st.sampled_from([FULL, SLIDING]), min_size=1, max_size=12))
    return HybridSpec("drawn", kinds, sliding_window=draw(st.integers(1, 300)), num_kv_heads=draw(
        st.integers(1, 8)), head_dim=draw(st.integers(1, 64)), max_model_len=2000)


@settings(deadline=None)
@given(spec=hybrid_specs(), n=st.integers(1, 2000), b=st.integers(1, 64), data=st.data())
def test_windows_never_cost_more(spec, n, b, data):
    new = data.draw(st.integers(1, n))
    got = sequence_kv_bytes(spec, n, b, num_new_tokens=new)
    assert got.per_layer <= got.uniform and got.per_layer <= got.grouped
    assert 0 <= got.saving < 1  # the last token's block always stays
    if n <= spec.sliding_window:  # the window reaches the first token: nothing to give back
        assert got.per_layer == got.uniform
    dense = ModelSpec("dense", spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.num_kv_heads)
    assert got.uniform == paged_kv_bytes(dense, [n], b)  # uniform is chapter 01's paged cache


@settings(deadline=None)
@given(spec=hybrid_specs(), n=st.integers(1, 2000), b=st.integers(1, 64))
def test_a_window_as_long_as_the_sequence_changes_nothing(spec, n, b):
    wide = HybridSpec("wide", spec.layer_types, n, spec.num_kv_heads, spec.head_dim, 2000)
    dense = HybridSpec("dense", (FULL,) * spec.num_layers, 1, spec.num_kv_heads, spec.head_dim, 2000)
    assert sequence_kv_bytes(wide, n, b).per_layer == sequence_kv_bytes(dense, n, b).uniform
    assert sequence_kv_bytes(wide, n, b).uniform == sequence_kv_bytes(dense, n, b).uniform


@settings(deadline=None)
@given(spec=hybrid_specs(), n=st.integers(1, 1999), b=st.integers(1, 64))
def test_growing_by_one_token(spec, n, b):
    """Uniform bytes never shrink as a sequence grows; a window layer may drop one block (its window leaves
    a block while the new token still fits the last one), never more; with blocks of one token, none."""
    now, then = sequence_kv_bytes(spec, n, b), sequence_kv_bytes(spec, n + 1, b)
    block_bytes = spec.layer_bytes_per_token() * b
    assert then.uniform >= now.uniform
    assert then.per_layer >= now.per_layer - spec.num_sliding * block_bytes
    assert sequence_kv_bytes(spec, n + 1, 1).per_layer >= sequence_kv_bytes(spec, n, 1).per_layer


@settings(deadline=None)
@given(n=st.integers(1, 5000), w=st.integers(1, 600), b=st.integers(1, 64))
def test_window_blocks_repeat_every_block_once_past_the_window(n, w, b):
    held = window_blocks_held(n, w, b)
    assert held == min(ceil_div(n, b), ceil_div(n, b) - (n - w) // b)  # the formula, written once more
    if n >= w:
        assert window_blocks_held(n + b, w, b) == held


# --- bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(seq_len=0, window=4, block_size=16), "seq_len"),
    (dict(seq_len=10, window=0, block_size=16), "window"),
    (dict(seq_len=10, window=4, block_size=0), "block_size"),
    (dict(seq_len=10, window=4, block_size=16, num_new_tokens=11), "num_new_tokens"),
    (dict(seq_len=10, window=4, block_size=16, num_new_tokens=-1), "num_new_tokens"),
    (dict(seq_len=True, window=4, block_size=16), "seq_len"),
    (dict(seq_len=10.0, window=4, block_size=16), "seq_len"),
])
def test_window_blocks_held_rejects(kwargs, name):
    with pytest.raises(ValueError, match=name):
        window_blocks_held(**kwargs)


def test_sequence_kv_bytes_rejects():
    spec = HYBRID_PRESETS["gemma-2-9b"]
    with pytest.raises(ValueError, match="seq_len"):
        sequence_kv_bytes(spec, 8193, 16)  # longer than the model takes
    with pytest.raises(ValueError, match="dtype_bytes"):
        sequence_kv_bytes(spec, 100, 16, dtype_bytes=0)
    with pytest.raises(ValueError, match="block_size"):
        sequence_kv_bytes(spec, 100, 0)
    with pytest.raises(ValueError, match="spec must be a HybridSpec .* got str"):
        sequence_kv_bytes("gemma-2-9b", 100, 16)


@pytest.mark.parametrize("kwargs, name", [
    (dict(layer_types=()), "layer_types"),
    (dict(layer_types=(FULL, "global")), r"layer_types\[1\]"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_dim=2.5), "head_dim"),
    (dict(max_model_len=0), "max_model_len"),
])
def test_hybrid_spec_rejects(kwargs, name):
    fields = dict(name="x", layer_types=(FULL, SLIDING), sliding_window=4, num_kv_heads=1, head_dim=8,
                  max_model_len=64) | kwargs
    with pytest.raises(ValueError, match=name):
        HybridSpec(**fields)


def test_records_are_frozen():
    with pytest.raises(AttributeError):
        HYBRID_PRESETS["gemma-2-9b"].sliding_window = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        SequenceKV(1, 1, 1).uniform = 2  # type: ignore[misc]
