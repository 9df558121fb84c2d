"""The matplotlib figures the notebooks draw. Every axis is labelled with its unit.

One section per notebook; each function returns the ``Figure`` it drew on.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

# Owner colours shared by the pool picture (notebook 02) and the tracer widget (notebook 03):
# sequence i gets OWNER_COLORS[i % len(OWNER_COLORS)]; free blocks are FREE_COLOR.
OWNER_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
FREE_COLOR = "#EEEEEE"


def _new_figure(width: float = 7.0, height: float = 3.5) -> tuple[Figure, plt.Axes]:
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    return fig, ax


# --- notebook 01: memory sizing -------------------------------------------------------------------


def plot_length_histogram(seq_lens: list[int], max_tokens: int) -> Figure:
    """Histogram of request lengths (tokens), with the reservation limit marked."""
    import numpy as np

    fig, ax = _new_figure(7.0, 3.0)
    bins = np.logspace(0, np.log2(max_tokens), 40, base=2)
    ax.hist(seq_lens, bins=bins, color=OWNER_COLORS[0], edgecolor="white")
    ax.set_xscale("log", base=2)
    ax.axvline(max_tokens, color=OWNER_COLORS[3], ls="--", label=f"max_tokens = {max_tokens}")
    ax.axvline(float(np.median(seq_lens)), color="black", ls=":", label=f"median = {np.median(seq_lens):.0f}")
    ax.set_xlabel("request length (tokens, log scale)")
    ax.set_ylabel("requests")
    ax.set_title(f"Synthetic workload: {len(seq_lens)} requests")
    ax.legend(frameon=False)
    return fig


def plot_reserved_vs_used(
    seq_lens: list[int], bytes_per_token: int, max_tokens: int, block_size: int
) -> Figure:
    """Per-request and total KV memory (GiB) under max-length reservation vs paging vs the ideal."""
    import numpy as np

    lens = np.sort(np.asarray(seq_lens))
    gib = bytes_per_token / 2**30
    used = lens * gib
    paged = np.ceil(lens / block_size) * block_size * gib
    reserved = np.full_like(used, max_tokens * gib)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 3.6), layout="constrained",
                                      gridspec_kw={"width_ratios": [2, 1]})
    x = np.arange(len(lens))
    left.plot(x, reserved * 1024, color=OWNER_COLORS[3], label="contiguous (reserves max_tokens)")
    left.plot(x, paged * 1024, color=OWNER_COLORS[0], label=f"paged (block_size={block_size})")
    left.plot(x, used * 1024, color="black", ls=":", label="tokens actually stored")
    left.set_yscale("log")
    left.set_xlabel("request (sorted by length)")
    left.set_ylabel("KV cache per request (MiB, log scale)")
    left.set_title("Per request")
    left.legend(frameon=False, fontsize=8)
    totals = [reserved.sum(), paged.sum(), used.sum()]
    bars = right.bar(["contiguous", "paged", "used"], totals,
                     color=[OWNER_COLORS[3], OWNER_COLORS[0], "#555555"])
    right.bar_label(bars, labels=[f"{t:.1f}" for t in totals], fontsize=8)
    right.set_ylabel("KV cache, all requests (GiB)")
    right.set_title("Whole batch")
    return fig


def plot_block_size_tradeoff(seq_lens: list[int], block_sizes: list[int]) -> Figure:
    """Wasted tail slots (% of allocated) and block-table entries per request, vs block size."""
    import numpy as np

    lens = np.asarray(seq_lens)
    waste, entries = [], []
    for b in block_sizes:
        blocks = np.ceil(lens / b)
        waste.append(100 * (blocks * b - lens).sum() / (blocks * b).sum())
        entries.append(blocks.mean())
    fig, ax = _new_figure(7.0, 3.6)
    ax.plot(block_sizes, waste, "o-", color=OWNER_COLORS[3], label="wasted tail slots")
    ax.set_xscale("log", base=2)
    ax.set_xticks(block_sizes, [str(b) for b in block_sizes])
    ax.set_xlabel("block_size (tokens per block, log scale)")
    ax.set_ylabel("wasted slots (% of allocated)", color=OWNER_COLORS[3])
    twin = ax.twinx()
    twin.plot(block_sizes, entries, "s--", color=OWNER_COLORS[0], label="block-table entries")
    twin.set_yscale("log")
    twin.set_ylabel("block-table entries per request (log)", color=OWNER_COLORS[0])
    ax.axvline(16, color="gray", lw=0.8, ls=":")
    ax.annotate("vLLM default (16)", xy=(16, max(waste) * 0.9), xytext=(4, 0), textcoords="offset points",
                fontsize=8, color="gray")
    ax.set_title("Block size: fragmentation vs lookup work")
    return fig


# --- notebook 02: block allocator -----------------------------------------------------------------


# --- notebook 04: reference attention -------------------------------------------------------------


# --- notebook 05: Triton kernel -------------------------------------------------------------------
