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


def slots_of(cache: Any, seq_id: Hashable) -> tuple[int, int]:
    """(slots holding a token's K/V, slots of the blocks it holds) of one sequence, every KV-cache group's
    table counted: a window group's entries given back (``NULL_BLOCK``, -1) hold neither, and each stands
    for a whole block of positions before the window."""
    filled = allocated = 0
    for tables in cache.group_tables:
        table = tables[seq_id]
        given_back = sum(block < 0 for block in table)
        filled += cache.seq_lens[seq_id] - given_back * cache.block_size
        allocated += (len(table) - given_back) * cache.block_size
    return filled, allocated


def num_filled_slots(cache: Any) -> int:
    """Slots holding a token's K/V, every group's tables counted (a shared block once per table): with one
    KV-cache group, the tokens held."""
    return sum(slots_of(cache, seq_id)[0] for seq_id in cache.seq_lens)


def num_allocated_slots(cache: Any) -> int:
    """Slots of every block a table names, every group's tables counted (a shared block once per table)."""
    return sum(slots_of(cache, seq_id)[1] for seq_id in cache.seq_lens)


def utilization(cache: Any) -> float:
    """Filled slots per allocated slot (1.0 with none); ``1 - utilization``: internal fragmentation."""
    allocated = num_allocated_slots(cache)
    if allocated == 0:
        return 1.0
    return num_filled_slots(cache) / allocated


def sequence_utilization(cache: Any, seq_id: Hashable) -> float:
    """Filled slots per slot of one sequence's blocks, every group's (1.0 for an empty sequence)."""
    filled, allocated = slots_of(cache, seq_id)
    if allocated == 0:
        return 1.0
    return filled / allocated


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
    """Sizes; blocks used, free (cached among them), shared and copied; tokens; the first 8 sequences' tables
    (with KV-cache groups, a table per group, ``|`` between them)."""
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
             blocks]
    tokens, filled, allocated = num_tokens(cache), num_filled_slots(cache), num_allocated_slots(cache)
    held = f"  tokens: {tokens} in {allocated} allocated slots"
    if filled != tokens:  # KV-cache groups (notebook 15): a token fills a slot in each group that holds it
        held = f"  tokens: {tokens}, filling {filled} of {allocated} allocated slots across the KV-cache " \
               "groups"
    lines.append(f"{held} (utilization {utilization(cache):.0%})")
    for seq_id in list(cache.tables)[:8]:
        tables = " | ".join(str(tables[seq_id]) for tables in cache.group_tables)  # one per group
        lines.append(f"  seq {seq_id!r}: len {cache.seq_lens[seq_id]}, table {tables}")
    if len(cache.tables) > 8:
        lines.append(f"  ... and {len(cache.tables) - 8} more sequences")
    return "\n".join(lines)
