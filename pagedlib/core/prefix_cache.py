"""Prefix caching: full KV blocks findable by their content, kept after their last user is gone (notebook 06).

``PagedKVCache(..., enable_prefix_caching=True)`` owns one ``PrefixCache``. The idea is vLLM's automatic
prefix caching (v1 ``KVCacheManager``): when a block becomes full, the cache computes a key for its content
from the key of the block before it and the block's own token ids, and registers the block under it. A new
request whose prompt starts with the same tokens walks its full blocks, looks each key up, and attaches the
blocks it finds instead of computing their K/V again. A registered block whose reference count drops to 0
keeps its content and waits in ``free_queue``; allocation takes plain free blocks first and evicts from this
queue, least recently used first, only when none is left.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BlockKey", "PrefixCache"]


class BlockKey:
    """The content of a full block: its token ids and the key of the block before it (``None`` for the
    first block). Hashes as ``hash((parent hash, token ids))``, vLLM's block hash; equality compares the
    token ids of the whole prefix, so a hash collision can never attach the wrong K/V."""

    __slots__ = ("hash", "parent", "tokens")

    def __init__(self, parent: BlockKey | None, tokens: tuple[int, ...]) -> None:
        self.parent, self.tokens = parent, tokens
        self.hash = hash((0 if parent is None else parent.hash, tokens))

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        a, b = self, other
        while a is not b:  # walk both prefixes back to a shared ancestor (usually at once: the same object)
            if not (isinstance(a, BlockKey) and isinstance(b, BlockKey)):
                return False
            if a.hash != b.hash or a.tokens != b.tokens:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockKey({self.hash:#x}, tokens={list(self.tokens)})"


@dataclass
class PrefixCache:
    """Which blocks hold which content, and which of them nobody holds any more (in eviction order).

    ``keys[b]``: the key of full block ``b``'s content (every full block of a live sequence has one);
    ``blocks[key]``: the block registered for that content (the first block that held it); ``free_queue``:
    registered blocks with reference count 0, least recently freed first (the next evicted).
    """

    block_size: int
    keys: dict[int, BlockKey] = field(default_factory=dict)
    blocks: dict[BlockKey, int] = field(default_factory=dict)
    free_queue: OrderedDict[int, None] = field(default_factory=OrderedDict)
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0

    def peek(self, token_ids: Sequence[int]) -> list[int]:
        """The registered blocks holding the longest run of full leading blocks of ``token_ids``, at most
        ``len(token_ids) - 1`` tokens (the caller computes the last prompt token itself, for its logits).
        Counts nothing: a scheduler asks this before it decides to admit."""
        bs, found, parent = self.block_size, [], None
        for i in range((len(token_ids) - 1) // bs):
            block = self.blocks.get(BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            found.append(block)
            parent = self.keys[block]
        return found

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """``peek``, counted in the statistics (``queried_tokens``, ``hit_tokens``)."""
        found = self.peek(token_ids)
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(found) * self.block_size
        return found

    def register(self, block: int, parent: int | None, tokens: Sequence[int]) -> None:
        """``block`` just became full with ``tokens`` after block ``parent``: give it its key, and make it
        findable unless another block already holds the same content."""
        key = BlockKey(None if parent is None else self.keys[parent], tuple(tokens))
        self.keys[block] = key
        self.blocks.setdefault(key, block)

    def is_cached(self, block: int) -> bool:
        """``block`` holds content that a lookup can find."""
        key = self.keys.get(block)
        return key is not None and self.blocks.get(key) == block

    def release(self, block: int) -> bool:
        """``block``'s reference count reached 0. A cached block joins the back of ``free_queue`` (most
        recently used, evicted last) and ``True`` is returned; any other block forgets its key."""
        if self.is_cached(block):
            self.free_queue[block] = None
            return True
        self.keys.pop(block, None)
        return False

    def reuse(self, block: int) -> None:
        """A lookup attached ``block``: it is in use again, so it leaves ``free_queue`` if it was there."""
        self.free_queue.pop(block, None)

    def evict(self) -> int:
        """Take the least recently used block of ``free_queue`` for new content: its key is forgotten."""
        block, _ = self.free_queue.popitem(last=False)
        del self.blocks[self.keys.pop(block)]
        self.evicted_blocks += 1
        return block

    def stats(self) -> dict[str, float]:
        """Prompt tokens looked up, tokens found, hit rate, blocks evicted, blocks findable right now."""
        rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens, "hit_rate": rate,
                "evicted_blocks": self.evicted_blocks, "cached_blocks": len(self.blocks)}
