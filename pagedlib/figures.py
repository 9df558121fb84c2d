"""The figures read off a paged KV cache and its prefix cache: tokens held, slots allocated, utilization, the
lookup counters, and the text a notebook prints for a cache. Notebooks, the simulation and the statistics
read them; no decision of the engine does.

Each function reads the object it is given and changes nothing; ``PagedKVCache`` and both prefix caches
bind them as their properties, ``__repr__`` and ``stats``. The module sits below ``core`` and imports none
of it."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


def num_used_blocks(cache: Any) -> int:
    """Blocks some table holds: all of them but the free ones (cached blocks nobody holds count as free)."""
    return cache.num_blocks - cache.num_free_blocks


def num_tokens(cache: Any) -> int:
    """Tokens held by every sequence."""
    return sum(cache.seq_lens.values())


def num_allocated_slots(cache: Any) -> int:
    """Slots of every block a table names (a shared block once per table)."""
    return sum(len(table) for table in cache.tables.values()) * cache.block_size


def utilization(cache: Any) -> float:
    """Tokens per allocated slot (1.0 with none); ``1 - utilization``: internal fragmentation."""
    allocated = num_allocated_slots(cache)
    if allocated == 0:
        return 1.0
    return num_tokens(cache) / allocated


def sequence_utilization(cache: Any, seq_id: Hashable) -> float:
    """Tokens per slot of one sequence's blocks (1.0 for an empty sequence)."""
    allocated = len(cache.tables[seq_id]) * cache.block_size
    if allocated == 0:
        return 1.0
    return cache.seq_lens[seq_id] / allocated


def prefix_cache_stats(prefix_cache: Any) -> dict[str, float]:
    """A prefix cache's counters: prompt tokens looked up, tokens found, the hit rate, blocks evicted, blocks
    a lookup can find now, and the radix tree's nodes. ``None`` (prefix caching off): every count 0."""
    if prefix_cache is None:
        return {"queried_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evicted_blocks": 0,
                "cached_blocks": 0}
    rate = 0.0
    if prefix_cache.queried_tokens:
        rate = prefix_cache.hit_tokens / prefix_cache.queried_tokens
    stats = {"queried_tokens": prefix_cache.queried_tokens, "hit_tokens": prefix_cache.hit_tokens,
             "hit_rate": rate, "evicted_blocks": prefix_cache.evicted_blocks}
    if hasattr(prefix_cache, "node_of"):  # the radix tree
        stats["cached_blocks"] = len(prefix_cache.node_of)
        stats["nodes"] = len(set(prefix_cache.node_of.values()))
    else:
        stats["cached_blocks"] = len(prefix_cache.keys)
    return stats


def describe(cache: Any) -> str:
    """Sizes; blocks used, free (cached among them), shared and copied; tokens; the first 8 tables."""
    dtype = str(cache.dtype).replace("torch.", "")
    blocks = f"  blocks: {cache.num_used_blocks} used, {cache.num_free_blocks} free"
    if cache.prefix_cache is not None:
        blocks += f", {cache.num_cached_free_blocks} of them cached"
    if cache.free:
        blocks += f" (top of stack: {cache.free[-1]})"
    else:
        blocks += " (stack empty)"
    shared = sum(count > 1 for count in cache.ref_counts)
    if shared or cache.cow_copies:
        blocks += f", {shared} shared, {cache.cow_copies} copied"
    lines = [f"PagedKVCache(num_blocks={cache.num_blocks}, num_layers={cache.num_layers}, "
             f"block_size={cache.block_size}, kv_heads={cache.kv_heads}, "
             f"head_dim={cache.head_dim}, dtype={dtype}, device={cache.device})",
             blocks,
             f"  tokens: {num_tokens(cache)} in {num_allocated_slots(cache)} allocated slots "
             f"(utilization {utilization(cache):.0%})"]
    for seq_id, table in list(cache.tables.items())[:8]:
        lines.append(f"  seq {seq_id!r}: len {cache.seq_lens[seq_id]}, table {table}")
    if len(cache.tables) > 8:
        lines.append(f"  ... and {len(cache.tables) - 8} more sequences")
    return "\n".join(lines)
