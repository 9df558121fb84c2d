"""Notebook 11's figures: the radix tree and the block-hash chain drawn side by side over the same requests,
and the side-by-side measurements as bars. Each function returns the ``Figure`` it drew on."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from pagedlib.teach.colors import CACHED_COLOR, OWNER_COLORS

HELD_COLOR = OWNER_COLORS[0]


CELL = 1.0   # width of one block's box, in data units
GAP = 0.45   # room for an arrow between a box and the next


def _box(ax: plt.Axes, x: float, y: float, label: str, color: str, width: float = CELL) -> None:
    """A box ``width`` wide whose left edge is at ``x``, centred on row ``y``, with ``label`` inside."""
    ax.add_patch(Rectangle((x, -y - 0.3), width, 0.6, facecolor=color, edgecolor="#555555", lw=0.8))
    text_color = "white" if color == HELD_COLOR else "black"
    ax.text(x + width / 2, -y, label, ha="center", va="center", fontsize=7.5, family="monospace",
            color=text_color)


def _arrow(ax: plt.Axes, tail: tuple[float, float], head: tuple[float, float]) -> None:
    """An arrow from the right or left edge of one box to another's, its head outside both boxes."""
    ax.annotate("", xy=(head[0], -head[1]), xytext=(tail[0], -tail[1]), zorder=3,
                arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.0, shrinkA=0, shrinkB=0))


def _rows(items: list[tuple[object, object]]) -> dict[object, float]:
    """Row of each ``(key, parent key or None)``: leaves one row each, top to bottom, a parent between
    its children's rows."""
    kids: dict[object, list] = {}
    for key, parent in items:
        kids.setdefault(parent, []).append(key)
    row_of, next_row = {}, [0]

    def place(key: object) -> float:
        ys = [place(k) for k in kids.get(key, [])]
        if not ys:  # a leaf takes the next row
            next_row[0] += 1
            ys = [next_row[0]]
        row_of[key] = sum(ys) / len(ys)
        return row_of[key]

    for root in kids.get(None, []):
        place(root)
    return row_of


def _block_label(tokens: list[int], block: int) -> str:
    return " ".join(str(t) for t in tokens) + f"\nblock {block}"


def _draw_tree(ax: plt.Axes, radix, ref_counts: list[int]) -> None:
    """The tree from its root: a node is an outlined row of its blocks' boxes (blue: held; green: cached,
    free), an arrow from a parent's last block to each child's first."""
    nodes, todo = [], list(radix.root.children.values())
    while todo:
        node = todo.pop(0)
        nodes.append(node)
        todo += node.children.values()
    row_of = _rows([(radix.root, None)] + [(node, node.parent) for node in nodes])
    right_of = {radix.root: CELL}
    _box(ax, 0, row_of[radix.root], "root\n(no tokens)", "white")
    for node in nodes:  # parents come before their children
        left = right_of[node.parent] + GAP
        ax.add_patch(Rectangle((left - 0.06, -row_of[node] - 0.38), len(node.blocks) * CELL + 0.12, 0.76,
                               fill=False, edgecolor="#222222", lw=1.2, ls="--"))
        for i, block in enumerate(node.blocks):
            tokens = node.tokens[i * radix.block_size:(i + 1) * radix.block_size]
            color = HELD_COLOR if ref_counts[block] else CACHED_COLOR
            _box(ax, left + i * CELL, row_of[node], _block_label(tokens, block), color)
        right_of[node] = left + len(node.blocks) * CELL
        _arrow(ax, (right_of[node.parent], row_of[node.parent]), (left - 0.06, row_of[node]))
    ax.set(xlim=(-0.2, max(right_of.values()) + 0.2), ylim=(-max(row_of.values()) - 0.7, -0.3))
    ax.set_title(f"radix tree: the root and {len(nodes)} nodes (dashed) holding {len(radix.node_of)} blocks")


def _draw_chain(ax: plt.Axes, hashed, ref_counts: list[int]) -> None:
    """The hash cache: a box per cached block, an arrow from each block to the block its key chains to."""
    def first(key):  # the block a lookup finds for ``key`` (the oldest of its duplicates)
        return next(iter(hashed.blocks[key])) if key in hashed.blocks else None

    parent_of = {block: first(key.parent) if key.parent else None for block, key in hashed.keys.items()}
    row_of = _rows(list(parent_of.items()))
    depth_of = {}
    for block, parent in parent_of.items():  # dict order: a parent is registered before its children
        depth_of[block] = 0 if parent is None else depth_of[parent] + 1
    for block, key in hashed.keys.items():
        color = HELD_COLOR if ref_counts[block] else CACHED_COLOR
        left = depth_of[block] * (CELL + GAP)
        _box(ax, left, row_of[block], _block_label(list(key.tokens), block), color)
        if parent_of[block] is not None:
            _arrow(ax, (left, row_of[block]), (left - GAP, row_of[parent_of[block]]))
    ax.set(xlim=(-0.2, (max(depth_of.values(), default=0) + 1) * (CELL + GAP)),
           ylim=(-max(row_of.values(), default=1) - 0.7, -0.3))
    ax.set_title(f"hash chain: {len(parent_of)} entries (parent's key + tokens -> block)")


def draw_prefix_caches(radix, hashed, ref_counts_radix: list[int], ref_counts_hash: list[int]) -> Figure:
    """The radix tree (a dashed outline per node around its blocks) beside the hash chain (a box per cached
    block, an arrow to its parent block) of the same requests; a block is blue if a table holds it, green
    if it is cached and free."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.6), layout="constrained")
    _draw_tree(left, radix, ref_counts_radix)
    _draw_chain(right, hashed, ref_counts_hash)
    left.set_xlabel("from the root: arrows point from a parent node to its children")
    right.set_xlabel("arrows point from a block to the block before it in the prompt (its parent)")
    for ax in (left, right):
        ax.set_xticks([])
        ax.set_yticks([])
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
