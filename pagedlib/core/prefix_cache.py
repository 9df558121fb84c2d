"""Prefix caching (notebook 06), vLLM's automatic prefix caching: a full block is registered under a key made
of its parent's key and its token ids, so a prompt that starts with the same tokens attaches it instead of
computing its K/V again; a registered block nobody holds waits in ``free_queue`` until evicted (LRU)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedlib import figures
from pagedlib.core import _checks as checks
from pagedlib.util import as_int


class BlockKey:
    """A full block's content: its token ids after the block ``parent`` (``None`` for the first). It hashes
    as vLLM's block hash, ``hash((parent hash, token ids))``; equality compares the token ids of the whole
    prefix, so a hash collision can never attach the wrong K/V."""

    __slots__ = ("hash", "parent", "tokens")

    def __init__(self, parent: BlockKey | None, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tokens
        parent_hash = 0
        if parent is not None:
            parent_hash = parent.hash
        self.hash = hash((parent_hash, tokens))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        mine: object = self
        theirs = other
        # walk both prefixes back to a shared ancestor (usually at once: the same)
        while mine is not theirs:
            if not (isinstance(mine, BlockKey) and isinstance(theirs, BlockKey)):
                return False
            if mine.tokens != theirs.tokens:
                return False
            mine = mine.parent
            theirs = theirs.parent
        return True

    def __repr__(self) -> str:
        return f"BlockKey({self.hash:#x}, tokens={list(self.tokens)})"


def chained_keys(token_ids: Sequence[int], block_size: int, stop: int | None = None,
                 link: Callable[[Any, tuple[int, ...]], Any] = BlockKey, start: int = 0,
                 parent: Any = None) -> Iterator[Any]:
    """The keys of the full blocks of ``token_ids`` from block ``start`` (``parent``: the key of the block
    before it) to block ``stop`` at most, each ``link(parent key or None, the block's token ids)``: a
    ``BlockKey``, or a store's hash (``kv_transfer.store.block_hash``). Lazy: a lookup that stops at its first
    miss makes no key after it; a caller that kept the keys so far extends them without making them again."""
    full = len(token_ids) // block_size
    for index in range(start, full if stop is None else min(stop, full)):
        parent = link(parent, tuple(token_ids[index * block_size:(index + 1) * block_size]))
        yield parent


@dataclass
class PrefixCache:
    """``keys[b]``: the key of full block ``b``; ``blocks[key]``: the blocks registered with it, oldest first
    (a lookup finds the first; a block computed twice keeps its key, as in vLLM 0.32.0, whose tables only
    grow); ``free_queue``: registered blocks nobody holds, least recently freed first (evicted next)."""

    block_size: int
    keys: dict[int, BlockKey] = field(default_factory=dict)
    blocks: dict[BlockKey, dict[int, None]] = field(default_factory=dict)  # an ordered set per key
    free_queue: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    def __post_init__(self) -> None:
        self.block_size = as_int("block_size", self.block_size, minimum=1)

    def peek(self, token_ids: Sequence[int]) -> list[int]:
        """The registered blocks holding the longest run of full leading blocks of ``token_ids``, at most
        ``len(token_ids) - 1`` tokens (the last one is computed for its logits). Counts nothing."""
        block_size = self.block_size
        found: list[int] = []
        parent = None
        for index in range((len(token_ids) - 1) // block_size):
            page = tuple(token_ids[index * block_size:(index + 1) * block_size])
            key = BlockKey(parent, page)
            holders = self.blocks.get(key)
            if not holders:
                break
            found.append(next(iter(holders)))
            parent = key
        return found

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """``peek``, counted in the statistics (``queried_tokens``, ``hit_tokens``)."""
        found = self.peek(token_ids)
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(found) * self.block_size
        return found

    def register(self, block: int, parent: int | None, tokens: Sequence[int]) -> int:
        """``block`` just became full with ``tokens`` after block ``parent``: it gets its key and can be
        found by it (after any block registered with the same key before it). Returns ``block``."""
        checks.page(tokens, self.block_size)
        parent_key = None
        if parent is not None:
            parent_key = self.keys[parent]
        key = BlockKey(parent_key, tuple(tokens))
        self.keys[block] = key
        self.blocks.setdefault(key, {})[block] = None
        return block

    def is_cached(self, block: int) -> bool:
        """``block`` holds content that a lookup can find (first or after its elders)."""
        return block in self.keys

    def release(self, block: int) -> bool:
        """Nobody holds ``block``: a registered one joins the back of ``free_queue`` (``True``)."""
        if self.is_cached(block):
            self.free_queue[block] = None
            return True
        return False

    def forget(self, block: int) -> None:
        """``block``'s content is gone (evicted, or a write into it rolled back): it loses its key."""
        key = self.keys.pop(block, None)
        if key is None:
            return
        holders = self.blocks[key]
        del holders[block]
        if not holders:
            del self.blocks[key]

    def evict(self) -> int:
        """Take the least recently used block of ``free_queue`` for new content; it forgets its key."""
        block, _ = self.free_queue.popitem(last=False)
        self.forget(block)
        self.evicted_blocks += 1
        return block

    stats = figures.prefix_cache_stats  # the lookup counters, hit rate and blocks a lookup finds now
