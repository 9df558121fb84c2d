"""The two rules every connector of the course follows, pagedlib's (``connectors``) and vLLM's
(``pagedlib.vllm.connector``), written once:

- **offer**: past the prefix cache's hit, the full blocks the connector holds in a row, to its first miss,
  and never the block that holds the request's last token (that token is computed for its logits);
- **save**: after a step, each full block whose tokens are all computed now and were not before."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def offer_stop(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a ``num_tokens``-token request a connector may offer at most: the
    block of the last token is never one."""
    return max(0, (num_tokens - 1) // block_size)


def offer(keys: Sequence[Any], has: Callable[[Any], bool], start: int) -> int:
    """How many blocks of ``keys`` from block ``start`` on ``has`` finds, to the first it does not."""
    found = 0
    for key in keys[start:]:
        if not has(key):
            break
        found += 1
    return found


def filled(computed_before: int, computed_after: int, block_size: int) -> range:
    """The blocks a step fills: full with ``computed_after`` tokens computed, not yet with
    ``computed_before`` (a block is saved once, in the step that completes it)."""
    return range(computed_before // block_size, computed_after // block_size)
