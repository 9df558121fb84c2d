"""Prefix caching (notebook 06), vLLM's automatic prefix caching: a full block is registered under a key made
of its parent's key and its token ids, so a prompt that starts with the same tokens attaches it instead of
computing its K/V again; a registered block nobody holds waits in ``free_queue`` until evicted (LRU).

A hybrid model's KV-cache groups (notebook 15) register their blocks under the same keys, each group on its
own shelf (vLLM keys a block by its hash and its group), and share one ``free_queue``: ``peek_groups``
finds the longest prefix every group can serve."""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from pagedlib import figures
from pagedlib.core import _checks as checks
from pagedlib.core.groups import NULL_BLOCK
from pagedlib.util import as_int, ceil_div


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
    grow); ``free_queue``: registered blocks nobody holds, least recently freed first (evicted next).
    ``num_groups``: the KV-cache groups, each with its own ``group_blocks[g]`` (``blocks`` is group 0's);
    a block is registered in one group at a time."""

    block_size: int
    keys: dict[int, BlockKey] = field(default_factory=dict)
    blocks: dict[BlockKey, dict[int, None]] = field(default_factory=dict)  # an ordered set per key
    free_queue: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    num_groups: int = 1
    group_blocks: list[dict[BlockKey, dict[int, None]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.block_size = as_int("block_size", self.block_size, minimum=1)
        self.num_groups = as_int("num_groups", self.num_groups, minimum=1)
        self.group_blocks = [self.blocks] + [{} for _ in range(self.num_groups - 1)]

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
        return self.add(block, BlockKey(parent_key, tuple(tokens)))

    def add(self, block: int, key: BlockKey, group: int = 0) -> int:
        """Register ``block`` of KV-cache ``group`` under ``key`` (made from the tokens, as vLLM hashes a
        request's blocks whatever its tables hold: a window group's parent block may be given back).
        Returns ``block``."""
        self.keys[block] = key
        self.group_blocks[group].setdefault(key, {})[block] = None
        return block

    def peek_groups(self, token_ids: Sequence[int], keys: Sequence[BlockKey] | None,
                    windows: Sequence[int | None]) -> list[list[int]]:
        """Each group's blocks for the longest prefix of ``token_ids`` that every group can serve (at most
        ``len(token_ids) - 1`` tokens), group ``g`` attending over ``windows[g]`` tokens (``None``: full
        attention), as vLLM 0.32.0's ``HybridKVCacheCoordinator.find_longest_cache_hit`` reconciles them:

        - the full groups walk from the first block while every one of them finds it;
        - the window groups then search back from that length for the last run of blocks that every one of
          them finds and that covers a window (``ceil((window - 1) / block_size)`` blocks, at least one;
          ``SlidingWindowManager.find_longest_cache_hit``), else the run that starts the prompt;
        - the prefix ends with that run; a full group keeps its blocks up to there, a window group holds the
          run's blocks past those its window skips (``NULL_BLOCK`` before).

        The lists are all as long as the prefix is in blocks. Counts nothing."""
        stop = (len(token_ids) - 1) // self.block_size
        if keys is None:
            keys = list(chained_keys(token_ids, self.block_size, stop))
        full = [g for g, window in enumerate(windows) if window is None]
        length = 0 if full else stop    # blocks every group serves, so far
        while length < stop and all(keys[length] in self.group_blocks[g] for g in full):
            length += 1
        sliding = [g for g, window in enumerate(windows) if window is not None]
        start = 0                       # a window group's run of found blocks: [start, length)
        if sliding:
            start, length = self._window_run(keys, length, windows[sliding[0]], sliding)
        found = []
        for g, window in enumerate(windows):
            first = 0
            if window is not None:   # the window of the first token after the prefix skips these
                first = max(start, max(0, length * self.block_size - window + 1) // self.block_size)
            found.append([NULL_BLOCK] * first + [next(iter(self.group_blocks[g][key]))
                                                 for key in keys[first:length]])
        return found

    def _window_run(self, keys: Sequence[BlockKey], length: int, window: int,
                    groups: Sequence[int]) -> tuple[int, int]:
        """The last run of blocks before block ``length`` that every one of ``groups`` finds and that covers
        ``window`` tokens, or the run from block 0 if none does: (its first block, the block after it)."""
        need = max(1, ceil_div(window - 1, self.block_size))
        run = 0
        for index in range(length - 1, -1, -1):
            if not all(keys[index] in self.group_blocks[g] for g in groups):
                run = 0
                continue
            run += 1
            if run == need:
                return index, index + need
        return 0, run

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
        for shelf in self.group_blocks:  # the block's group's: a block is in one group at a time
            holders = shelf.get(key)
            if holders is not None and block in holders:
                del holders[block]
                if not holders:
                    del shelf[key]
                return

    def evict(self) -> int:
        """Take the least recently used block of ``free_queue`` for new content; it forgets its key."""
        block, _ = self.free_queue.popitem(last=False)
        self.forget(block)
        self.evicted_blocks += 1
        return block

    stats = figures.prefix_cache_stats  # the lookup counters, hit rate and blocks a lookup finds now
