"""Notebook 14's figures: the connector's calls in a step, one request's blocks leaving a prefill engine and
arriving in a decode engine, and what splitting prefill from decode costs and buys."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedlib.sim import disagg

# (label, caller, what it does): the calls of one step, in order (caller 0: scheduler side, 1: worker side)
CALLS = [
    ("get_num_new_matched_tokens(request, n)", 0, "at admission: how many tokens after the prefix cache's n"
     " can you load?"),
    ("update_state_after_alloc(request, blocks, k)", 0, "blocks are reserved for the k tokens offered"),
    ("build_connector_meta(plan)", 0, "the step's loads and saves, handed to the worker side"),
    ("start_load_kv(pool, meta)", 1, "before the forward pass: entries into their blocks"),
    ("forward pass", 1, "reads the loaded blocks like computed ones"),
    ("wait_for_save(pool, meta)", 1, "after it: every block the step filled, out"),
    ("request_finished(request)", 0, "the request is done: forget it"),
]


def draw_contract() -> plt.Figure:
    """The calls of one engine step: the scheduler side's, then the worker side's, and the store."""
    fig, ax = plt.subplots(figsize=(12, 5))
    columns = ((0.01, 0.42, "scheduler side (plans the step)"), (0.45, 0.31, "worker side (runs it)"))
    for x, width, title in columns:
        ax.add_patch(Rectangle((x, 0.02), width, 0.9, facecolor="#eef3fb", edgecolor="black"))
        ax.text(x + width / 2, 0.94, title, ha="center", fontsize=11, weight="bold")
    ax.add_patch(Rectangle((0.83, 0.25), 0.16, 0.45, facecolor="#f4f0e6", edgecolor="black"))
    ax.text(0.91, 0.6, "KV store", ha="center", fontsize=11, weight="bold")
    ax.text(0.91, 0.42, "one file a block,\nnamed by its\nchained token hash", ha="center", fontsize=8)
    for i, (name, side, what) in enumerate(CALLS):
        y = 0.85 - i * 0.12
        x = columns[side][0] + 0.01
        colour = "black" if name == "forward pass" else "tab:blue"
        ax.text(x, y, f"{i + 1}. {name}", fontsize=8.5, family="monospace", color=colour)
        ax.text(x + 0.015, y - 0.04, what, fontsize=7.5, color="dimgray", va="top")
    # what crosses between the sides each step: the metadata down, the workers' results back (in vLLM,
    # KVConnectorOutput, read by the scheduler side's update_connector_output)
    ax.add_patch(FancyArrowPatch((0.30, 0.595), (0.455, 0.505), arrowstyle="-|>", mutation_scale=12,
                                 color="tab:purple", lw=1.5))
    ax.text(0.425, 0.5, "connector metadata", fontsize=7.5, color="tab:purple", ha="right", va="top")
    ax.add_patch(FancyArrowPatch((0.455, 0.36), (0.2, 0.36), arrowstyle="-|>", mutation_scale=12,
                                 color="tab:purple", lw=1.5, ls="--"))
    back = "back with the step's output (vLLM):\ntransfers finished, blocks that failed to load"
    ax.text(0.425, 0.375, back, fontsize=7.5, color="tab:purple", ha="right", va="bottom")
    for y, label, direction in ((0.49, "read entries", -1), (0.25, "write entries", 1)):
        start, end = (0.825, 0.765) if direction < 0 else (0.765, 0.825)
        ax.add_patch(FancyArrowPatch((start, y + 0.03), (end, y + 0.03), arrowstyle="-|>", mutation_scale=12,
                                     color="tab:green" if direction < 0 else "tab:orange", lw=1.5))
        ax.text(0.795, y + 0.055, label, ha="center", fontsize=7.5)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title("One step of an engine with a KV connector (names as in vLLM's KVConnectorBase_V1)")
    return fig


def plot_handoff(prompt_len: int, new_tokens: int, block_size: int, found: int, computed: int) -> plt.Figure:
    """One request's blocks on each engine: the prefill engine computes the prompt and saves its full
    blocks; the decode engine loads the ``found`` tokens and computes the ``computed`` ones (the prompt's
    tail, the first token, the decodes)."""
    total = prompt_len + 1 + new_tokens - 1  # the prompt, the first token, the rest
    blocks = -(-total // block_size)
    fig, ax = plt.subplots(figsize=(11, 2.8))
    colours = {"computed and saved": "tab:orange", "computed, kept (not a full block)": "navajowhite",
               "loaded from the store": "tab:green", "computed": "tab:blue", "not there": "white"}
    for block in range(blocks):
        start, end = block * block_size, min((block + 1) * block_size, total)
        if end <= prompt_len and end - start == block_size:
            top = "computed and saved"
        elif start < prompt_len:
            top = "computed, kept (not a full block)"
        else:
            top = "not there"
        bottom = "loaded from the store" if end <= found else "computed"
        for row, kind in ((1, top), (0, bottom)):
            ax.add_patch(Rectangle((block, row + 0.1), 0.92, 0.8, facecolor=colours[kind], edgecolor="black"))
        ax.text(block + 0.46, -0.25, f"{start}-{end - 1}", ha="center", fontsize=7)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black") for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_yticks([0.5, 1.5], ["decode engine", "prefill engine"])
    ax.set_xticks([])
    ax.set_xlim(-0.1, blocks)
    ax.set_ylim(-0.45, 2.05)
    ax.set_xlabel(f"blocks of {block_size} tokens (token positions under each); the decode engine computes "
                  f"{computed} tokens")
    ax.set_title(f"A {prompt_len}-token prompt prefilled on one engine, decoded on another")
    fig.tight_layout()
    return fig


def plot_latency_vs_rate(cost, prompt: int, output: int, rates: Sequence[float], budget: int) -> plt.Figure:
    """TTFT and the longest inter-token gap against the arrival rate, colocated (two GPUs) and split (one
    prefills, one decodes); a line stops at the last rate its GPUs keep up with."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, serve, options in (("colocated, 2 GPUs", disagg.colocated, {"budget": budget}),
                                 ("1 prefill + 1 decode GPU", disagg.disaggregated, {})):
        points = [(r, serve(cost, prompt, output, r, **options)) for r in rates]
        points = [(r, p) for r, p in points if p is not None]
        left.plot([r for r, _ in points], [1e3 * p.ttft for _, p in points], marker="o", label=name)
        right.plot([r for r, _ in points], [1e3 * p.itl for _, p in points], marker="o", label=name)
    left.set_ylabel("time to first token (ms)")
    right.set_ylabel("longest gap between two tokens (ms)")
    for ax in (left, right):
        ax.set_xlabel("arrival rate (requests per second)")
        ax.set_xlim(0, max(rates) * 1.04)  # every rate asked for, so a line that stops short shows it
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{prompt}-token prompts, {output} new tokens each; colocated budget {budget} tokens a step")
    fig.tight_layout()
    return fig


