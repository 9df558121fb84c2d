"""KV-cache groups (notebook 15): a hybrid model's layers, grouped by the kind of attention they run, as vLLM
0.32.0 groups them (``vllm/v1/core/kv_cache_utils.py``, ``_get_kv_cache_groups_uniform_page_size``). Every
group has a block table per request over one shared pool of one page size; a sliding-window group's table
gives back the blocks that fall wholly out of its window.

A model of one kind (every layer full attention: notebooks 02-14) is one group of every layer, so one table
serves every layer, as before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedlib.util import as_int, ceil_div, refuse

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_KINDS = (FULL, SLIDING)  # a transformers config's ``layer_types`` values this course runs
NULL_BLOCK = -1  # a table entry whose block was given back (vLLM's null block): never read


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table: their ``kind`` (``FULL`` or ``SLIDING``), the ``window`` a sliding
    layer sees (tokens, itself included; ``None`` for full attention) and the ``layers``' indices."""

    kind: str
    window: int | None
    layers: tuple[int, ...]

    def __str__(self) -> str:
        what = "full attention" if self.window is None else f"sliding window {self.window}"
        return f"{what}: layers {', '.join(map(str, self.layers))}"


def kv_groups(layer_types: Sequence[str] | None, sliding_window: int | None,
              num_layers: int) -> tuple[KVGroup, ...]:
    """The groups of a model whose layer ``l`` runs ``layer_types[l]`` (``None``: every layer full attention).

    vLLM's rule: layers of one kind in order of first appearance; each kind cut into groups of one size, the
    fewest layers of a kind (or the most, when no kind has 1.5 times the fewest), layer ``i`` of a kind going
    to group ``i % n`` of its ``n``; a group short of the size pads (its missing layers take pool room and
    hold nothing). ``ValueError`` naming the argument for a count that is no int >= 1, ``layer_types`` not
    ``num_layers`` of ``LAYER_KINDS``, or a sliding layer without a window of >= 1 token."""
    num_layers = as_int("num_layers", num_layers, minimum=1)
    if layer_types is None:
        return (KVGroup(FULL, None, tuple(range(num_layers))),)
    if isinstance(layer_types, (str, bytes)) or not isinstance(layer_types, Sequence):
        raise ValueError(f"layer_types must be None or a sequence of kinds, got {type(layer_types).__name__}")
    refuse((len(layer_types) != num_layers,
            f"layer_types must name num_layers={num_layers} kinds, got {len(layer_types)}"))
    unknown = [kind for kind in layer_types if kind not in LAYER_KINDS]
    refuse((unknown, f"layer_types holds {unknown[:3]!r}: the kinds this course runs are {LAYER_KINDS}"))
    if SLIDING in layer_types:
        sliding_window = as_int("sliding_window", sliding_window, minimum=1)
    kinds: dict[str, list[int]] = {}
    for layer, kind in enumerate(layer_types):
        kinds.setdefault(kind, []).append(layer)
    sizes = [len(layers) for layers in kinds.values()]
    size = max(sizes) if max(sizes) < 1.5 * min(sizes) else min(sizes)
    groups = []
    for kind, layers in kinds.items():
        n = ceil_div(len(layers), size)
        window = sliding_window if kind == SLIDING else None
        groups += [KVGroup(kind, window, tuple(layers[i::n])) for i in range(n)]
    return tuple(groups)


def layers_per_group(groups: Sequence[KVGroup]) -> int:
    """The layers a block holds: the largest group's (the pool's second dimension)."""
    return max(len(group.layers) for group in groups)
