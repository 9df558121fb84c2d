"""The matplotlib figures the notebooks draw, one section per notebook. Every axis is labelled with its unit;
each function returns the ``Figure`` it drew on."""

from __future__ import annotations

import io
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import hsv_to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from pagedlib import figures, testing
from pagedlib.sim.simulate import CATEGORIES
from pagedlib.teach.colors import CACHED_COLOR, FREE_COLOR, OWNER_COLORS, owner_color
from pagedlib.teach.sizing import block_table_entries, paged_utilization
from pagedlib.testing import block_holders
from pagedlib.util import ceil_div

# a line per write method (notebook 02), attention implementation (04) or admission policy (07)
LINE_COLORS = {**dict.fromkeys(["append_batch", "append_tokens", "paged"], OWNER_COLORS[0]),
               **dict.fromkeys(["append_token", "reference", "reserve-max"], OWNER_COLORS[3]),
               **dict.fromkeys(["copy_", "triton", "reserve-oracle"], OWNER_COLORS[2]),
               "reserve-pow2": OWNER_COLORS[1], "paged-whole-batch": OWNER_COLORS[4], "contiguous": "#333333",
               "vllm-fused": OWNER_COLORS[1], "pagedlib-fused": OWNER_COLORS[2], "copy": "#999999"}
WASTE_COLORS = {"token": OWNER_COLORS[2], "reservation": "#E8C547", "internal": OWNER_COLORS[3],
                "external": OWNER_COLORS[4], "other": "#C3B5E0", "unattributed": "#BBBBBB"}
WASTE_LABELS = {"token": "token states", "reservation": "reservation (future tokens)",
                "internal": "internal fragmentation", "external": "external fragmentation (paper: & others)",
                "other": "other (free, too little / watermark)", "unattributed": "not broken down"}


def _new_figure(width: float, height: float, **kwargs) -> tuple[Figure, plt.Axes]:
    return plt.subplots(figsize=(width, height), layout="constrained", **kwargs)


def _log2_ticks(ax: plt.Axes, ticks: list, **kwargs) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks], **kwargs)


def _legend_right(ax: plt.Axes, handles: list, fontsize: int = 8) -> None:
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=fontsize)


def _suptitle(fig: Figure, title: str) -> Figure:
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _lines(rows: list[dict], group: str, x: str, *ys: str):
    """Per value of column ``group`` (in order of appearance): columns ``x, *ys`` of its rows, sorted by x."""
    for g in dict.fromkeys(r[group] for r in rows):
        yield g, list(zip(*sorted(tuple(r[k] for k in (x, *ys)) for r in rows if r[group] == g)))


# --- notebook 01: memory sizing -------------------------------------------------------------------
def plot_length_histogram(seq_lens: list[int], max_tokens: int) -> Figure:
    """Histogram of request lengths (tokens, log-2 bins), with the reservation limit and the median marked."""
    fig, ax = _new_figure(7.0, 3.0)
    median = float(np.median(seq_lens))  # a notebook prints np.median too, so text and legend agree
    ax.hist(seq_lens, bins=np.logspace(0, np.log2(max_tokens), 40, base=2), color=OWNER_COLORS[0],
            edgecolor="white", label="requests per bin")
    ax.set_xscale("log", base=2)
    ax.axvline(max_tokens, color=OWNER_COLORS[3], ls="--", label=f"max_tokens = {max_tokens}")
    ax.axvline(median, color="black", ls=":", label=f"median = {median:g}")
    ax.set(xlabel="request length (tokens, log scale)", ylabel="requests",
           title=f"Synthetic workload: {len(seq_lens)} requests")
    ax.legend(frameon=False)
    return fig


def plot_reserved_vs_used(seq_lens: list[int], bytes_per_token: int, max_tokens: int,
                          block_size: int) -> Figure:
    """Per-request and total KV memory under max-length reservation vs paging vs the tokens stored."""
    lens = np.sort(np.asarray(seq_lens))
    slots = {"contiguous (reserves max_tokens)": np.full(len(lens), max_tokens),
             f"paged (block_size={block_size})": ceil_div(lens, block_size) * block_size,
             "tokens actually stored": lens}
    colors, styles = [OWNER_COLORS[3], OWNER_COLORS[0], "#555555"], ["-", "-", ":"]
    fig, (left, right) = _new_figure(10.0, 3.6, ncols=2, width_ratios=[2, 1])
    for (label, held), color, ls in zip(slots.items(), colors, styles):
        left.plot(held * bytes_per_token / 2**20, color=color, ls=ls, label=label)
    left.set(yscale="log", xlabel="request (sorted by length)", title="Per request",
             ylabel="KV cache per request (MiB, log scale)")
    left.legend(frameon=False, fontsize=8)
    totals = [held.sum() * bytes_per_token / 2**30 for held in slots.values()]
    bars = right.bar(["contiguous", "paged", "stored"], totals, color=colors)
    right.bar_label(bars, labels=[f"{t:.1f}" for t in totals], fontsize=8)
    right.set(ylabel="KV cache, all requests (GiB)", title="Whole batch (colours as on the left)")
    return fig


