"""Tools to test code that uses the paged KV cache, as ``torch.testing`` is for tensors: the invariants of a
``BlockManager`` and of both prefix caches, who holds each block, what changed between two states of a
``PagedKVCache``, NaN written into every slot that holds no token, the text ``repr(cache)`` shows, and the
figures notebooks read off a cache (how full its blocks are, what its prefix cache found).

It lives apart from the engine because a request never runs through it: the engine calls none of it, tests,
notebook checks and widgets do. The objects keep one-line methods that call it (``cache.check_invariants()``,
``cache.state_diff(before)``, ``cache.fill_unused()``, ``cache.utilization``). It imports nothing from
``pagedlib`` but ``util`` and works on the objects it is given, so ``core`` may call it."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from pagedlib.util import ceil_div

# what state_diff compares: the attributes of a PagedKVCache
STATE = ("k", "v", "free", "tables", "seq_lens", "ref_counts", "cow_copies", "prefix_cache", "token_ids")


class InvariantError(AssertionError):
    """``check_invariants`` found the bookkeeping inconsistent (a bug, never bad user input)."""


def holders(manager: Any) -> list[list[tuple[Hashable, int]]]:
    """``holders[b]``: (sequence, logical index) of every table entry of the ``BlockManager`` naming block
    ``b``."""
    seq_ids = manager.tables.keys()
    if seq_ids != manager.seq_lens.keys() or seq_ids != manager.token_ids.keys():
        raise InvariantError("tables, seq_lens and token_ids hold different sequence ids")
    found: list[list[tuple[Hashable, int]]] = [[] for _ in range(manager.num_blocks)]
    for seq_id, table in manager.tables.items():
        for index, block in enumerate(table):
            _check_block_id(block, manager.num_blocks, f"sequence {seq_id!r}")
            if found[block] and found[block][-1][0] == seq_id:
                where = f"the table of sequence {seq_id!r}"
                raise InvariantError(f"1: block {block} appears twice in {where}")
            found[block].append((seq_id, index))
    return found


def check_invariants(manager: Any) -> None:
    """Raise ``InvariantError`` naming the first broken invariant of a ``BlockManager``: 1 reference counts,
    2 free blocks, 3 block ids, 4 table lengths (notebook 02), 5 shared blocks, 6 prefix caching (06)."""
    held_by = holders(manager)
    block_size = manager.block_size
    for block, count in enumerate(manager.ref_counts):
        if count != len(held_by[block]):
            names = [seq_id for seq_id, _ in held_by[block]]
            raise InvariantError(f"1: block {block} has reference count {count} but "
                                 f"{len(names)} tables hold it ({names})")
    free = list(manager.free)
    if manager.prefix_cache is not None:
        free += list(manager.prefix_cache.free_queue)
    for block in free:
        _check_block_id(block, manager.num_blocks, "the free stack")
        if held_by[block]:
            holder = held_by[block][0][0]
            raise InvariantError(f"2: block {block} is held by sequence {holder!r} "
                                 f"and also on the free stack")
    if len(set(free)) != len(free):
        raise InvariantError("2: a block appears twice among the free blocks")
    unheld = [block for block in range(manager.num_blocks) if not held_by[block]]
    if len(unheld) != len(free):
        leaked = sorted(set(unheld) - set(free))
        raise InvariantError(f"2: blocks {leaked} are neither free nor held (leaked)")
    for seq_id, length in manager.seq_lens.items():
        held = len(manager.tables[seq_id])
        want = ceil_div(length, block_size)
        if held != want:
            raise InvariantError(f"4: sequence {seq_id!r} of length {length} holds {held} "
                                 f"blocks, expected ceil({length}/{block_size}) = {want}")
    for block, entries in enumerate(held_by):
        fills = {(index, min(block_size, manager.seq_lens[seq_id] - index * block_size))
                 for seq_id, index in entries}
        if len(fills) > 1:
            raise InvariantError(f"5: shared block {block} differs between its holders "
                                 f"{entries} (index, fill)")
    if manager.prefix_cache is not None:
        _check_prefix_cache(manager)


def _check_block_id(block: object, num_blocks: int, where: str) -> None:
    """Invariant 3: ``block`` is a real block id, ``0 <= block < num_blocks``."""
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < num_blocks:
        raise InvariantError(f"3: {where} has invalid block id {block!r}")


def _check_prefix_cache(manager: Any) -> None:
    """Invariant 6: each sequence's token ids match its length, and its prefix cache (the hash cache or the
    radix tree) holds what its tables say."""
    for seq_id in manager.tables:
        known = len(manager.token_ids[seq_id])
        if known != manager.seq_lens[seq_id]:
            raise InvariantError(f"6: sequence {seq_id!r} has {known} token ids "
                                 f"for {manager.seq_lens[seq_id]} tokens")
    prefix_cache = manager.prefix_cache
    if _is_radix(prefix_cache):
        problem = check_radix_cache(prefix_cache, manager.tables, manager.token_ids)
    else:
        problem = check_hash_cache(prefix_cache, manager.tables, manager.token_ids)
    if problem is not None:
        raise InvariantError(f"6: {problem}")


def _is_radix(prefix_cache: Any) -> bool:
    """A ``RadixCache``, not a ``PrefixCache``: a tree maps blocks to its nodes (asked so, because this
    module imports no class of core)."""
    return hasattr(prefix_cache, "node_of")


def check_hash_cache(prefix_cache: Any, tables: dict, token_ids: dict) -> str | None:
    """The first broken invariant of a ``PrefixCache``, or ``None``: every full block of every table has the
    key of its tokens after its parent, and every block waiting in ``free_queue`` is findable."""
    block_size = prefix_cache.block_size
    for seq_id, table in tables.items():
        for index in range(len(token_ids[seq_id]) // block_size):
            block = table[index]
            key = prefix_cache.keys.get(block)
            tokens = tuple(token_ids[seq_id][index * block_size:(index + 1) * block_size])
            parent = None
            if index > 0:
                parent = prefix_cache.keys.get(table[index - 1])
            if key is None or key.tokens != tokens or key.parent != parent:
                where = f"full block {block} of sequence {seq_id!r}"
                return f"{where} has key {key}, not its tokens"
    stale = [block for block in prefix_cache.free_queue if not prefix_cache.is_cached(block)]
    if stale:
        return f"blocks {stale} wait in the prefix cache's queue without cached content"
    return None


def check_radix_cache(tree: Any, tables: dict, token_ids: dict) -> str | None:
    """The first broken invariant of a ``RadixCache``, or ``None``: every cached block sits in exactly one
    node reachable from the root, runs are whole blocks, every full block of a table is the block its
    tokens walk to (and no partly filled one is cached), and a free block has no held block after it (so
    eviction can always reach it)."""
    block_size = tree.block_size
    seen = {}
    todo = [tree.root]
    while todo:
        node = todo.pop()
        empty = node is not tree.root and not node.blocks
        if len(node.tokens) != len(node.blocks) * block_size or empty:
            return f"a node holds {len(node.tokens)} tokens in {len(node.blocks)} blocks"
        for key, child in node.children.items():
            if child.parent is not node or key != tuple(child.tokens[:block_size]):
                return f"a child of a node is keyed {key}, not by its first block"
            todo.append(child)
        seen.update((block, node) for block in node.blocks)
    if seen != tree.node_of:
        return f"{len(tree.node_of)} blocks are registered, {len(seen)} reachable from the root"
    for seq_id, table in tables.items():
        full = len(token_ids[seq_id]) // block_size
        found = tree.peek(token_ids[seq_id] + [0])  # + [0]: every full block may be found
        if table[:full] != found[:full] or any(block in tree.node_of for block in table[full:]):
            return f"sequence {seq_id!r} holds blocks {table} where its tokens walk to {found}"
    for block in tree.free_queue:
        node = tree.node_of[block]
        later = node.blocks[node.blocks.index(block):]
        later += [after for child in node.children.values() for after in child.blocks]
        if any(after not in tree.free_queue for after in later):
            return f"free block {block} has a held block after it in the tree"
    return None


def radix_state(tree: Any) -> tuple:
    """What a lookup in a ``RadixCache`` can find and evict, whatever the cuts between nodes: each block with
    the block before it, its tokens and its node's age; the free blocks; the counts."""
    block_size = tree.block_size
    rows = []
    for block, node in tree.node_of.items():
        index = node.blocks.index(block)
        before = None
        if index > 0:
            before = node.blocks[index - 1]
        elif node.parent.blocks:
            before = node.parent.blocks[-1]
        tokens = tuple(node.tokens[index * block_size:(index + 1) * block_size])
        rows.append((block, before, tokens, node.last_used))
    counts = (tree.queried_tokens, tree.hit_tokens, tree.evicted_blocks)
    return sorted(rows), set(tree.free_queue), counts


