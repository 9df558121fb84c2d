"""Notebook 11's figures: the radix tree and the block-hash chain drawn side by side over the same requests,
and the side-by-side measurements as bars. Each function returns the ``Figure`` it drew on."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from pagedlib.teach.colors import CACHED_COLOR, OWNER_COLORS

HELD_COLOR = OWNER_COLORS[0]


def _forest(ax: plt.Axes, items: list[tuple[object, object, str, bool]], title: str, arrow: str) -> None:
    """Draw ``(id, parent id or None, label, held)`` boxes: depth left to right, leaves top to bottom;
    ``arrow``: ``"->"`` parent to child (the tree's pointers), ``"<-"`` child to parent (the hash chain's)."""
    kids: dict[object, list] = {}
    for key, parent, *_ in items:
        kids.setdefault(parent, []).append(key)
    where, rows = {}, [0]

    def place(key: object, depth: int) -> float:
        ys = [place(k, depth + 1) for k in kids.get(key, [])]
        if not ys:  # a leaf takes the next row
            rows[0] += 1
            ys = [rows[0]]
        where[key] = (depth, sum(ys) / len(ys))
        return where[key][1]

    for root in kids.get(None, []):
        place(root, 0)
    for key, parent, label, held in items:
        x, y = where[key]
        ax.text(x, -y, label, ha="center", va="center", fontsize=8, family="monospace",
                bbox=dict(boxstyle="round", fc=HELD_COLOR if held else CACHED_COLOR, alpha=0.9,
                          ec="#555555"), color="white" if held else "black")
        if parent is not None:
            px, py = where[parent]
            ax.annotate("", (x - 0.38, -y), (px + 0.38, -py), arrowprops=dict(arrowstyle=arrow, color="#555"))
    depth = max((x for x, _ in where.values()), default=0)
    ax.set(xlim=(-0.6, depth + 1.0), ylim=(-rows[0] - 0.7, -0.3), title=title)
    ax.set_xlabel("depth (nodes or blocks from the root)")
    ax.set_xticks(range(depth + 1)), ax.set_yticks([])


def draw_prefix_caches(radix, hashed, ref_counts_radix: list[int], ref_counts_hash: list[int]) -> Figure:
    """The radix tree (one box per node: its run of token ids and its blocks, blue if a table holds one)
    beside the hash chain (one box per cached block: its tokens and its parent block) of the same requests."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
    nodes, todo = [], list(radix.root.children.values())
    while todo:
        node = todo.pop(0)
        parent = None if node.parent is radix.root else id(node.parent)
        free = [b for b in node.blocks if not ref_counts_radix[b]]
        held = len(free) < len(node.blocks)
        label = f"{node.tokens}\nblocks {node.blocks}" + (f" (free: {free})" if free and held else "")
        nodes.append((id(node), parent, label, held))
        todo += node.children.values()
    _forest(left, nodes, f"radix tree: {len(nodes)} nodes, {len(radix.node_of)} blocks", "->")
    blocks = [(b, hashed.blocks.get(key.parent) if key.parent else None, f"{list(key.tokens)}\nblock {b}",
               ref_counts_hash[b] > 0) for key, b in hashed.blocks.items()]
    _forest(right, blocks, f"hash chain: {len(blocks)} entries (parent hash + tokens -> block)", "<-")
    fig.legend(handles=[Patch(fc=HELD_COLOR, label="held by a running sequence"),
                        Patch(fc=CACHED_COLOR, label="cached, free (evictable)")], loc="outside lower center",
               ncols=2, fontsize=8)
    return fig


def plot_side_by_side(rows: list[dict], metric: str = "hit_rate", label: str = "hit rate (tokens found / "
                      "tokens looked up)") -> Figure:
    """Grouped bars of ``metric`` per workload: one bar per (design, block size), hash hatched."""
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    keys = list(dict.fromkeys((r["design"], r["block_size"]) for r in rows))
    sizes = sorted({bs for _, bs in keys})
    fig, ax = plt.subplots(figsize=(11, 3.6), layout="constrained")
    width, value = 0.8 / len(keys), {(r["workload"], r["design"], r["block_size"]): r[metric] for r in rows}
    for i, (design, bs) in enumerate(keys):
        ys = [value[w, design, bs] for w in workloads]
        ax.bar([w + (i - len(keys) / 2 + 0.5) * width for w in range(len(workloads))], ys, width,
               color=OWNER_COLORS[sizes.index(bs)], hatch="//" if design == "hash" else None,
               edgecolor="white", label=f"{design}, block size {bs}")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set(ylabel=label, xlabel="workload", ylim=(0, 1.35 * max(value.values(), default=1)))
    ax.legend(fontsize=8, ncols=len(sizes), loc="upper right")
    return fig
