"""Notebook 13's figures: the two tiers and what moves between them, loading against recomputing, and a
trace's hit rate against capacity."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedlib.sim import offload

# (label, from x, from y, to x, to y, colour, arrow style): the arrows between the device pool (left) and the
# host (right); a swap goes both ways, out when the request is preempted and back when it returns
MOVES = [
    ("store: a full block, once computed\n(write-through)", 0.36, 0.80, 0.64, 0.80, "tab:blue", "-|>"),
    ("store: a block the prefix cache evicts\n(victim tier)", 0.36, 0.62, 0.64, 0.62, "tab:purple", "-|>"),
    ("load: a host hit, copied into a new block\nbefore the forward pass reads it", 0.64, 0.44, 0.36, 0.44,
     "tab:green", "-|>"),
    ("swap out / swap in: a preempted request's\nblocks, and back when it returns", 0.36, 0.24, 0.64, 0.24,
     "tab:red", "<|-|>"),
]


def draw_tiers() -> plt.Figure:
    """The device pool and the host tier, with each kind of copy between them."""
    fig, ax = plt.subplots(figsize=(10, 4.2))
    boxes = ((0.04, "device pool", "GPU memory (HBM)\nblock tables point here;\nattention reads only these"),
             (0.66, "host tier", "host memory (DRAM)\nkeyed by each block's\nchained token hash"))
    for x, name, detail in boxes:
        ax.add_patch(Rectangle((x, 0.1), 0.30, 0.82, facecolor="#eef3fb", edgecolor="black"))
        ax.text(x + 0.15, 0.86, name, ha="center", fontsize=12, weight="bold")
        ax.text(x + 0.15, 0.5, detail, ha="center", va="center", fontsize=9)
    for label, x0, y0, x1, y1, colour, style in MOVES:
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=14, color=colour,
                                     lw=1.6, connectionstyle="arc3"))
        ax.text(0.5, y0 + 0.025, label, ha="center", va="bottom", fontsize=8, color=colour)
    ax.set_xlim(0, 1)
    ax.set_ylim(0.05, 0.97)
    ax.axis("off")
    ax.set_title("Two tiers of blocks and the copies between them")
    return fig


def plot_load_vs_recompute(model: offload.Transformer, contexts: Sequence[int], block_sizes: Sequence[int],
                           per_transfer: float, transfers_per_block: int) -> plt.Figure:
    """Left: load time over recompute time against the prefix length, per accelerator and its host link,
    with no per-copy cost. Right: the same at one prefix length against the block size, with a fixed cost
    ``per_transfer`` for each of ``transfers_per_block`` copies a block takes."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    middle = contexts[len(contexts) // 2]
    for name, accelerator in offload.ACCELERATORS.items():
        label = f"{name} over {accelerator.link}"
        left.plot(contexts, [offload.load_over_recompute(model, n, accelerator) for n in contexts],
                  marker="o", label=label)
        copies = dict(per_transfer=per_transfer, transfers_per_block=transfers_per_block)
        ratios = [offload.load_over_recompute(model, middle, accelerator, block_size=b, **copies)
                  for b in block_sizes]
        right.plot(block_sizes, ratios, marker="o", label=label)
    for ax in (left, right):
        ax.axhline(1.0, color="black", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("load time / recompute time")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    left.set_xlabel("prefix length (tokens)")
    left.set_title(f"{model.name}: no cost per copy")
    right.set_xlabel("block size (tokens)")
    right.set_title(f"{middle:,}-token prefix, {per_transfer * 1e6:g} us per copy, "
                    f"{transfers_per_block} copies a block")
    right.text(0.02, 0.03, "above the dashed line, recomputing wins", transform=right.transAxes, fontsize=8)
    fig.tight_layout()
    return fig


def plot_hit_curves(capacities: Sequence[int], curves: dict[str, Sequence[float]], ceiling: float,
                    gib_per_block: float) -> plt.Figure:
    """Hit rate against capacity in blocks (a second axis in GiB), one line per configuration, and the
    infinite cache's ceiling."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, rates in curves.items():
        ax.plot(capacities, rates, marker="o", label=label)
    ax.axhline(ceiling, color="black", ls="--", lw=1, label=f"infinite cache ({ceiling:.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("blocks the tiers hold together (512 tokens each)")
    ax.set_ylabel("hit rate (blocks found / blocks asked)")
    ax.set_ylim(0, ceiling * 1.15)
    gib = ax.secondary_xaxis("top", functions=(lambda b: b * gib_per_block, lambda g: g / gib_per_block))
    gib.set_xlabel("the same capacity in GiB of K/V for the 32-layer GQA model in fp16")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    return fig
