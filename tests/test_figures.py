"""The figures say what they show. The pool picture of notebooks 02, 03 and 06: physical counts in its
title, the holders of a shared block in its colours, a legend of exactly the colours and marks it draws.
Notebook 01's histogram quotes the median a reader computes; notebook 06's eviction counts start at 0."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
from helpers import random_kv
from matplotlib.colors import to_hex
from matplotlib.patches import Rectangle

from pagedlib.core.cache import PagedKVCache
from pagedlib.teach import plots
from pagedlib.teach.colors import CACHED_COLOR, OWNER_COLORS


def forked() -> PagedKVCache:
    cache = PagedKVCache(num_blocks=8, num_layers=1, block_size=4, kv_heads=1, head_dim=2, free_order=[5, 2])
    cache.add_sequence("parent")
    cache.append_tokens("parent", *random_kv(6, 1, 1, 2))
    cache.fork("parent", "child")
    return cache


def legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def fills_in_cell(fig, block: int, cols: int) -> set[str]:
    """Face colours of the slot rectangles drawn inside block ``block``'s cell."""
    x, y = block % cols, -(block // cols)
    inside = [p for p in fig.axes[0].patches if isinstance(p, Rectangle) and p.get_fill()
              and x <= p.get_x() < x + 0.9 and y <= p.get_y() < y + 0.7]
    return {to_hex(p.get_facecolor()) for p in inside}


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_an_empty_pool_claims_no_utilization():
    cache = PagedKVCache(num_blocks=8, num_layers=1, block_size=4, kv_heads=1, head_dim=2)
    fig = plots.plot_block_pool(cache)
    assert fig.axes[0].get_title(loc="left") == "Physical pool: 0/8 blocks in use"
    assert legend_labels(fig) == ["free: 8 (1 = top of the stack, taken next)"]


def test_title_counts_physical_slots_once():
    cache = forked()  # two tables of 6 tokens each name the same 2 blocks: 6 tokens in 8 physical slots
    assert cache.num_tokens == 12 and cache.num_allocated_slots == 16  # the logical counts
    fig = plots.plot_block_pool(cache, cols=8)
    assert fig.axes[0].get_title(loc="left") == \
        "Physical pool: 2/8 blocks in use, 6 of their 8 slots hold a token (75%)"


def test_a_shared_block_shows_every_holder_and_the_legend_only_what_is_drawn():
    cache = forked()
    cache.add_sequence("empty")  # holds no block: drawn nowhere, so not in the legend
    fig = plots.plot_block_pool(cache, cols=8)
    parent, child = OWNER_COLORS[0].lower(), OWNER_COLORS[1].lower()
    for block in (5, 2):
        assert {parent, child} <= fills_in_cell(fig, block, 8)
    assert legend_labels(fig) == [
        "seq parent: 6 tokens, 2 blocks", "seq child: 6 tokens, 2 blocks",
        "shared: a band per holder, x = reference count", "hatched: slot not yet written",
        "free: 6 (1 = top of the stack, taken next)"]
    drawn = {to_hex(p.get_facecolor()) for p in fig.axes[0].patches}
    for handle in fig.axes[0].get_legend().legend_handles:
        assert to_hex(handle.get_facecolor()) in drawn | {"#ffffff"}


def test_cached_free_blocks_are_labelled_by_eviction_order_and_legended_only_when_present():
    cache = PagedKVCache(num_blocks=6, num_layers=1, block_size=2, kv_heads=1, head_dim=2,
                         enable_prefix_caching=True)
    assert not any("cached" in s for s in legend_labels(plots.plot_block_pool(cache)))
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.append_tokens(0, *random_kv(5, 1, 1, 2), token_ids=[1, 2, 3, 4, 5])
    cache.free_sequence(0)  # blocks holding [1, 2] and [3, 4] stay findable; [5] goes back on the stack
    queue = list(cache.prefix_cache.free_queue)
    fig = plots.plot_block_pool(cache)
    assert "cached, free: 2 (e1 = evicted first)" in legend_labels(fig)
    labels = {t.get_text(): t.get_position() for t in fig.axes[0].texts}
    assert labels["e1"][0] == pytest.approx(queue[0] % 6 + 0.45)
    assert to_hex(CACHED_COLOR) in fills_in_cell(fig, queue[0], 6)


def test_histogram_legend_quotes_numpy_median():
    import numpy as np

    lens = [1, 2, 296, 297, 400, 500]  # an even count: the median, 296.5, is no element
    fig = plots.plot_length_histogram(lens, max_tokens=512)
    assert f"median = {np.median(lens):g}" == "median = 296.5"
    assert "median = 296.5" in legend_labels(fig)


def test_eviction_axis_starts_at_zero_and_marks_are_drawn():
    fig = plots.plot_hit_rate_vs_pool([22, 70, 118], [0.24, 0.7, 0.73], [470, 130, 60],
                                      marks={22: "2 running requests", 70: "+ 6 prompts"})
    left, right = fig.axes
    assert right.get_ylim()[0] == 0 and right.get_ylim()[1] >= 470
    assert {t.get_text().strip() for t in left.texts} == {"2 running requests", "+ 6 prompts"}


def test_the_pool_pictures_give_each_request_its_own_colour_and_mark_preemptions_above_the_pool():
    """Notebook 07's figure 2: 24 requests, 24 colours (a cycle of 12 made two requests look like one);
    the preemption marks sit above the pool, large enough to see; a frame's title names the step asked."""
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D

    from pagedlib.sim.simulate import simulate
    from pagedlib.sim.workloads import LengthModel, synthetic_workload

    assert len({to_hex(c) for c in plots.request_rgb(np.arange(24))}) == 24
    tiny = synthetic_workload(24, LengthModel(12, 0.5, 24, 0.8), seed=1, rate=0.5, max_model_len=64)
    paged = simulate(tiny, "paged", 32, 4, max_model_len=64, record_occupancy=True)
    assert paged.preemptions > 0 and paged.occupancy.steps[0] > 0   # idle steps before the first arrival
    fig = plots.plot_pool_occupancy([paged])
    marks = [line for line in fig.axes[0].lines if isinstance(line, Line2D) and line.get_marker() == "v"]
    assert len(marks[0].get_xdata()) == int((paged.series["preempted"] > 0).sum())
    assert min(marks[0].get_ydata()) > 128 and marks[0].get_markersize() >= 7
    assert "step 30:" in plots.plot_pool_step(paged, 30).axes[0].get_title()


def test_the_fused_vs_gather_figure_draws_every_run_and_names_each_path_once():
    """Notebook 04's committed-runs figure: a panel per batch, a line per path and run, the legend once per
    path, and y ticks that span every ratio drawn."""
    def rows(scale: float) -> list[dict]:
        return [{"impl": impl, "batch": batch, "context": context, plots.SPEEDUP_KEY: ratio * scale}
                for batch in (1, 16) for context in (512, 2048)
                for impl, ratio in (("vllm-fused", 2.5), ("paged", 0.3), ("contiguous", 1.0), ("copy", 1.6))]

    fig = plots.plot_fused_vs_gather([rows(1.0), rows(1.1), rows(0.9)])
    panels = fig.axes
    assert [ax.get_title() for ax in panels] == ["batch 1", "batch 16"]
    assert all(len(ax.get_lines()) == 3 * 4 + 1 for ax in panels)  # 3 runs x 4 paths, and the 1x line
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(labels) == 4 and labels[0].startswith("vLLM's fused CPU kernel")
    ticks = panels[0].get_yticks()
    assert min(ticks) <= 0.3 * 0.9 and max(ticks) >= 2.5 * 1.1
    assert "log scale" in panels[0].get_ylabel() and "context" in panels[0].get_xlabel()


def test_the_query_block_grid_shows_every_program_and_which_tokens_it_serves():
    """Notebook 09's grid: ``T // BLOCK_Q + batch`` programs; each sequence's blocks start at ``q_start //
    BLOCK_Q + seq``, its tokens in its first ``ceil(q_len / BLOCK_Q)`` of them, spares hatched."""
    fig = plots.plot_query_blocks([0, 1, 9, 12], 4)
    cells = sorted((p for p in fig.axes[0].patches if isinstance(p, Rectangle)), key=lambda p: p.get_x())
    assert [round(p.get_x()) for p in cells] == list(range(6))                # 12 // 4 + 3 programs
    assert [bool(p.get_hatch()) for p in cells] == [False, False, False, True, False, True]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["0", "1-4", "5-8", "9-11"]
    assert legend_labels(fig)[:3] == ["sequence 0: token 0, block 0", "sequence 1: tokens 1-8, blocks 1-3",
                                      "sequence 2: tokens 9-11, blocks 4-5"]
    assert "BLOCK_Q = 4" in fig._suptitle.get_text()


# -------------------------------------------------------------------------------------------------------
# notebook 15: a hybrid model's tables and what they save


def test_the_savings_figure_draws_each_model_both_ways_and_parts_at_the_window():
    from pagedlib.teach import hybrid_view

    lengths = [2**k for k in range(6, 14)]
    fig = hybrid_view.draw_savings(["gpt-oss-20b", "gemma-2-9b"], lengths)
    ax = fig.axes[0]
    assert "tokens" in ax.get_xlabel() and "GiB" in ax.get_ylabel()
    assert legend_labels(fig) == ["gpt-oss-20b, one table", "gpt-oss-20b, a table per group",
                                  "gemma-2-9b, one table", "gemma-2-9b, a table per group"]
    curves = hybrid_view.savings_curves(["gemma-2-9b"], lengths)["gemma-2-9b"]
    for n, uniform, grouped in zip(lengths, *curves):    # equal up to the 4,096-token window, then apart
        assert (grouped == uniform) == (n <= 4096) and grouped <= uniform
    plt.close(fig)


def test_the_two_tables_figure_marks_every_block_given_back():
    from pagedlib.core.groups import NULL_BLOCK
    from pagedlib.teach import hybrid_view

    history = [("step 1", 40, [[0, 1, 2], [3, 4, 5]]), ("step 2", 41, [[NULL_BLOCK, 1, 2], [3, 4, 5]]),
               ("step 9", 48, [[NULL_BLOCK, NULL_BLOCK, 2], [3, 4, 5]])]
    fig = hybrid_view.draw_group_tables(history, ["sliding window 16: layer 0", "full attention: layer 1"],
                                        block_size=16, window=16)
    window, full = fig.axes
    assert sum(t.get_text() == "null" for t in window.texts) == 3 and not any(
        t.get_text() == "null" for t in full.texts)
    assert len(window.lines) == 3 and not full.lines       # the window's start, one bar a row
    assert [t.get_text() for t in window.get_yticklabels()] == ["step 1 (40 tok)", "step 2 (41 tok)",
                                                              "step 9 (48 tok)"]
    plt.close(fig)


def test_the_hits_figure_draws_what_each_group_serves_and_the_hit():
    from pagedlib.teach import hybrid_view

    fig = hybrid_view.draw_hits({"shift": [(0, [0, 0]), (0, [272, 0]), (272, [272, 272])]},
                                ("full group", "window group"))
    heights = [round(bar.get_height()) for bar in fig.axes[0].patches]
    assert heights == [272, 0, 0, 272, 272, 272]           # per lookup: each group alone, then the hit
    assert legend_labels(fig) == ["full group alone", "window group alone", "hit granted"]
    plt.close(fig)
