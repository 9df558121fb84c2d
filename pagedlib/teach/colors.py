"""The course's colours, shared by ``plots`` and ``tracer_view`` so a sequence has one colour everywhere.
The sequence palette holds no green: green means a cached free block (prefix caching, notebook 06)."""

from __future__ import annotations

# sequence i gets OWNER_COLORS[i % len(OWNER_COLORS)], named OWNER_NAMES[i % 8] where text must say it
OWNER_COLORS = ("#4C72B0", "#DD8452", "#B8860B", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C")
OWNER_NAMES = ("blue", "orange", "gold", "red", "purple", "brown", "pink", "grey")
FREE_COLOR = "#EEEEEE"
CACHED_COLOR = "#CDE8CD"  # a free block whose content prefix caching keeps (notebook 06)
CACHED_EDGE = "#6AAA6A"   # its border and kept slots in the tracer widget


def owner_color(seq_id: object, order: list[object] | None = None) -> str:
    """Colour of a sequence: ``OWNER_COLORS[seq_id % 8]`` for an int id, else by its rank in ``order``."""
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):
        return OWNER_COLORS[seq_id % len(OWNER_COLORS)]
    rank = order.index(seq_id) if order and seq_id in order else 0
    return OWNER_COLORS[rank % len(OWNER_COLORS)]
