"""The radix prefix cache (notebook 11): SGLang's tree on the same ``BlockManager`` and pool as the block-hash
cache. A hypothesis state machine (the one of ``test_cache_stateful.py``, on the tree) checks the tree's
invariants after every step; fixed cases check where the two designs must agree and where they differ; the
engine with the tree generates what transformers generates, multi-turn and branching, under preemption."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

from unittest import mock

import pytest
import test_cache_stateful as stateful
import torch
from helpers import assert_unchanged, snapshot
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.core.radix_cache import RadixCache
from pagedlib.engine import Engine
from pagedlib.testing import check_invariants


class RadixMachine(stateful.CacheMachine):
    """Every rule of the block-hash machine (adds that look up, forks, appends that insert and evict, frees,
    interrupted appends), on the radix tree, plus an interrupt inside ``insert`` and eviction refused while
    every cached block is held."""

    @initialize(num_blocks=st.integers(min_value=1, max_value=12), block_size=st.sampled_from([1, 2, 3, 4]),
                shuffle=st.randoms(use_true_random=False))
    def setup(self, num_blocks: int, block_size: int, shuffle) -> None:
        order = list(range(num_blocks))
        shuffle.shuffle(order)
        self.cache = PagedKVCache(num_blocks, stateful.L, block_size, stateful.H, stateful.D,
                                  free_order=order, fill=float("nan"), enable_prefix_caching=True,
                                  prefix_cache="radix")
        self.model, self.copies = {}, 0

    @rule(seq=stateful.SEQ_IDS, prompt=st.sampled_from([None, *stateful.PROMPTS]))
    def add(self, seq: int, prompt: list[int] | None) -> None:
        """The block-hash machine's ``add``, but the tree may find part of a block (a copy of it): any number
        of tokens but the prompt's last; K/V read back (``contents``) proves the copy right."""
        c = self.cache
        if seq in self.model:
            self.expect_error(lambda: c.add_sequence(seq, prompt), ValueError)
            return
        hit = c.add_sequence(seq, prompt)
        event(f"partial block found: {hit % c.block_size > 0}")
        assert hit <= max(0, len(prompt or []) - 1) and len(c.tables[seq]) == -(-hit // c.block_size)
        self.model[seq] = list(prompt or [])[:hit]
        rest = list(prompt or [])[hit:]
        kv = stateful.kv_of(self.model[seq] + rest, hit)
        self.append([(seq, rest)], lambda: c.append_tokens(seq, kv[0], kv[1], token_ids=rest))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=stateful.TOKENS, nth=st.integers(1, 3))
    def interrupted_insert(self, data, tokens: list[int], nth: int) -> None:
        with mock.patch.dict(stateful.STEPS, {"register": RadixCache}):
            stateful.CacheMachine.interrupted_append(self, data, tokens, "register", nth)

    @precondition(lambda self: not self.cache.prefix_cache.free_queue)
    @rule()
    def evict_refused_while_held(self) -> None:
        self.expect_error(self.cache.prefix_cache.evict, RuntimeError)


RadixMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestRadixMachine = RadixMachine.TestCase


# ------------------------------------------------------------------------------------------------------
# fixed cases: bad input, where the designs agree, where they differ


def new_cache(design: str, num_blocks: int = 16, block_size: int = 8) -> PagedKVCache:
    return PagedKVCache(num_blocks, 1, block_size, 1, 1, enable_prefix_caching=True, prefix_cache=design)


def prefill(cache: PagedKVCache, seq: int, prompt: list[int]) -> int:
    """Add ``prompt`` as sequence ``seq``: K = its position (a prefix function, as K/V are). Tokens found."""
    found = cache.add_sequence(seq, prompt)
    k = torch.arange(found, len(prompt), dtype=torch.float32).view(1, -1, 1, 1)
    cache.append_tokens(seq, k, k.clone(), token_ids=prompt[found:])
    return found


@pytest.mark.parametrize("design", ["tree", "Radix", None, 1])
def test_an_unknown_design_is_refused_before_anything_is_built(design):
    with pytest.raises(ValueError, match="prefix_cache must be 'hash' or 'radix'"):
        PagedKVCache(4, 1, 4, 1, 1, enable_prefix_caching=True, prefix_cache=design)