def block_holders(cache: Any) -> list[list[Hashable]]:
    """``holders[b]``: every sequence holding block ``b`` of a ``PagedKVCache`` (``ref_count(b)`` of them),
    in table order."""
    return [[seq_id for seq_id, _ in entries] for entries in holders(cache.manager)]


def block_owners(cache: Any) -> list[Hashable | None]:
    """``owners[b]``: the first sequence holding block ``b``, or ``None`` if it is free."""
    owners = []
    for seq_ids in block_holders(cache):
        owner = None
        if seq_ids:
            owner = seq_ids[0]
        owners.append(owner)
    return owners


def state_diff(after: Any, before: Any) -> list[str]:
    """Names of the attributes in which the ``PagedKVCache`` ``after`` differs from ``before`` (a
    ``copy.deepcopy``), pools bit for bit with NaN equal to NaN: ``[]`` means a failed call changed
    nothing."""
    return [name for name in STATE if not _same(getattr(after, name), getattr(before, name))]


def _same(now: object, before: object) -> bool:
    """Equal, and for tensors bit for bit with NaN equal to NaN."""
    if not isinstance(now, torch.Tensor):
        return now == before
    if not isinstance(before, torch.Tensor):
        return False
    if now.dtype != before.dtype or now.shape != before.shape:
        return False
    if torch.equal(now, before):
        return True
    return bool(((now == before) | (now.isnan() & before.isnan())).all())