def plot_block_size_tradeoff(seq_lens: list[int], block_sizes: list[int]) -> Figure:
    """Wasted tail slots (% of allocated) and block-table entries per request, vs block size."""
    waste = [100 * (1 - paged_utilization(seq_lens, b)) for b in block_sizes]
    entries = [block_table_entries(seq_lens, b) / len(seq_lens) for b in block_sizes]
    fig, ax = _new_figure(7.0, 3.6)
    ax.plot(block_sizes, waste, "o-", color=OWNER_COLORS[3], label="wasted tail slots (left axis)")
    _log2_ticks(ax, block_sizes)
    ax.set(xlabel="block_size (tokens per block, log scale)",
           title="Block size: wasted tail slots vs block-table entries")
    ax.set_ylabel("wasted slots (% of allocated)", color=OWNER_COLORS[3])
    twin = ax.twinx()
    twin.plot(block_sizes, entries, "s--", color=OWNER_COLORS[0], label="block-table entries (right axis)")
    twin.set_yscale("log")
    twin.set_ylabel("block-table entries per request (log scale)", color=OWNER_COLORS[0])
    ax.axvline(16, color="gray", lw=0.8, ls=":")
    ax.annotate("vLLM default (16)", xy=(16, max(waste) * 0.9), xytext=(4, 0), textcoords="offset points",
                fontsize=8, color="gray")
    fig.legend(loc="outside lower center", ncols=2, frameon=False, fontsize=8)
    return fig


# --- notebook 02: block allocator -----------------------------------------------------------------
def plot_block_pool(cache, cols: int | None = None) -> Figure:
    """The physical pool of a ``PagedKVCache``: a cell per block, ``cols`` a row, slots coloured by holder."""
    nb, bs, order = cache.num_blocks, cache.block_size, list(cache.tables)
    cols = cols or min(nb, 16)
    rows = ceil_div(nb, cols)
    fig, ax = _new_figure(min(0.62 * cols + 2.6, 13.0), 0.62 * rows + 1.0)
    holders = block_holders(cache)  # per block: the sequences holding it, in table order
    entries = testing.holders(cache.manager)  # per block: (sequence, index in its table) of each holder
    fill = [max([0, *(min(bs, cache.seq_lens[s] - i * bs) for s, i in hs)]) for hs in entries]
    queue = cache.prefix_cache.free_queue if cache.prefix_cache else []  # cached free blocks, evicted first
    label = {b: str(i + 1) for i, b in enumerate(reversed(cache.free))}  # 1: the top of the free stack
    label |= {b: f"e{i + 1}" for i, b in enumerate(queue)}
    for b in range(nb):
        x, y = b % cols, -(b // cols)
        if holders[b]:
            _draw_held_block(ax, x, y, [owner_color(s, order) for s in holders[b]], fill[b], bs)
        else:
            color = CACHED_COLOR if label[b].startswith("e") else FREE_COLOR
            ax.add_patch(Rectangle((x, y), 0.9, 0.7, color=color, ec="#BBBBBB", lw=0.6))
            ax.text(x + 0.45, y + 0.35, label[b], ha="center", va="center", fontsize=7, color="#666666")
        ax.text(x + 0.45, y + 0.78, str(b), ha="center", va="bottom", fontsize=7)
    _legend_right(ax, _pool_legend(cache, holders, fill, label))
    ax.set(xlim=(-0.1, cols), ylim=(-rows + 0.9, 1.15))
    ax.set_axis_off()
    used, stored = sum(map(bool, holders)), sum(fill)  # physical: a shared block and its slots count once
    ax.set_title(f"Physical pool: {used}/{nb} blocks in use" + (
        f", {stored} of their {used * bs} slots hold a token ({stored / (used * bs):.0%})" if used else ""),
        fontsize=9, loc="left")
    return fig


def _draw_held_block(ax: plt.Axes, x: float, y: float, colors: list[str], fill: int, block_size: int) -> None:
    """One held block, a band per holder (the first on top), ``fill`` slots filled and the rest hatched."""
    w, h = 0.9 / block_size, 0.7 / len(colors)
    for k, color in enumerate(colors):
        for off in range(block_size):
            style = {"facecolor": color, "edgecolor": "white"} if off < fill else \
                {"facecolor": "white", "edgecolor": color, "hatch": "////"}
            ax.add_patch(Rectangle((x + off * w, y + 0.7 - (k + 1) * h), w, h, lw=0.6, **style))
    if len(colors) > 1:
        ax.add_patch(Rectangle((x, y), 0.9, 0.7, fill=False, ec="black", lw=1.6))
        ax.text(x + 0.45, y + 0.35, f"x{len(colors)}", ha="center", va="center", fontsize=7,
                fontweight="bold", bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5})


