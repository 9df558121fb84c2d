"""Radix prefix cache (notebook 11), SGLang's ``RadixCache`` on our block pool: a tree whose edges are runs of
token ids, children keyed by their first block of tokens (a page; SGLang's default is one token). The hooks
are ``PrefixCache``'s, so the same ``BlockManager`` runs either design."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from pagedlib.util import as_int


class TreeNode:
    """A run of ``tokens`` (``len(blocks) * block_size`` ids) whose K/V lives in ``blocks``, in order."""

    __slots__ = ("parent", "tokens", "blocks", "children", "last_used")

    def __init__(self, parent: TreeNode | None, tokens: list[int], blocks: list[int], last_used: int) -> None:
        self.parent, self.tokens, self.blocks, self.last_used = parent, tokens, blocks, last_used
        self.children: dict[tuple[int, ...], TreeNode] = {}  # first block's token ids -> child


class RadixCache:
    """``root``: the empty run; ``node_of[b]``: the node holding cached block ``b``; ``free_queue``: cached
    blocks nobody holds (SGLang's unlocked nodes: a table holding a block is its lock); ``leaves``: a heap of
    eviction candidates ``(last use, leaf)``, stale once the leaf is used again, grows or loses its blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = as_int("block_size", block_size, minimum=1)
        self.root = TreeNode(None, [], [], 0)
        self.node_of: dict[int, TreeNode] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict()
        self.leaves: list[tuple[int, int, TreeNode]] = []  # (last use, id: ties never compare nodes, leaf)
        self.clock = self.queried_tokens = self.hit_tokens = self.evicted_blocks = 0

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], TreeNode, int]:
        """Walk down from the root along ``token_ids``, at most ``len(token_ids) - 1`` tokens (the last one
        is computed for its logits). Returns the blocks found, the node the walk ended in and how many of
        that node's blocks matched. Changes nothing."""
        bs, node, found = self.block_size, self.root, []
        ids = list(token_ids[:(len(token_ids) - 1) // bs * bs])
        while len(found) * bs < len(ids):
            at = len(found) * bs
            child = node.children.get(tuple(ids[at:at + bs]))
            if child is None:
                return found, node, len(node.blocks)
            run = child.tokens
            if run == ids[at:at + len(run)]:  # the whole run matches: one list comparison
                found += child.blocks
                node = child
                continue
            m, most = 1, min(len(run), len(ids) - at) // bs  # the first block matched by its key
            while m < most:  # bisect for the last matching block: each test is one list comparison
                mid = (m + most + 1) // 2
                m, most = (mid, most) if run[:mid * bs] == ids[at:at + mid * bs] else (m, mid - 1)
            return found + child.blocks[:m], child, m
        return found, node, len(node.blocks)

    def peek(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest run of full leading blocks of ``token_ids``."""
        return self.match_prefix(token_ids)[0]

    def lookup(self, token_ids: Sequence[int]) -> list[int]:
        """``peek``, counted in the statistics; the path it took becomes the most recently used (a partly
        matched node is split first, so its unmatched tail keeps its age)."""
        found, node, m = self.match_prefix(token_ids)
        if m < len(node.blocks):
            node = self._split(node, m)
        self.clock += 1
        while node is not self.root:
            node.last_used, node = self.clock, node.parent
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(found) * self.block_size
        return found

    def partial_match(self, token_ids: Sequence[int], found: list[int]) -> tuple[int, int]:
        """The cached block whose first tokens continue ``found`` (the blocks ``lookup`` gave for
        ``token_ids``) furthest, and how many: a copy of it saves computing them. ``(-1, 0)`` if none."""
        bs, at = self.block_size, len(found) * self.block_size
        want = list(token_ids[at:min(at + bs, len(token_ids) - 1)])
        node = self.node_of[found[-1]] if found else self.root
        i = node.blocks.index(found[-1]) + 1 if found else 0
        nexts = [(node.blocks[i], node.tokens[i * bs:(i + 1) * bs])] if i < len(node.blocks) else [
            (c.blocks[0], c.tokens[:bs]) for c in node.children.values()]
        n, block = max([(next((k for k, (a, b) in enumerate(zip(page, want)) if a != b), len(want)), b)
                        for b, page in nexts] if bs > 1 else [], default=(0, -1))
        return (block, n) if n else (-1, 0)

    def insert(self, block: int, parent: int | None, tokens: Sequence[int]) -> None:
        """``block`` just became full with ``tokens`` after block ``parent``: it extends its parent's run when
        that run ends a leaf, else starts a new child. A block whose parent is not in the tree, or whose
        content the tree holds already (computed twice at once), stays out of it."""
        node = self.root if parent is None else self.node_of.get(parent)
        if node is None:
            return
        tail = parent is None or node.blocks[-1] == parent  # usually: a sequence growing its own leaf
        at = len(node.blocks) if tail else node.blocks.index(parent) + 1
        page = tuple(tokens)
        if at < len(node.blocks):  # the parent ends mid-run: the run's next block or a branch
            if tuple(node.tokens[at * self.block_size:(at + 1) * self.block_size]) == page:
                return
            node = self._split(node, at)
        elif page in node.children:
            return
        if node is not self.root and not node.children:
            node.tokens += page
            node.blocks.append(block)
        else:
            node.children[page] = node = TreeNode(node, list(page), [block], self.clock)
        self.node_of[block] = node

    register = insert  # the name the BlockManager calls (PrefixCache.register)

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut ``node`` after its first ``m`` blocks: a new parent holds them, ``node`` keeps the rest (and
        its children, age and heap entries). Returns the new parent."""
        cut = m * self.block_size
        top = TreeNode(node.parent, node.tokens[:cut], node.blocks[:m], node.last_used)
        node.parent.children[tuple(node.tokens[:self.block_size])] = top  # type: ignore[union-attr]
        top.children[tuple(node.tokens[cut:cut + self.block_size])] = node
        node.parent, node.tokens, node.blocks = top, node.tokens[cut:], node.blocks[m:]
        for b in top.blocks:
            self.node_of[b] = top
        return top

    def is_cached(self, block: int) -> bool:
        """``block`` holds content that a lookup can find."""
        return block in self.node_of

    def release(self, block: int) -> bool:
        """Nobody holds ``block``: a cached one joins ``free_queue`` (``True``) and its node was used now; a
        leaf whose last block is free is a candidate for eviction."""
        node = self.node_of.get(block)
        if node is None:
            return False
        self.free_queue[block] = None
        self.clock += 1
        node.last_used = self.clock
        if not node.children and node.blocks[-1] in self.free_queue:
            heapq.heappush(self.leaves, (node.last_used, id(node), node))
        return True

    def forget(self, block: int) -> None:
        """``block``'s content is gone (a write into it was rolled back): it leaves the tree with every block
        after it (registered by the same rolled-back call)."""
        node = self.node_of.get(block)
        if node is None:
            return
        at = node.blocks.index(block)
        todo, gone = list(node.children.values()), node.blocks[at:]
        del node.blocks[at:], node.tokens[at * self.block_size:]
        node.children = {}
        while todo:
            gone += todo[-1].blocks
            todo += todo.pop().children.values()
        for b in gone:
            del self.node_of[b]
        if not node.blocks:
            self._remove_leaf(node)

    def evict(self) -> int:
        """Take the last block of the least recently used leaf nobody holds for new content."""
        while self.leaves:
            used, _, node = heapq.heappop(self.leaves)
            last = node.blocks[-1] if node.blocks and not node.children else -1
            if used != node.last_used or self.node_of.get(last) is not node or last not in self.free_queue:
                continue  # stale: used again since, grown, emptied, detached, or its last block is held
            block = node.blocks.pop()
            del node.tokens[-self.block_size:], self.node_of[block], self.free_queue[block]
            heapq.heappush(self.leaves, (used, id(node), node)) if node.blocks else self._remove_leaf(node)
            self.evicted_blocks += 1
            return block
        raise RuntimeError("no leaf of the radix tree is free to evict: running requests hold them all")

    def _remove_leaf(self, node: TreeNode) -> None:
        """Detach an emptied ``node``; a parent left childless with a free last block may be evicted next."""
        parent = node.parent
        if parent is None:
            return
        parent.children = {k: c for k, c in parent.children.items() if c is not node}
        if parent is not self.root and not parent.children and parent.blocks[-1] in self.free_queue:
            heapq.heappush(self.leaves, (parent.last_used, id(parent), parent))

    def stats(self) -> dict[str, float]:
        """Prompt tokens looked up, tokens found, hit rate, blocks evicted, blocks findable now, nodes."""
        rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens, "hit_rate": rate,
                "evicted_blocks": self.evicted_blocks, "cached_blocks": len(self.node_of),
                "nodes": len(set(self.node_of.values()))}

    def __eq__(self, other: object) -> bool:  # what PagedKVCache.state_diff compares
        return isinstance(other, RadixCache) and self._state() == other._state()

    def _state(self) -> tuple:
        """What a lookup can find and evict, whatever the cuts between nodes: each block with the block before
        it, its tokens and its node's age; the free blocks; the counts."""
        bs, rows = self.block_size, []
        for b, node in self.node_of.items():
            i = node.blocks.index(b)
            before = node.blocks[i - 1] if i else (node.parent.blocks or [None])[-1]  # type: ignore[union-attr]
            rows.append((b, before, tuple(node.tokens[i * bs:(i + 1) * bs]), node.last_used))
        return sorted(rows), set(self.free_queue), self.queried_tokens, self.hit_tokens, self.evicted_blocks

    def check(self, tables: dict, token_ids: dict) -> str | None:
        """The first broken invariant of the tree, or ``None``: every cached block sits in exactly one node
        reachable from the root, runs are whole blocks, each table starts with the blocks its tokens walk
        to, and a free block has no held block after it (so eviction can always reach it)."""
        bs, seen, todo = self.block_size, {}, [self.root]
        while todo:
            node = todo.pop()
            if len(node.tokens) != len(node.blocks) * bs or (node is not self.root and not node.blocks):
                return f"a node holds {len(node.tokens)} tokens in {len(node.blocks)} blocks"
            for key, child in node.children.items():
                if child.parent is not node or key != tuple(child.tokens[:bs]):
                    return f"a child of a node is keyed {key}, not by its first block"
                todo.append(child)
            seen.update((b, node) for b in node.blocks)
        if seen != self.node_of:
            return f"{len(self.node_of)} blocks are registered but {len(seen)} are reachable from the root"
        for s, table in tables.items():
            found = self.peek(token_ids[s] + [0])  # + [0]: every full block may be found
            k = next((i for i, b in enumerate(table) if b not in self.node_of), len(table))
            if table[:k] != found[:k] or any(b in self.node_of for b in table[k:]):
                return f"sequence {s!r} holds cached blocks its tokens do not walk to"
        for b in self.free_queue:
            node = self.node_of[b]
            later = node.blocks[node.blocks.index(b):] + [x for c in node.children.values() for x in c.blocks]
            if any(x not in self.free_queue for x in later):
                return f"free block {b} has a held block after it in the tree"
        return None
