"""Tools to test code that uses the paged KV cache, as ``torch.testing`` is for tensors: the invariants of a
``BlockManager`` and of both prefix caches, who holds each block, what changed between two states of a
``PagedKVCache``, and NaN written into every slot that holds no token.

No request runs through it: tests, notebook checks and widgets call it, the engine never does. It sits
above ``core`` and reads the objects it is given."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from pagedlib.core.blocks import BlockManager, InvariantError
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.groups import NULL_BLOCK
from pagedlib.core.prefix_cache import chained_keys
from pagedlib.core.radix_cache import RadixCache
from pagedlib.util import ceil_div

__all__ = ["InvariantError", "block_holders", "block_owners", "check_hash_cache", "check_host",
           "check_invariants", "check_radix_cache", "fill_unused", "holders", "radix_state", "state_diff"]

# what state_diff compares: the attributes of a PagedKVCache
STATE = ("k", "v", "free", "tables", "seq_lens", "ref_counts", "cow_copies", "prefix_cache", "token_ids")
# and, for a cache of several KV-cache groups or a window group (notebook 15), the manager's
GROUP_STATE = ("group_tables", "computed", "block_keys")


def group_tables(manager: Any) -> list[dict[Hashable, list[int]]]:
    """Each KV-cache group's tables (a manager without groups, such as a reader's: its ``tables``)."""
    return getattr(manager, "group_tables", [manager.tables])


def holders(manager: Any) -> list[list[tuple[Hashable, int]]]:
    """``holders[b]``: (sequence, logical index) of every table entry of the ``BlockManager`` naming block
    ``b`` (all in one KV-cache group's tables: a block belongs to one group at a time)."""
    return [[(seq_id, index) for _, seq_id, index in entries] for entries in _holders(manager)]


def _holders(manager: Any) -> list[list[tuple[int, Hashable, int]]]:
    """``holders`` with each entry's group first: (group, sequence, logical index); a window group's
    ``NULL_BLOCK`` entries (given back) name no block (anywhere else it is an invalid block id)."""
    windows = getattr(manager, "windows", (None,))
    seq_ids = manager.tables.keys()
    if seq_ids != manager.seq_lens.keys() or seq_ids != manager.token_ids.keys():
        raise InvariantError("tables, seq_lens and token_ids hold different sequence ids")
    found: list[list[tuple[int, Hashable, int]]] = [[] for _ in range(manager.num_blocks)]
    for group, tables in enumerate(group_tables(manager)):
        if tables.keys() != seq_ids:
            raise InvariantError(f"group {group}'s tables and group 0's hold different sequence ids")
        for seq_id, table in tables.items():
            for index, block in enumerate(table):
                if block == NULL_BLOCK and windows[group] is not None:
                    continue
                _check_block_id(block, manager.num_blocks, f"sequence {seq_id!r}")
                if found[block] and found[block][-1][:2] == (group, seq_id):
                    where = f"the table of sequence {seq_id!r}"
                    raise InvariantError(f"1: block {block} appears twice in {where}")
                if found[block] and found[block][-1][0] != group:
                    raise InvariantError(f"1: block {block} is held in groups {found[block][-1][0]} and "
                                         f"{group} (a block belongs to one group at a time)")
                found[block].append((group, seq_id, index))
    return found


def check_invariants(cache: PagedKVCache | BlockManager) -> None:
    """Raise ``InvariantError`` naming the first broken invariant of a ``PagedKVCache``'s (or a
    ``BlockManager``'s) bookkeeping: 1 reference counts, 2 free blocks, 3 block ids, 4 table lengths
    (notebook 02), 5 shared blocks, 6 prefix caching (06)."""
    manager = cache
    if isinstance(cache, PagedKVCache):
        manager = cache.manager
    held_by = holders(manager)
    block_size = manager.block_size
    for block, count in enumerate(manager.ref_counts):
        if count != len(held_by[block]):
            names = [seq_id for seq_id, _ in held_by[block]]
            raise InvariantError(f"1: block {block} has reference count {count} but "
                                 f"{len(names)} tables hold it ({names})")
    _check_free(manager, held_by)
    for group, tables in enumerate(group_tables(manager)):
        in_group = f" in group {group}" if group else ""
        for seq_id, length in manager.seq_lens.items():
            held = len(tables[seq_id])
            want = ceil_div(length, block_size)
            if held != want:
                raise InvariantError(f"4: sequence {seq_id!r} of length {length} holds {held} "
                                     f"blocks{in_group}, expected ceil({length}/{block_size}) = {want}")
    for block, entries in enumerate(held_by):
        fills = {(index, min(block_size, manager.seq_lens[seq_id] - index * block_size))
                 for seq_id, index in entries}
        if len(fills) > 1:
            raise InvariantError(f"5: shared block {block} differs between its holders "
                                 f"{entries} (index, fill)")
    if manager.prefix_cache is not None:
        _check_prefix_cache(manager)
    _check_windows(manager)


def _check_windows(manager: Any) -> None:
    """Invariant 7 (notebook 15): a sliding-window group's table of a sequence gives back exactly the blocks
    wholly before the window of the token after those it held when its last reservation began
    (``computed``, vLLM's ``num_computed_tokens`` at ``allocate_slots``): its first ``skipped //
    block_size`` entries are ``NULL_BLOCK``, ``skipped = max(0, computed - window + 1)``, and no other
    entry is (the blocks its window may still read)."""
    windows = getattr(manager, "windows", (None,))
    for group, window in enumerate(windows):
        if window is None:
            continue
        for seq_id, table in manager.group_tables[group].items():
            computed = manager.computed[seq_id]
            if computed > manager.seq_lens[seq_id]:
                raise InvariantError(f"7: sequence {seq_id!r} computed {computed} tokens of "
                                     f"{manager.seq_lens[seq_id]}")
            skipped = max(0, computed - window + 1)
            gone = min(skipped // manager.block_size, len(table))
            want = [block == NULL_BLOCK for block in table]
            if want != [index < gone for index in range(len(table))]:
                raise InvariantError(f"7: sequence {seq_id!r}'s table {table} in group {group} (window "
                                     f"{window}) should give back its first {gone} blocks, no others")


def _check_free(manager: Any, held_by: list[list[tuple[Hashable, int]]]) -> None:
    """Invariant 2: every block nobody holds is free (on the stack or in the prefix cache's queue), once."""
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
    if isinstance(manager.prefix_cache, RadixCache):
        problem = check_radix_cache(manager.prefix_cache, manager)
    else:
        problem = check_hash_cache(manager.prefix_cache, manager)
    if problem is not None:
        raise InvariantError(f"6: {problem}")


def check_hash_cache(prefix_cache: Any, manager: BlockManager) -> str | None:
    """The first broken invariant of a ``PrefixCache``, or ``None``: its two maps agree (``keys[b]`` is the
    key of each registered block, ``blocks[key]`` lists every block with that key); every full block of
    every table has the key of its tokens after its parent, and no partly filled block has a key; a
    registered block nobody holds waits in ``free_queue``, never on the plain free stack; every block in
    ``free_queue`` is registered and held by nobody."""
    block_size = prefix_cache.block_size
    shelves = getattr(prefix_cache, "group_blocks", [prefix_cache.blocks])
    for shelf in shelves:
        for key, blocks in shelf.items():
            if not blocks or any(prefix_cache.keys.get(block) != key for block in blocks):
                return f"key {key} names blocks {list(blocks)}, whose own keys differ"
    for block, key in prefix_cache.keys.items():
        named = [group for group, shelf in enumerate(shelves) if block in shelf.get(key, ())]
        if len(named) != 1:
            return f"block {block} has key {key}, which names it in groups {named}, not in one"
    if len(shelves) > 1 or getattr(manager, "has_window", False):
        return _check_group_keys(prefix_cache, manager, shelves)
    tables, token_ids = manager.tables, manager.token_ids
    for seq_id, table in tables.items():
        full = len(token_ids[seq_id]) // block_size
        for index in range(full):
            block = table[index]
            key = prefix_cache.keys.get(block)
            tokens = tuple(token_ids[seq_id][index * block_size:(index + 1) * block_size])
            parent = None
            if index > 0:
                parent = prefix_cache.keys.get(table[index - 1])
            if key is None or key.tokens != tokens or key.parent != parent:
                return f"full block {block} of sequence {seq_id!r} has key {key}, not its tokens"
        for block in table[full:]:
            if block in prefix_cache.keys:
                return f"block {block}, partly filled in sequence {seq_id!r}, has a key"
    return _check_free_cached(prefix_cache, manager, prefix_cache.keys)


def _check_group_keys(prefix_cache: Any, manager: BlockManager, shelves: list[dict]) -> str | None:
    """``check_hash_cache`` over KV-cache groups (notebook 15): every full block a group's table holds has
    the chained key of the sequence's tokens up to it, on that group's shelf (a window group's parent may
    be given back, so the keys are made again from the token ids), and no partly filled block has a key, nor
    any block of a window of 1 (which registers none, as vLLM keeps none). A window group's block that its
    next reservation gives back may have lost its key: an undone step restores it after the pool evicted it
    (``BlockManager.undo``)."""
    block_size = prefix_cache.block_size
    for seq_id, tokens in manager.token_ids.items():
        keys = list(chained_keys(tokens, block_size))
        for group, tables in enumerate(manager.group_tables):
            table = tables[seq_id]
            window = manager.windows[group]
            leaving = 0 if window is None else max(0, len(tokens) - window + 1) // block_size
            for index, block in enumerate(table):
                if block == NULL_BLOCK:
                    continue
                key = prefix_cache.keys.get(block)
                if index >= len(keys) or window == 1:
                    if key is not None:
                        return f"block {block} of sequence {seq_id!r} in group {group} has a key"
                elif key is None and index < leaving:
                    continue
                elif key != keys[index] or block not in shelves[group].get(key, ()):
                    return (f"full block {block} of sequence {seq_id!r} in group {group} has key {key}, not "
                            f"the key of its tokens in that group")
    return _check_free_cached(prefix_cache, manager, prefix_cache.keys)


def _check_free_cached(prefix_cache: Any, manager: BlockManager, cached: Any) -> str | None:
    """Both caches: a cached block nobody holds waits in ``free_queue``, which holds only such blocks; the
    plain free stack holds no cached block (the next allocation would overwrite what a lookup finds)."""
    on_stack = [block for block in manager.free if block in cached]
    if on_stack:
        return f"cached blocks {on_stack} are on the plain free stack"
    stale = [block for block in prefix_cache.free_queue
             if block not in cached or manager.ref_counts[block] > 0]
    if stale:
        return f"blocks {stale} wait in the prefix cache's queue, held or without cached content"
    lost = [block for block in cached
            if manager.ref_counts[block] == 0 and block not in prefix_cache.free_queue]
    if lost:
        return f"cached blocks {lost} are held by nobody and not in the prefix cache's queue"
    return None


def check_radix_cache(tree: Any, manager: BlockManager) -> str | None:
    """The first broken invariant of a ``RadixCache``, or ``None``: every cached block sits in exactly one
    node reachable from the root, runs are whole blocks, every full block of a table is the block its
    tokens walk to (and no partly filled one is cached), a free block has no held block after it (so
    eviction can always reach it), and a cached block nobody holds waits in ``free_queue``, never on the
    plain free stack."""
    tables, token_ids = manager.tables, manager.token_ids
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
    problem = _check_free_cached(tree, manager, tree.node_of)
    if problem is not None:
        return problem
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
    nothing. With KV-cache groups, ``group_tables``, ``computed`` and ``block_keys`` too."""
    names = [name for name in STATE if not _same(getattr(after, name), getattr(before, name))]
    if getattr(getattr(after, "manager", None), "windows", (None,)) != (None,):
        names += [name for name in GROUP_STATE
                  if getattr(after.manager, name) != getattr(before.manager, name)]
    return names


def _same(now: object, before: object) -> bool:
    """Equal, and for tensors bit for bit with NaN equal to NaN."""
    if isinstance(now, RadixCache):
        return isinstance(before, RadixCache) and radix_state(now) == radix_state(before)
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
    used = [slot for group in range(len(group_tables(cache.manager))) for seq_id in cache.tables
            for slot in cache.manager.slots(seq_id, group) if slot != NULL_BLOCK]
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


def check_host(scheduler: Any) -> None:
    """Raise ``InvariantError`` naming the first broken invariant of a ``Scheduler``'s host tier (notebook
    13): every host slot is in exactly one place (free, a cached block's, a swapped request's), the policy
    knows exactly the cached keys, only a preempted request holds swapped slots and they hold its tokens,
    and a cached block's K/V equal (to rounding) a device block the hash prefix cache holds with that key."""
    connector = scheduler.connector
    host = getattr(connector, "tier", None)  # the host tier is a connector's (HostConnector)
    if host is None:
        return
    swapped = {req_id: record.slots for req_id, record in connector.swapped.items()}
    _check_host_slots(scheduler, host, swapped)
    _check_swapped(scheduler, connector.swapped)
    _check_host_contents(scheduler, host)


def _check_host_slots(scheduler: Any, host: Any, swapped: dict) -> None:
    problem = host.cache.check(swapped)  # every slot in one place; the policy's keys the cached ones
    if problem is not None:
        raise InvariantError(f"host: {problem}")
    if host.cache.pinned and scheduler.plan is None:
        raise InvariantError(f"host: keys still pinned between steps: {list(host.cache.pinned)[:4]}")


def _check_swapped(scheduler: Any, swapped: dict) -> None:
    block_size = scheduler.block_size
    for req_id, record in swapped.items():
        request = scheduler.requests.get(req_id)
        if request is None or request.status.name != "PREEMPTED" or req_id in scheduler.cache.seq_lens:
            status = "gone" if request is None else request.status.name
            raise InvariantError(f"host: request {req_id} holds swapped slots but is {status}")
        if len(record.slots) != ceil_div(record.tokens, block_size):
            raise InvariantError(f"host: request {req_id} swapped {record.tokens} tokens into "
                                 f"{len(record.slots)} slots")


def _check_host_contents(scheduler: Any, host: Any) -> None:
    cache = host.cache
    prefix = scheduler.cache.prefix_cache
    if prefix is None or isinstance(prefix, RadixCache):
        return
    for block, key in prefix.keys.items():
        slot = cache.slots.get(key)
        if slot is None or block in _unwritten(scheduler):
            continue
        for device, stored in ((scheduler.cache.k, host.k), (scheduler.cache.v, host.v)):
            # a block computed twice (another chunking, another batch) may differ in its last bits
            if not torch.allclose(device[block].float(), stored[slot].float(), rtol=1e-3, atol=1e-3):
                raise InvariantError(f"host: slot {slot} and device block {block} hold the same key "
                                     f"but different K/V")


def _unwritten(scheduler: Any) -> set[int]:
    """Blocks registered by the open plan, if any: their K/V are not written yet."""
    if scheduler.plan is None:
        return set()
    return set(scheduler.journal.registered)