def _pool_legend(cache, holders: list[list], fill: list[int], label: dict[int, str]) -> list:
    """Legend entries for ``plot_block_pool``: only the colours and marks the picture shows."""
    order, free, cached = list(cache.tables), len(cache.free), len(label) - len(cache.free)
    held = {s: figures.slots_of(cache, s)[1] // cache.block_size for s in order}  # every group's blocks
    handles = [Patch(color=owner_color(s, order), label=f"seq {s}: {cache.seq_lens[s]} tokens, "
                     f"{held[s]} blocks") for s in order if held[s]]
    grey = {"edgecolor": "#BBBBBB"}
    marks = [(any(len(h) > 1 for h in holders), "shared: a band per holder, x = reference count",
              {"facecolor": "white", "edgecolor": "black", "lw": 1.6}),
             (any(h and f < cache.block_size for h, f in zip(holders, fill)), "hatched: slot not yet written",
              {"facecolor": "white", "edgecolor": "#777777", "hatch": "////"}),
             (free, f"free: {free} (1 = top of the stack, taken next)", {"facecolor": FREE_COLOR, **grey}),
             (cached, f"cached, free: {cached} (e1 = evicted first)", {"facecolor": CACHED_COLOR, **grey})]
    return handles + [Patch(label=text, **style) for shown, text, style in marks if shown]


def plot_alloc_benchmark(rows: list[dict]) -> Figure:
    """Decode write throughput (tokens/s, log-log) against batch size per method in ``bench.alloc`` rows."""
    fig, ax = _new_figure(6.5, 3.4)
    decode = [r for r in rows if r["phase"] == "decode"]
    for method, (batch, rate) in _lines(decode, "method", "tokens", "tokens_per_s"):
        ax.plot(batch, rate, marker="o", label=method, color=LINE_COLORS.get(method),
                ls=":" if method == "copy_" else "-")
    _log2_ticks(ax, sorted({r["tokens"] for r in decode}))
    ax.set(yscale="log", xlabel="decode batch (sequences, one new token each; log scale)",
           ylabel="tokens written per second (log scale)")
    ax.grid(alpha=0.3, which="both")
    _legend_right(ax, ax.get_legend_handles_labels()[0])  # beside the axes: the points stay visible
    ax.set_title("Writing one decode step into the KV cache", fontsize=9)
    return fig


# --- notebook 04: reference attention -------------------------------------------------------------
def plot_gather_mask(tables: list[list[int]], seq_lens: list[int], block_size: int) -> Figure:
    """What the vectorized gather copies, a row per sequence: a slot coloured (token) or crossed (masked)."""
    width = max(len(t) for t in tables) * block_size
    fig, ax = _new_figure(0.32 * width + 1.8, 0.6 * len(tables) + 1.0)
    pitch = 1.5  # vertical distance between rows, room for the block labels
    for s, (table, n) in enumerate(zip(tables, seq_lens, strict=True)):
        y = -s * pitch
        for p in range(width):
            color = OWNER_COLORS[s % len(OWNER_COLORS)] if p < n else FREE_COLOR
            ax.add_patch(plt.Rectangle((p, y - 0.4), 0.95, 0.8, color=color, ec="white"))
            for dy in (0.25, -0.25) if p >= n else ():
                ax.plot([p + 0.2, p + 0.75], [y - dy, y + dy], color="#999999", lw=0.8)
        for j in range(width // block_size):
            label = f"block {table[j]}" if j < len(table) and j * block_size < n else "padding -> 0"
            ax.text(j * block_size + block_size / 2, y + 0.5, label, ha="center", va="bottom", fontsize=7)
    for j in range(1, width // block_size):
        ax.axvline(j * block_size - 0.025, color="black", lw=0.8)
    ax.set(xlim=(-0.2, width + 0.2), ylim=(-(len(tables) - 1) * pitch - 0.6, 1.0),
           xlabel="position in the gathered K/V (tokens)")
    ax.set_yticks(-pitch * np.arange(len(tables)), [f"seq {s} (len {n})" for s, n in enumerate(seq_lens)])
    ax.set_title("Gathered blocks: coloured = token, grey x = masked (zeroed, score -inf)", fontsize=9)
    ax.spines[["top", "right", "left"]].set_visible(False)
    return fig


def plot_attention_sweep(rows: list[dict], x: str = "block_size", title: str = "") -> Figure:
    """Decode time (ms) and bandwidth (GB/s) per implementation in ``bench.attention`` rows against ``x``."""
    fig, (left, right) = _new_figure(10.0, 3.4, ncols=2)
    for impl, (xs, ms, bandwidth) in _lines(rows, "impl", x, "ms", "GB/s"):
        style = {"color": LINE_COLORS.get(impl), "marker": "o", "label": impl}
        left.plot(xs, ms, **style)
        right.plot(xs, bandwidth, **style)
    xlabel = {"block_size": "block size (tokens per block, log scale)",
              "context": "context length (tokens per sequence, log scale)"}.get(x, x)
    for ax, ylabel in ((left, "time per decode step (ms)"), (right, "achieved bandwidth (GB/s)")):
        _log2_ticks(ax, sorted({r[x] for r in rows}))
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
    if x == "context":
        left.set(yscale="log", ylabel="time per decode step (ms, log scale)")
    for ax in (left, right):
        if ax.get_yscale() == "linear":
            ax.set_ylim(bottom=0)  # from 0: a cut axis makes run-to-run noise look like an effect
    left.legend(frameon=False)
    return _suptitle(fig, title)


def plot_fused_vs_gather(runs: list[list[dict]], title: str = "") -> Figure:
    """``bench attention``'s vLLM rows of several runs: each path's speedup over contiguous SDPA against
    the context, one panel per batch; one line per path and run (the runs as thin lines of one colour)."""
    batches = sorted({r["batch"] for rows in runs for r in rows})
    fig, axes = _new_figure(3.4 * len(batches), 3.8, ncols=len(batches), sharey=True, squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for run, rows in enumerate(runs):
            mine = [r for r in rows if r["batch"] == batch]
            for impl, (contexts, ratios) in _lines(mine, "impl", "context", SPEEDUP_KEY):
                label = FUSED_LABELS.get(impl, impl) if run == 0 else None
                ax.plot(contexts, ratios, marker="o", markersize=3, linewidth=1, alpha=0.8, label=label,
                        color=LINE_COLORS.get(impl), ls=":" if impl == "copy" else "-")
        ax.axhline(1.0, color="black", linewidth=0.8)
        _log2_ticks(ax, sorted({r["context"] for rows in runs for r in rows}))
        ax.set_yscale("log", base=2)
        exponents = [math.log2(r[SPEEDUP_KEY]) for rows in runs for r in rows]
        ticks = [2.0 ** e for e in range(math.floor(min(exponents)), math.ceil(max(exponents)) + 1)]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.set(xlabel="context (tokens, log scale)", title=f"batch {batch}")
        ax.grid(alpha=0.3)
    axes[0][0].set(ylabel="speedup vs SDPA (x, log scale)")
    fig.legend(handles=axes[0][0].get_legend_handles_labels()[0], loc="outside lower center", ncols=2,
               frameon=False, fontsize=8)
    return _suptitle(fig, title)


SPEEDUP_KEY = "speedup vs SDPA (x faster)"  # bench.attention.SPEEDUP (teach does not import bench)
FUSED_LABELS = {"vllm-fused": "vLLM's fused CPU kernel (reads the blocks in place)",
                "pagedlib-fused": "pagedlib's fused CPU kernel (reads the blocks in place)",
                "paged": "pagedlib's gather path (copies the blocks, then attends)",
                "contiguous": "SDPA on contiguous K/V (the baseline, 1x)",
                "copy": "a plain copy of K and V (memory's pace)"}


# --- notebook 05: Triton kernel -------------------------------------------------------------------
def plot_split_k_programs(labels: list[str], no_split: list[int], split: list[int], sm_count: int) -> Figure:
    """Programs the decode kernel launches per shape (``labels``), without and with split-K, vs the SMs."""
    fig, ax = _new_figure(10.0, 3.6)
    x, width = np.arange(len(labels)), 0.4
    ax.bar(x - width / 2, no_split, width, label="no split: batch x KV heads", color=OWNER_COLORS[0])
    ax.bar(x + width / 2, split, width, label="split-K: x num_splits", color=OWNER_COLORS[1])
    # a wave: one program per SM; split-K aims at about two waves
    ax.axhline(sm_count, color="black", linewidth=1, linestyle="--",
               label=f"{sm_count} programs: one wave (one per SM)")
    ax.axhline(2 * sm_count, color="black", linewidth=1, linestyle=":",
               label=f"{2 * sm_count} programs: two waves (split-K's target)")
    ax.set_yscale("log", base=2)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set(xlabel="batch / context (tokens)", ylabel="programs launched (count)",
           title="Does the grid fill the GPU? (8 KV heads)")
    _legend_right(ax, ax.get_legend_handles_labels()[0])
    return fig


# --- notebook 06: sharing blocks ------------------------------------------------------------------
def plot_sharing_memory(generated: list[int], curves: dict[str, list[float]], title: str = "") -> Figure:
    """KV memory (MiB) against tokens generated so far, one line per strategy in ``curves``."""
    fig, ax = _new_figure(7.0, 3.4)
    for (label, mib), color in zip(curves.items(), (OWNER_COLORS[3], OWNER_COLORS[0], OWNER_COLORS[2])):
        ax.plot(generated, mib, color=color, label=label)
    ax.set(xlabel="tokens generated per sample", ylabel="KV cache in use (MiB)", ylim=(0, None))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    ax.set_title(title, fontsize=9)
    return fig


def plot_hit_rate_vs_pool(pool_blocks: list[int], hit_rates: list[float], evictions: list[int],
                          title: str = "", marks: dict[int, str] | None = None) -> Figure:
    """Prefix-cache hit rate and blocks evicted against the pool size; ``marks``: pool size -> text."""
    fig, ax = _new_figure(7.0, 3.4)
    ax.plot(pool_blocks, [100 * r for r in hit_rates], "o-", color=OWNER_COLORS[0],
            label="hit rate (left axis)")
    ax.set(xlabel="pool size (blocks)", ylim=(0, 100))
    ax.set_title(title, fontsize=9)
    ax.set_ylabel("prompt tokens found in the cache (%)", color=OWNER_COLORS[0])
    twin = ax.twinx()
    twin.plot(pool_blocks, evictions, "s--", color=OWNER_COLORS[3], label="evictions (right axis)")
    twin.set_ylim(0, 1.08 * max(evictions, default=1))
    twin.set_ylabel("cached blocks evicted (count)", color=OWNER_COLORS[3])
    for x, text in (marks or {}).items():
        ax.axvline(x, color="gray", lw=0.8, ls=":")
        ax.text(x, 97, f" {text}", fontsize=7, color="#555555", va="top", ha="left")
    fig.legend(loc="outside lower center", ncols=2, frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    return fig


# --- notebook 07: serving simulation --------------------------------------------------------------
def plot_waste_breakdown(ours: dict[str, dict[str, float]], paper: dict[str, dict[str, float]]) -> Figure:
    """The vLLM paper's Figure 2 (hatched) next to ours (``SimResult.breakdown``), stacked by category."""
    fig, ax = _new_figure(9.5, 4.2)
    ticks, labels = [], []
    for i, policy in enumerate(ours):
        for j, (who, parts) in enumerate((("paper", paper.get(policy)), ("ours", ours[policy]))):
            if parts is None:
                continue
            x, bottom = 2.6 * i + 1.05 * j, 0.0
            rest = max(0.0, 1.0 - sum(parts.values()))
            for key, frac in [(k, f) for k, f in [*parts.items(), ("unattributed", rest)] if f >= 5e-4]:
                ax.bar(x, 100 * frac, bottom=100 * bottom, width=0.95, color=WASTE_COLORS[key],
                       edgecolor="white", hatch="///" if who == "paper" else None, lw=0.5)
                if frac >= 0.035:
                    ax.text(x, 100 * (bottom + frac / 2), f"{100 * frac:.1f}", ha="center", va="center",
                            fontsize=7)
                bottom += frac
            ticks.append(x)
            labels.append(f"{who}\n{policy}" if j else who)
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set(ylabel="KV memory in use or stranded (%)", ylim=(0, 100))
    handles = [Patch(color=WASTE_COLORS[k], label=WASTE_LABELS[k]) for k in WASTE_COLORS]
    _legend_right(ax, [*handles, Patch(facecolor="white", edgecolor="#555555", hatch="///",
                                       label="hatched: the paper's Figure 2")])
    ax.set_title("Where the KV memory goes: the paper's Figure 2 and this simulation", fontsize=10)
    return fig


def plot_serving_timeline(results: list) -> Figure:
    """Per step, for each ``SimResult``: the share of KV memory holding tokens (top), requests running."""
    fig, (top, bottom) = _new_figure(9.0, 5.0, nrows=2, sharex=True)
    for r in results:
        every = max(1, len(r.series["step"]) // 1500)  # at most ~1,500 points a line
        s = {k: v[::every] for k, v in r.series.items()}
        used = sum(s[k] for k in CATEGORIES)
        util = np.where(used > 0, 100 * s["token"] / np.maximum(used, 1), np.nan)
        style = {"color": LINE_COLORS.get(r.policy), "lw": 0.9, "label": r.policy}
        top.plot(s["step"], util, **style)
        bottom.plot(s["step"], s["running"], **style)
    top.set(ylabel="memory holding tokens (%)", ylim=(0, 102))
    bottom.set(ylabel="running requests", xlabel="step (one batched forward pass)")
    bottom.legend(frameon=False, fontsize=8, loc="upper right")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    return fig


def plot_policy_sweep(rows: list[dict], x: str, ys: list[tuple[str, str]], xlabel: str,
                      title: str = "") -> Figure:
    """A panel per ``(key, label)`` in ``ys``: that column of ``SimResult.row()`` rows vs ``x``, by policy."""
    fig, axes = _new_figure(4.6 * len(ys), 3.4, ncols=len(ys), squeeze=False)
    for ax, (key, label) in zip(axes[0], ys):
        for i, (policy, (xs, vals)) in enumerate(_lines(rows, "policy", x, key)):
            ax.plot(xs, vals, marker="osD^"[i % 4], ms=9 - 2 * (i % 4), ls=("-", "--", ":", "-.")[i % 4],
                    color=LINE_COLORS.get(policy), label=policy, clip_on=False, zorder=3)  # unclipped at 0
        _log2_ticks(ax, sorted({r[x] for r in rows}), fontsize=8)
        ax.set(ylim=(0, 1.08 * max(max(r[key] for r in rows), 1e-9)), xlabel=xlabel, ylabel=label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(frameon=False, fontsize=8)
    return _suptitle(fig, title)


def request_rgb(req_ids: np.ndarray) -> np.ndarray:
    """[..., 3] RGB of request ids, one colour per id whatever the count: the hue steps round the wheel by the
    golden ratio (ids next to each other, which sit next to each other in the pool, get distant hues and
    no two ids the same one), and every other id is darker."""
    hue = (np.asarray(req_ids) * 0.6180339887) % 1.0
    value = np.where(np.asarray(req_ids) % 2 == 0, 0.92, 0.68)
    return hsv_to_rgb(np.stack([hue, np.full(hue.shape, 0.75), value], axis=-1))


def _occupancy_rgb(owner, filled):
    """RGB of slots: white if free, the owner's colour if it holds a token, a pale tint if set aside."""
    rgb = np.ones((*owner.shape, 3))
    held = owner >= 0
    base = request_rgb(owner[held])
    rgb[held] = np.where(filled[held][:, None], base, 0.3 * base + 0.7)
    return rgb


def plot_pool_occupancy(results: list) -> Figure:
    """The pool over time (x: step, y: slot address), a panel per ``SimResult`` with ``record_occupancy``;
    the steps with preemptions marked in a strip above the pool."""
    fig, axes = _new_figure(4.4 * len(results) + 2.0, 4.0, ncols=len(results), squeeze=False, sharex=True,
                            sharey=True)
    for ax, r in zip(axes[0], results):
        occ, slots = r.occupancy, r.occupancy.owner.shape[1]
        ax.imshow(_occupancy_rgb(occ.owner.T, occ.filled.T), aspect="auto", origin="lower",
                  interpolation="nearest", extent=(occ.steps[0] - 0.5, occ.steps[-1] + 0.5, 0, slots))
        if r.policy == "paged" and slots // r.block_size <= 64:
            for b in range(1, slots // r.block_size):
                ax.axhline(b * r.block_size, color="white", lw=0.3)
        ax.axhline(slots, color="#555555", lw=0.8)  # the top of the pool; the marks sit above it
        hit = r.series["preempted"] > 0
        ax.plot(r.series["step"][hit], [slots * 1.045] * int(hit.sum()), "v", color="#D62728", ms=7,
                markeredgecolor="black", markeredgewidth=0.5)
        last = max(res.occupancy.steps[-1] for res in results)  # one step axis for all panels
        ax.set(xlim=(-0.5, last + 0.5), ylim=(0, slots * 1.09), xlabel="step",
               ylabel=f"slot address ({slots} slots, block_size {r.block_size})")
        ax.set_title(f"{r.policy}: mean {r.mean_running:.1f} running, {r.steps} steps, "
                     f"{r.preemptions} preemptions", fontsize=9)
    requests = 1 + max(int(res.occupancy.owner.max()) for res in results)
    _legend_right(axes[0][-1], _occupancy_legend(requests))
    return fig


def _occupancy_legend(requests: int) -> list:
    """Legend of the pool pictures: the first request colours, their pale tint, free, preempted."""
    handles = [Patch(color=request_rgb(i), label=f"request {i} (holds a token)")
               for i in range(min(4, requests))]
    handles.append(Patch(facecolor="none", edgecolor="none",
                         label=f"... a colour of its own for each of the {requests} requests"))
    pale = 0.3 * request_rgb(0) + 0.7
    handles += [Patch(color=pale, label="pale: set aside, still empty"),
                Patch(facecolor="white", edgecolor="#999999", label="white: free"),
                Line2D([], [], marker="v", color="#D62728", markeredgecolor="black", ls="",
                       label="above the pool: a step with preemptions")]
    return handles


def _recorded_index(result, step: int) -> int:
    """Index of the last recorded step at or before ``step`` (the first one if ``step`` comes earlier):
    the recording skips idle steps, so a step number and an index differ."""
    index = int(np.searchsorted(result.occupancy.steps, step, side="right")) - 1
    return max(index, 0)


def plot_pool_step(result, step: int, cols: int = 8) -> Figure:
    """The pool of a recorded ``SimResult`` at step ``step`` (the last recorded step at or before it),
    ``cols`` blocks a row."""
    occ, bs, index = result.occupancy, result.block_size, _recorded_index(result, step)
    owner, filled = occ.owner[index], occ.filled[index]
    rows, width = ceil_div(len(owner) // bs, cols), cols * bs
    pad = ((0, rows * width - len(owner)), (0, 0))  # the padding slots draw white, as free ones
    rgb = np.pad(_occupancy_rgb(owner, filled), pad, constant_values=1.0).reshape(rows, width, 3)
    fig, ax = _new_figure(min(0.5 * cols * max(bs, 4) / 4 + 4.0, 14.0), 0.55 * rows + 1.4)
    ax.imshow(rgb, interpolation="nearest", aspect="auto", origin="lower", extent=(0, width, 0, rows))
    ax.vlines(range(0, width + 1, bs), 0, rows, color="#555555", lw=0.8)  # a box per block
    ax.hlines(range(rows + 1), 0, width, color="#555555", lw=0.8)
    for i in range(len(owner)):  # label each run of slots one request holds (a block, or a slab's row)
        new_block = result.policy == "paged" and i % bs == 0
        if owner[i] >= 0 and (i % width == 0 or new_block or owner[i] != owner[i - 1]):
            ax.text(i % width + 0.3, i // width + 0.5, str(owner[i]), ha="left", va="center", fontsize=7)
    ax.set_xticks(range(0, width + 1, bs))
    ax.set_yticks([r + 0.5 for r in range(rows)], [str(r * width) for r in range(rows)], fontsize=7)
    ax.set(xlabel=f"slot offset in the row (one box = one block of {bs} slots; a number: the request id)",
           ylabel="first slot address of the row")
    solid = Patch(color=request_rgb(0), label="solid: holds a token (colour by request)")
    _legend_right(ax, [solid, *_occupancy_legend(1)[2:-1]], fontsize=7)
    held = len(set(owner[owner >= 0].tolist()))
    ax.set_title(f"{result.policy}, step {occ.steps[index]}: {held} requests hold {int((owner >= 0).sum())} "
                 f"of {len(owner)} slots, {int(filled.sum())} with a token", fontsize=9)
    return fig


def pool_step_png(result, step: int, dpi: int = 90) -> bytes:
    """``plot_pool_step`` as PNG bytes (the figure closed): the frames of the notebook-07 slider."""
    fig, buf = plot_pool_step(result, step), io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def plot_prefix_caching(results: dict[str, object], title: str = "") -> Figure:
    """Prefix caching off vs on (label -> ``SimResult``): running requests, and prompt tokens by source."""
    fig, (left, right) = _new_figure(9.0, 3.2, ncols=2, width_ratios=[2, 1])
    for (label, r), color in zip(results.items(), (OWNER_COLORS[3], OWNER_COLORS[0])):
        left.plot(r.series["step"], r.series["running"], color=color, lw=0.9, label=label)
    left.set(xlabel="step (one batched forward pass)", ylabel="running requests")
    left.grid(alpha=0.3)
    left.legend(frameon=False, fontsize=8)
    computed = [r.prefill_tokens / 1000 for r in results.values()]
    found = [r.cached_tokens / 1000 for r in results.values()]
    right.bar(list(results), computed, color=OWNER_COLORS[3], label="prefilled (computed)")
    right.bar(list(results), found, bottom=computed, color=CACHED_COLOR, label="found in the cache")
    right.set(ylabel="tokens at admission (thousands)",
              ylim=(0, 1.35 * max(c + f for c, f in zip(computed, found))))  # room for the legend
    right.legend(frameon=False, fontsize=8, loc="upper center")
    right.grid(alpha=0.3, axis="y")
    return _suptitle(fig, title)


# --- notebook 08: end to end ----------------------------------------------------------------------
def plot_engine_timeline(history: list[dict], num_blocks: int, title: str) -> Figure:
    """Blocks held per request after each step (``history``: per step, ``blocks``: request id -> blocks held,
    and the ids ``preempted`` and ``finished``), stacked, with a mark where one finished or was preempted."""
    fig, ax = _new_figure(8.0, 3.2)
    ids = sorted({r for h in history for r in h["blocks"]} | {r for h in history for r in h["finished"]})
    steps, bottom = range(len(history)), [0] * len(history)
    for r in ids + ["free"]:
        held = [num_blocks - b if r == "free" else h["blocks"].get(r, 0) for h, b in zip(history, bottom)]
        ax.bar(steps, held, bottom=bottom, width=1.0, linewidth=0, label="free" if r == "free" else
               f"request {r}", color=FREE_COLOR if r == "free" else owner_color(r))
        bottom = [b + n for b, n in zip(bottom, held)]
    top = num_blocks / 16  # the marker row above the pool
    for t, h in enumerate(history):
        for r in h["finished"]:
            ax.plot(t, num_blocks + top, marker="o", color=owner_color(r), ms=5)
        for r in h["preempted"]:
            ax.plot(t, num_blocks + 2.2 * top, marker="x", color=owner_color(r), ms=7, mew=2)
    marks = [Line2D([], [], ls="", marker=m, color="0.3", label=text, ms=6)
             for m, text in (("o", "finished (in its colour)"), ("x", "preempted (in its colour)"))]
    ax.set(xlabel="engine step", ylabel="KV blocks held", ylim=(0, num_blocks + 3 * top),
           xlim=(-0.5, len(history) - 0.5))
    ax.set_yticks(range(0, num_blocks + 1, ceil_div(num_blocks, 8)))  # whole blocks only
    _legend_right(ax, ax.get_legend_handles_labels()[0] + marks)
    ax.set_title(title, fontsize=9)
    return fig


# --- notebook 09: chunked prefill -----------------------------------------------------------------
def plot_itl(latencies: dict[str, dict], title: str = "") -> Figure:
    """Inter-token latency per mode (``SimResult.latencies``): each gap when it ended, and all gaps sorted."""
    fig, (ax, cdf) = _new_figure(10.0, 3.4, ncols=2, width_ratios=[1.6, 1])
    for i, (mode, lat) in enumerate(latencies.items()):
        color, itl = OWNER_COLORS[2 * i], np.sort(lat["itl"]) * 1e3
        ax.scatter(lat["itl_at"], lat["itl"] * 1e3, s=4, color=color, label=mode, alpha=0.6)
        share = np.arange(1, len(itl) + 1) / len(itl) * 100
        cdf.plot(share, itl, color=color, label=mode)
        cdf.plot([50, 99], np.percentile(itl, [50, 99]), "o", color=color, ms=4)
    ax.set(xlabel="modelled time (s)", ylabel="inter-token latency (ms)", yscale="log")
    cdf.set(xlabel="share of gaps (%), p50 and p99 marked", ylabel="inter-token latency (ms)", yscale="log")
    ax.legend(frameon=False, fontsize=8, markerscale=3)
    cdf.legend(frameon=False, fontsize=8)
    return _suptitle(fig, title)


def plot_step_layout(seq_ids: list, starts: list[int], counts: list[int], kinds: list[str], tables: dict,
                     block_size: int) -> Figure:
    """One step's flat tokens: ``seq_ids[i]`` brings ``counts[i]`` tokens (a ``kinds[i]``) from position
    ``starts[i]``; a cell shows a token's position and the slot (``block.offset``) its K/V goes to."""
    total = sum(counts)
    fig, ax = _new_figure(max(6.0, 0.5 * total + 1.5), 2.4)
    x, handles = 0, []
    for sid, start, n, kind in zip(seq_ids, starts, counts, kinds):
        color = owner_color(sid, list(seq_ids))
        for j, pos in enumerate(range(start, start + n)):
            block, off = tables[sid][pos // block_size], pos % block_size
            ax.add_patch(Rectangle((x + j, 0), 0.95, 1, color=color, alpha=0.85))
            ax.text(x + j + 0.47, 0.72, str(pos), ha="center", va="center", fontsize=9, color="white")
            ax.text(x + j + 0.47, 0.28, f"{block}.{off}", ha="center", va="center", fontsize=9,
                    color="white", fontweight="bold")
        ax.text(x, -0.25, str(x), ha="left", va="top", fontsize=7)
        where = f"position {start}" if n == 1 else f"positions {start}-{start + n - 1}"
        handles.append(Patch(color=color, label=f"sequence {sid}: {kind}, {where}"))
        x += n
    ax.text(x, -0.25, str(x), ha="left", va="top", fontsize=7)
    ax.set(xlim=(-0.2, total + 0.2), ylim=(-0.7, 1.1), yticks=[],
           xlabel="flat token index in the step (query_start_loc marked below the cells)")
    ax.set_xticks([])
    _legend_right(ax, handles)
    return _suptitle(fig, "cells: position (top), block.offset of its slot (bottom)")


def plot_query_blocks(query_start_loc: list[int], block_q: int) -> Figure:
    """The varlen kernel's grid for one step: ``T // block_q + batch`` programs, one per query block number;
    sequence ``b``'s numbers start at ``query_start_loc[b] // block_q + b``, its first ``ceil(q_len /
    block_q)`` blocks hold its tokens and the rest up to the next sequence's start are spares."""
    loc = list(query_start_loc)
    batch, total = len(loc) - 1, loc[-1]
    grid = total // block_q + batch
    fig, ax = _new_figure(max(6.0, 0.75 * grid + 1.5), 1.9)
    handles = []
    for b in range(batch):
        first = loc[b] // block_q + b
        end = loc[b + 1] // block_q + b + 1 if b + 1 < batch else grid      # the next sequence's first
        color = OWNER_COLORS[b % len(OWNER_COLORS)]
        for n in range(first, end):
            lo = loc[b] + (n - first) * block_q                             # its first token, flat index
            if lo < loc[b + 1]:
                ax.add_patch(Rectangle((n, 0), 0.95, 1, color=color, alpha=0.85))
                hi = min(lo + block_q, loc[b + 1]) - 1
                ax.text(n + 0.47, 0.5, f"{lo}" if lo == hi else f"{lo}-{hi}", ha="center", va="center",
                        fontsize=9, color="white")
            else:
                ax.add_patch(Rectangle((n, 0), 0.95, 1, facecolor="white", edgecolor=color, hatch="//"))
        tokens = str(loc[b]) if loc[b + 1] - loc[b] == 1 else f"{loc[b]}-{loc[b + 1] - 1}"
        blocks = str(first) if end - first == 1 else f"{first}-{end - 1}"
        handles.append(Patch(color=color, label=f"sequence {b}: token{'s' * (tokens != str(loc[b]))} "
                                                f"{tokens}, block{'s' * (blocks != str(first))} {blocks}"))
    handles.append(Patch(facecolor="white", edgecolor="grey", hatch="//",
                         label="spare block: returns at once"))
    ax.set(xlim=(-0.2, grid + 0.2), ylim=(-0.1, 1.1), yticks=[], xticks=[n + 0.47 for n in range(grid)],
           xticklabels=[str(n) for n in range(grid)],
           xlabel=f"query block number = program (grid of {grid}); cells: the flat tokens it attends for")
    _legend_right(ax, handles)
    return _suptitle(fig, f"query_start_loc = {loc}, BLOCK_Q = {block_q}")


# --- notebook 10: an FP8 KV cache -------------------------------------------------------------------
def plot_representable(values: dict[str, np.ndarray], lo: float = 0.5, hi: float = 4.0) -> Figure:
    """Every finite value (``values``: format -> its values) in ``[lo, hi]``, a row per format, log-2 axis."""
    fig, ax = _new_figure(8.0, 0.6 + 0.45 * len(values))
    for row, (name, v) in enumerate(values.items()):
        v = np.unique(v[(v >= lo) & (v <= hi)])
        ax.plot(v, np.full_like(v, row), "|", ms=14, mew=1.5, color=OWNER_COLORS[row],
                label=f"{name}: {len(v)} values")
    _log2_ticks(ax, [t for t in (0.5, 1, 2, 4, 8) if lo <= t <= hi])
    ax.set(xlabel="value (log scale)", yticks=range(len(values)), yticklabels=list(values),
           ylim=(-0.6, len(values) - 0.4), title=f"Representable values between {lo:g} and {hi:g}")
    ax.grid(alpha=0.3, axis="x")
    _legend_right(ax, ax.get_legend_handles_labels()[0])
    return fig


def plot_rounding_errors(errors: dict[str, np.ndarray]) -> Figure:
    """Histogram of relative rounding errors ``(fp8 - x) / |x|`` in % (within +-15), an outline per format."""
    fig, ax = _new_figure(7.0, 3.0)
    for i, (name, e) in enumerate(errors.items()):
        rms = np.sqrt(np.mean(e**2)) * 100
        ax.hist(e * 100, bins=60, range=(-15, 15), histtype="step", lw=1.8, color=OWNER_COLORS[i],
                weights=np.full(len(e), 100 / len(e)), label=f"{name} (rms {rms:.1f}%)")
    ax.set(xlabel="relative rounding error (%)", ylabel="share of elements (%)",
           title="Rounding error of the tiny model's K and V")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    return fig
