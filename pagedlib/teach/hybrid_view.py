"""Notebook 15's figures: what window layers give back, in released models (``draw_savings``) and in one
request's two block tables (``draw_group_tables``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedlib.core.groups import NULL_BLOCK
from pagedlib.teach.colors import FREE_COLOR, OWNER_COLORS
from pagedlib.teach.hybrid_sizing import HYBRID_PRESETS, sequence_kv_bytes

GIB = 2**30


def savings_curves(names: Sequence[str], lengths: Sequence[int], block_size: int = 16
                   ) -> dict[str, tuple[list[float], list[float]]]:
    """Per preset: GiB one sequence holds at each length, with one table for every layer and in vLLM's
    groups (bf16 K/V, during a decode step)."""
    curves = {}
    for name in names:
        spec = HYBRID_PRESETS[name]
        sizes = [sequence_kv_bytes(spec, n, block_size) for n in lengths if n <= spec.max_model_len]
        curves[name] = ([s.uniform / GIB for s in sizes], [s.grouped / GIB for s in sizes])
    return curves


def draw_savings(names: Sequence[str], lengths: Sequence[int], block_size: int = 16) -> Any:
    """GiB of KV cache one sequence holds against its length, uniform (dashed) and grouped (solid), one
    colour per model; log-log axes."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    for i, (name, (uniform, grouped)) in enumerate(savings_curves(names, lengths, block_size).items()):
        xs = list(lengths)[:len(uniform)]
        color = OWNER_COLORS[i % len(OWNER_COLORS)]
        ax.plot(xs, uniform, "--", color=color, lw=1.4, label=f"{name}, one table")
        ax.plot(xs, grouped, "-", color=color, lw=2.2, label=f"{name}, a table per group")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("KV cache of one sequence (GiB, bf16)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def draw_group_tables(history: Sequence[tuple[str, int, Sequence[Sequence[int]]]], names: Sequence[str],
                      block_size: int, window: int) -> Any:
    """One request's tables, one panel per KV-cache group, one row per step: ``history`` holds (step label,
    tokens the request holds, its table in each group). A held block shows its id; a block given back shows
    ``null`` in grey; the window group's rows mark where the window of the next token starts."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    width = max(len(table) for _, _, tables in history for table in tables)
    size = (0.5 * width * len(names) + 2.5, 0.42 * len(history) + 1.4)
    fig, axes = plt.subplots(1, len(names), figsize=size, squeeze=False)
    for g, (ax, name) in enumerate(zip(axes[0], names)):
        for row, (_, length, tables) in enumerate(history):
            y = len(history) - 1 - row
            for col, block in enumerate(tables[g]):
                null = block == NULL_BLOCK
                face = FREE_COLOR if null else OWNER_COLORS[g % len(OWNER_COLORS)]
                ax.add_patch(Rectangle((col, y), 0.94, 0.86, facecolor=face, edgecolor="#555555", lw=0.6,
                                       hatch="///" if null else None))
                ax.text(col + 0.47, y + 0.43, "null" if null else str(block), ha="center", va="center",
                        fontsize=7, color="#555555" if null else "white")
            if "window" in name:  # the next token, at position `length`, sees from length - window + 1
                start = max(0, length - window + 1) / block_size
                ax.plot([start, start], [y - 0.05, y + 0.91], color="#C44E52", lw=2)
        ax.set_xlim(-0.1, width + 0.1)
        ax.set_ylim(-0.2, len(history) + 0.1)
        ax.set_yticks([len(history) - 1 - r + 0.43 for r in range(len(history))])
        ax.set_yticklabels([f"{label} ({length} tok)" for label, length, _ in history], fontsize=8)
        ax.set_xticks([c + 0.47 for c in range(width)])
        ax.set_xticklabels([str(c) for c in range(width)], fontsize=7)
        ax.set_xlabel(f"table index (block {block_size} tokens)")
        ax.set_title(name, fontsize=10)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def draw_hits(runs: dict[str, Sequence[tuple[int, Sequence[int]]]], group_names: Sequence[str]) -> Any:
    """Prefix-cache hits of each run's lookups after the first: per lookup, what each group alone would serve
    (light bars) and the hit granted (dark bar). ``runs``: name -> [(hit, [group hits])], one per lookup."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / (len(group_names) + 1)
    ticks, labels = [], []
    x = 0.0
    for name, lookups in runs.items():
        for number, (hit, group_hits) in enumerate(lookups[1:], start=1):
            for g, (alone, group) in enumerate(zip(group_hits, group_names)):
                ax.bar(x + g * width, alone, width, color=OWNER_COLORS[g], alpha=0.45,
                       label=f"{group} alone" if x == 0 else None)
            ax.bar(x + len(group_names) * width, hit, width, color="#333333", label="hit granted" if x == 0
                   else None)
            ax.text(x + len(group_names) * width, hit + 4, str(hit), ha="center", fontsize=8)
            ticks.append(x + 0.4 - width / 2)
            labels.append(f"{name}\nprompt {'qrstuvw'[number - 1]}")
            x += 1.0
        x += 0.4
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("prefix-cache hit (tokens)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
