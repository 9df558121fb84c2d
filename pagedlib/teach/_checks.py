"""Argument checks of the tracer widget (``tracer``, ``tracer_view``): each public method spends one line
on them, and each error names its argument. Nothing here changes any state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedlib.core.cache import OutOfBlocksError, UnknownSequenceError
from pagedlib.util import as_int, ceil_div

# The view draws every slot and sequence: beyond these it refuses (the largest view is ~0.3 MiB of HTML)
MAX_SLOTS = 512       # num_blocks * block_size
MAX_SEQUENCES = 32    # live sequences


def geometry(num_blocks: object, block_size: object) -> tuple[int, int]:
    """``(num_blocks, block_size)`` as ints, small enough that every slot can be drawn."""
    num_blocks = as_int("num_blocks", num_blocks, minimum=1)
    block_size = as_int("block_size", block_size, minimum=1)
    if num_blocks * block_size > MAX_SLOTS:
        raise ValueError(f"num_blocks * block_size must be <= {MAX_SLOTS} (the tracer draws every "
                         f"slot), got {num_blocks} * {block_size} = {num_blocks * block_size}")
    return num_blocks, block_size


def drawable(cache: Any) -> None:
    """``render_html`` draws every slot and sequence, and prints sequence ids as they are (ints only)."""
    slots, seqs = cache.num_blocks * cache.block_size, len(cache.tables)
    if slots > MAX_SLOTS or seqs > MAX_SEQUENCES:
        raise ValueError(f"render_html draws every slot and sequence: at most {MAX_SLOTS} slots and "
                         f"{MAX_SEQUENCES} sequences, got a cache with {slots} slots and {seqs} sequences")
    for s in cache.tables:
        as_int("sequence id", s)


def target(seq_id: object, selected: int | None, tables: Mapping[int, list[int]]) -> int:
    """The sequence an action applies to: ``seq_id`` or, if ``None``, the selected one."""
    if seq_id is None:
        if selected is None:
            raise ValueError("no sequence selected: press Add sequence first, or pass seq_id")
        return selected
    seq_id = as_int("seq_id", seq_id)
    if seq_id not in tables:
        raise UnknownSequenceError(seq_id, tables)
    return seq_id


def room(tables: Mapping[int, list[int]]) -> None:
    """A new sequence must still fit on screen."""
    if len(tables) >= MAX_SEQUENCES:
        raise ValueError(f"the tracer shows at most {MAX_SEQUENCES} sequences: free one first")


def new_prompt(cache: Any, seq_id: int, prompt_len: object) -> tuple[int, list[int]]:
    """``(prompt_len, the cached blocks a prompt of ids 0 .. n-1 attaches)`` (a peek, no query counted), or
    ``OutOfBlocksError`` if the rest needs more blocks than stay free once those are attached."""
    room(cache.tables)
    n, pc = tokens("prompt_len", prompt_len, cache, minimum=0), cache.prefix_cache
    found = pc.peek(range(n)) if pc is not None and n else []
    need = ceil_div(n, cache.block_size) - len(found)
    free = cache.num_free_blocks - sum(b in pc.free_queue for b in found)  # attached: no longer free
    if need > free:
        hit = len(found) * cache.block_size
        what = (f"the last {n - hit} tokens of a {n}-token prompt of sequence {seq_id} (the first {hit} "
                f"are cached)" if found else f"a {n}-token prompt of sequence {seq_id}")
        raise OutOfBlocksError(need, free, what)
    return n, found


def tokens(name: str, n: object, cache: Any, minimum: int) -> int:
    """A token count, at most the pool's slots (checked before any K/V is built for it)."""
    return as_int(name, n, minimum=minimum, maximum=cache.num_blocks * cache.block_size)


def history_step(at: int, last: int) -> int:
    """A step the history holds (Back at step 0, or Forward past the last step, has none)."""
    if not 0 <= at <= last:
        raise ValueError(f"no step {at} to go to: the history holds steps 0 to {last}")
    return at


def frames(frames: object, labels: object, start: object,
           interval_ms: object) -> tuple[list[str], list[str], int, int]:
    """A player's frames (HTML strings, at least one), a label per frame, the first shown, Play's interval."""
    if not isinstance(frames, Sequence) or isinstance(frames, str) or not frames \
            or not all(isinstance(f, str) for f in frames):
        raise ValueError("frames must be a non-empty sequence of HTML strings")
    labels = [f"frame {k} of {len(frames) - 1}" for k in range(len(frames))] if labels is None else labels
    if not isinstance(labels, Sequence) or isinstance(labels, str) or len(labels) != len(frames) \
            or not all(isinstance(t, str) for t in labels):
        raise ValueError(f"labels must be a sequence of strings, one per frame ({len(frames)})")
    return (list(frames), list(labels), as_int("start", start, minimum=0, maximum=len(frames) - 1),
            as_int("interval_ms", interval_ms, minimum=50))