def fill_unused(cache: Any, value: float = float("nan")) -> None:
    """Write ``value`` into every slot of a ``PagedKVCache`` that holds no token (cached free blocks keep
    their content): attention must ignore those slots, and NaN there makes a test prove it."""
    block_size = cache.block_size
    used = [slot for seq_id in cache.tables for slot in cache.manager.slots(seq_id)]
    if cache.prefix_cache is not None:  # cached blocks nobody holds
        for block in cache.prefix_cache.free_queue:
            used += range(block * block_size, (block + 1) * block_size)
    keep = torch.zeros(cache.num_blocks * block_size, dtype=torch.bool)
    keep[used] = True
    unused = (~keep).view(cache.num_blocks, block_size).to(cache.device)  # [num_blocks, block_size]
    for pool in (cache.k, cache.v):  # a view [num_blocks, block_size, L, H, D]; writes through
        fill = torch.tensor(value, dtype=pool.dtype, device=cache.device)
        _bytes(pool).transpose(1, 2)[unused] = _bytes(fill)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte (fp8) tensor as ``uint8``, the same bytes: torch's CPU indexing has no fp8 kernels."""
    if tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def describe(cache: Any) -> str:
    """What ``repr(cache)`` shows of a ``PagedKVCache``: its sizes; its blocks used, free (cached among
    them), shared and copied; its tokens; the first eight block tables."""
    dtype = str(cache.dtype).replace("torch.", "")
    blocks = f"  blocks: {cache.num_used_blocks} used, {cache.num_free_blocks} free"
    if cache.prefix_cache is not None:
        blocks += f", {len(cache.prefix_cache.free_queue)} of them cached"
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
             f"  tokens: {cache.num_tokens} in {cache.num_allocated_slots} allocated slots "
             f"(utilization {cache.utilization:.0%})"]
    for seq_id, table in list(cache.tables.items())[:8]:
        lines.append(f"  seq {seq_id!r}: len {cache.seq_lens[seq_id]}, table {table}")
    if len(cache.tables) > 8:
        lines.append(f"  ... and {len(cache.tables) - 8} more sequences")
    return "\n".join(lines)


def num_tokens(cache: Any) -> int:
    """Tokens held by every sequence of a ``PagedKVCache``."""
    return sum(cache.seq_lens.values())


def num_allocated_slots(cache: Any) -> int:
    """Slots of every block a table names (a shared block once per table)."""
    return sum(len(table) for table in cache.tables.values()) * cache.block_size


def utilization(cache: Any) -> float:
    """Tokens per allocated slot (1.0 with nothing allocated); 1 - utilization: internal fragmentation."""
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
    findable now; a radix tree adds its node count. ``None`` (prefix caching off): every count 0."""
    if prefix_cache is None:
        return {"queried_tokens": 0, "hit_tokens": 0, "hit_rate": 0.0, "evicted_blocks": 0,
                "cached_blocks": 0}
    rate = 0.0
    if prefix_cache.queried_tokens:
        rate = prefix_cache.hit_tokens / prefix_cache.queried_tokens
    stats = {"queried_tokens": prefix_cache.queried_tokens,
             "hit_tokens": prefix_cache.hit_tokens,
             "hit_rate": rate,
             "evicted_blocks": prefix_cache.evicted_blocks}
    if _is_radix(prefix_cache):  # its blocks, and its nodes
        stats["cached_blocks"] = len(prefix_cache.node_of)
        stats["nodes"] = len(set(prefix_cache.node_of.values()))
    else:
        stats["cached_blocks"] = len(prefix_cache.blocks)
    return stats