def test_eviction_with_every_cached_block_held_is_refused_and_changes_nothing():
    cache = new_cache("radix", num_blocks=4, block_size=4)
    prefill(cache, 0, list(range(16)))                   # all 4 blocks full, in the tree, and held
    assert cache.prefix_cache_stats()["cached_blocks"] == 4 and not cache.prefix_cache.free_queue
    snap = snapshot(cache)
    with pytest.raises(RuntimeError, match="running requests hold them all"):
        cache.prefix_cache.evict()
    assert_unchanged(cache, snap)
    assert cache.add_sequence(1, [7]) == 0
    k = torch.zeros(1, 3, 1, 1)
    snap = snapshot(cache)
    with pytest.raises(OutOfBlocksError):                # a held node is never evicted to make room
        cache.append_tokens(1, k, k.clone(), token_ids=[1, 2, 3])
    assert_unchanged(cache, snap)


def test_a_mid_block_divergence_copies_the_shared_part_of_the_block():
    """B shares A's first 20 tokens, 2.5 blocks of 8: the hash cache finds 16, the tree 20 (a copy of A's
    third block holds them) and reads back exactly A's K/V there; B's own third block branches the tree."""
    a = list(range(100, 130))
    b = a[:20] + list(range(200, 210))
    found = {}
    for design in ("hash", "radix"):
        cache = new_cache(design)
        prefill(cache, 0, a)
        found[design] = prefill(cache, 1, b)
        check_invariants(cache)
        assert torch.equal(cache.gather(1)[0][0, :20], cache.gather(0)[0][0, :20])
    assert found == {"hash": 16, "radix": 20}
    assert cache.tables[1][:2] == cache.tables[0][:2] and cache.tables[1][2] != cache.tables[0][2]
    assert cache.prefix_cache_stats()["nodes"] == 3          # [a0 a1] -> {[a2], [b2]}
    assert cache.cow_copies == 0                             # a copy made on lookup, not a copy-on-write


def test_the_tree_evicts_least_recently_used_leaves_and_keeps_their_stem():
    """Stem S (2 blocks) with leaves X (used first) and Y: under pressure X's blocks go first, then Y's, and
    S, still a prefix of both, goes last; a lookup then finds only what is left."""
    s, x, y = list(range(16)), list(range(100, 116)), list(range(200, 216))
    cache = new_cache("radix", num_blocks=8, block_size=8)
    for seq, prompt in enumerate([s + x + [1], s + y + [1]]):
        prefill(cache, seq, prompt)
    x_blocks, y_blocks, stem = cache.tables[0][2:4], cache.tables[1][2:4], cache.tables[0][:2]
    cache.free_sequence(0), cache.free_sequence(1)
    order = [cache.manager.allocate(1)[0] for _ in range(8)]  # 2 plain free blocks, then 6 evictions
    assert order[2:] == x_blocks[::-1] + y_blocks[::-1] + stem[::-1]


@pytest.mark.parametrize("workload", ["system prompt", "multi-turn chat"])
def test_the_designs_agree_where_sharing_is_block_aligned(workload):
    """A 64-token system prompt (4 blocks of 16), or a conversation whose every turn resends the last one:
    with no memory pressure both designs find the same tokens and prefill the same."""
    from pagedlib.sim.prefix_compare import WORKLOADS, run_design
    from pagedlib.sim.workloads import shared_prompt_like

    requests = shared_prompt_like(40, 0, system_len=64) if workload == "system prompt" else WORKLOADS[
        workload](0)
    rows = [run_design(requests, d, 4096, 16)[0] for d in ("hash", "radix")]
    assert rows[0]["hit_rate"] == rows[1]["hit_rate"] > 0.5
    assert rows[0]["prefill_tokens"] == rows[1]["prefill_tokens"]


def test_the_tree_is_ahead_where_prompts_diverge_inside_a_block():
    """Few-shot prompts of 50-token examples: every shared prefix ends inside a block of 16."""
    from pagedlib.sim.prefix_compare import WORKLOADS, run_design

    requests = WORKLOADS["few-shot"](0)
    hash_row, radix_row = (run_design(requests, d, 4096, 16)[0] for d in ("hash", "radix"))
    assert radix_row["hit_rate"] > hash_row["hit_rate"]
    assert radix_row["prefill_tokens"] < hash_row["prefill_tokens"]
    # token-level matching, as the hash cache has at block size 1; the tree may compute a few tokens more:
    # it never copies a partial block from a block whose K/V are written in the same step
    token_level = run_design(requests, "hash", 4096 * 16, 1)[0]["prefill_tokens"]
    assert token_level <= radix_row["prefill_tokens"] <= token_level + 16


# ------------------------------------------------------------------------------------------------------
# end to end: the engine with the tree generates what transformers generates