def plot_goodput_ratio(cost, prompts: Sequence[int], outputs: Sequence[int],
                       objectives: Sequence[tuple[float, float]]) -> plt.Figure:
    """Per pair of objectives (TTFT, longest gap; seconds), the split's goodput over colocation's (at its
    best budget) for each prompt and output length: above 1 (green), splitting pays."""
    fig, axes = plt.subplots(1, len(objectives), figsize=(5.5 * len(objectives), 4.2), squeeze=False)
    for ax, (ttft, itl) in zip(axes[0], objectives):
        ratio = np.zeros((len(outputs), len(prompts)))
        for i, output in enumerate(outputs):
            for j, prompt in enumerate(prompts):
                split = disagg.goodput(disagg.disaggregated, prompt, output, cost=cost, ttft_slo=ttft,
                                       itl_slo=itl)
                together, _ = disagg.best_colocated(cost, prompt, output, ttft_slo=ttft, itl_slo=itl)
                ratio[i, j] = split / together if together else np.inf
        image = ax.imshow(np.log2(np.clip(ratio, 1 / 8, 8)), cmap="RdYlGn", vmin=-3, vmax=3, origin="lower")
        for (i, j), value in np.ndenumerate(ratio):
            ax.text(j, i, "inf" if np.isinf(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(prompts)), [str(p) for p in prompts])
        ax.set_yticks(range(len(outputs)), [str(o) for o in outputs])
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("new tokens per request")
        ax.set_title(f"TTFT <= {ttft * 1e3:.0f} ms, gap <= {itl * 1e3:.0f} ms")
    fig.colorbar(image, ax=axes[0].tolist(), label="log2(split goodput / colocated goodput)")
    return fig
