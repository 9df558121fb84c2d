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


# --- notebook 02: block allocator -----------------------------------------------------------------


# --- notebook 04: reference attention -------------------------------------------------------------


# --- notebook 05: Triton kernel -------------------------------------------------------------------
