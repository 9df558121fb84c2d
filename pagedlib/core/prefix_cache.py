"""Prefix caching (notebook 06), vLLM's automatic prefix caching: a full block is registered under a key made
of its parent's key and its token ids, so a prompt that starts with the same tokens attaches it instead of
computing its K/V again; a registered block nobody holds waits in ``free_queue`` until evicted (LRU)."""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from pagedlib import figures
from pagedlib.core import _checks as checks
from pagedlib.util import as_int


class BlockKey:
    """A full block's content: its token ids after the block ``parent`` (``None`` for the first). Its
    ``digest``, SHA-256 (hex) of its parent's digest (nothing for the first block) and its token ids as
    little-endian 64-bit integers, is computed once, when the key is made, and stands for the whole prefix:
    keys hash and compare by digest alone, as vLLM's block hashes do (SHA-256 by default in vLLM 0.32.0), so
    a comparison costs the same at block 1 and block 1,000 (two different prefixes with the same digest
    would be a SHA-256 collision). The prefix cache, the host tier and the file store (whose entries the
    digests name) all key blocks by it. ``parent`` and ``tokens`` stay for the pictures of the chain."""

    __slots__ = ("digest", "parent", "tokens")

    def __init__(self, parent: BlockKey | None, tokens: tuple[int, ...]) -> None:
        self.parent = parent
        self.tokens = tokens
        head = bytes.fromhex(parent.digest) if parent is not None else b""
        self.digest = hashlib.sha256(head + struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()

    def __hash__(self) -> int:
        return hash(self.digest)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockKey) and self.digest == other.digest

    def __repr__(self) -> str:
        return f"BlockKey({self.digest[:12]}..., tokens={list(self.tokens)})"


def chained_keys(token_ids: Sequence[int], block_size: int, stop: int | None = None, start: int = 0,
                 parent: BlockKey | None = None) -> Iterator[BlockKey]:
    """The keys of the full blocks of ``token_ids`` from block ``start`` (``parent``: the key of the block
    before it) to block ``stop`` at most. Lazy: a lookup that stops at its first miss makes no key after it;
    a caller that kept the keys so far extends them without making them again."""
    full = len(token_ids) // block_size
    for index in range(start, full if stop is None else min(stop, full)):
        parent = BlockKey(parent, tuple(token_ids[index * block_size:(index + 1) * block_size]))
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

    def peek(self, token_ids: Sequence[int], keys: Iterable[BlockKey] | None = None) -> list[int]:
        """The registered blocks holding the longest run of full leading blocks of ``token_ids``, at most
        ``len(token_ids) - 1`` tokens (the last one is computed for its logits). ``keys``: those blocks'
        keys if the caller keeps them (a scheduler's request makes each once, ``Request.block_keys``);
        otherwise made here, one per block walked. One dictionary probe per block. Counts nothing."""
        stop = (len(token_ids) - 1) // self.block_size
        if keys is None:
            keys = chained_keys(token_ids, self.block_size, stop)
        found: list[int] = []
        for key in itertools.islice(keys, stop):
            holders = self.blocks.get(key)
            if not holders:
                break
            found.append(next(iter(holders)))
        return found

    def lookup(self, token_ids: Sequence[int], keys: Iterable[BlockKey] | None = None) -> list[int]:
        """``peek``, counted in the statistics (``queried_tokens``, ``hit_tokens``)."""
        found = self.peek(token_ids, keys)
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