def test_engine_refuses_an_unknown_design_and_from_hf_passes_it_on(ref, model):
    with pytest.raises(ValueError, match="prefix_cache must be 'hash' or 'radix'"):
        Engine(model, 16, 8, enable_prefix_caching=True, prefix_cache="trie")
    engine = Engine.from_hf(ref[0], 32, 8, enable_prefix_caching=True, prefix_cache="radix")
    assert isinstance(engine.cache.prefix_cache, RadixCache)
    engine.reset()
    assert isinstance(engine.cache.prefix_cache, RadixCache)


def drawn_boxes(ax) -> dict[str, str]:
    """The boxes of a ``draw_prefix_caches`` panel: the last line of each box's label -> its fill colour
    (each box is a filled rectangle and then its label, in the same order)."""
    from matplotlib.colors import to_hex
    from matplotlib.text import Annotation

    filled = [patch for patch in ax.patches if patch.get_fill()]
    labels = [t.get_text() for t in ax.texts if not isinstance(t, Annotation)]
    return {label.split("\n")[-1]: to_hex(patch.get_facecolor()) for patch, label in zip(filled, labels)}


def test_the_figures_draw_the_root_colour_each_block_and_show_every_arrowhead():
    """Notebook 11's drawing: the tree from its root, a dashed outline per node around its blocks, each
    block coloured by whether a table holds it (a free block inside a held node is green); one box per hash
    entry; every arrow's head outside every box, so each one shows. The bars have a labelled axis and one
    legend entry per (design, block size)."""
    import matplotlib.pyplot as plt
    from matplotlib.text import Annotation

    from pagedlib.teach.colors import CACHED_COLOR
    from pagedlib.teach.prefix_view import HELD_COLOR, draw_prefix_caches, plot_side_by_side

    a, b = list(range(100, 130)), list(range(100, 120)) + list(range(200, 210))
    caches = {d: new_cache(d) for d in ("radix", "hash")}
    for c in caches.values():
        prefill(c, 0, a), prefill(c, 1, b)
        c.free_sequence(0)
    held = caches["radix"].tables[1][:3]                          # b's full blocks: a0, a1 and its own
    free = caches["radix"].prefix_cache.node_of.keys() - set(held)
    assert len(free) == 1                                         # a's third block: nobody holds it now
    fig = draw_prefix_caches(caches["radix"].prefix_cache, caches["hash"].prefix_cache,
                             caches["radix"].ref_counts, caches["hash"].ref_counts)
    tree, chain = fig.axes
    want = {f"block {x}": HELD_COLOR.lower() for x in held}
    want |= {f"block {x}": CACHED_COLOR.lower() for x in free}
    assert drawn_boxes(tree) == {"(no tokens)": "#ffffff", **want}   # the root, then 4 blocks in 3 nodes
    assert len([p for p in tree.patches if not p.get_fill()]) == 3 and "3 nodes" in tree.get_title()
    assert drawn_boxes(chain) == want
    for ax, arrows in ((tree, 3), (chain, 3)):                    # root->[a0 a1]->{[a2], [b2]}; a1->a0 ...
        heads = [t.xy for t in ax.texts if isinstance(t, Annotation)]
        assert len(heads) == arrows
        for x, y in heads:
            assert not any(p.contains_point(ax.transData.transform((x, y)), radius=-1.0)
                           for p in ax.patches if p.get_fill())
    assert all(ax.get_xlabel() for ax in fig.axes) and fig.legends
    rows = [{"workload": w, "design": d, "block_size": bs, "hit_rate": 0.5}
            for w in ("x", "y") for bs in (1, 16) for d in ("hash", "radix")]
    bars = plot_side_by_side(rows).axes[0]
    assert bars.get_ylabel().startswith("hit rate") and len(bars.get_legend().get_texts()) == 4
    plt.close("all")


@pytest.mark.parametrize("call, match", [
    (lambda wl: wl.multi_turn_like(0), "num_conversations must be >= 1"),
    (lambda wl: wl.few_shot_like(5, num_examples=1.5), "num_examples must be an int"),
    (lambda wl: wl.branching_like(2, stem_len=True), "stem_len must be an int, got a bool"),
    (lambda wl: wl.unique_documents_like(3, doc_len=-4), "doc_len must be >= 1"),
])
def test_the_new_workloads_refuse_bad_sizes_by_name(call, match):
    from pagedlib.sim import workloads

    with pytest.raises(ValueError, match=match):
        call(workloads)


def test_the_new_workloads_are_seeded_and_carry_their_token_ids():
    from pagedlib.sim.prefix_compare import WORKLOADS

    for name, make in WORKLOADS.items():
        first, again = make(0), make(0)
        assert first == again and first != make(1), name
        assert all(r.prompt_len == len(r.prompt_tokens) for r in first), name
