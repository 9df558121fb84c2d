"""Radix prefix cache (notebook 11), SGLang's ``RadixCache`` on our block pool: a tree whose edges are runs of
token ids, children keyed by their first block of tokens (a page; SGLang's default is one token). The hooks
are ``PrefixCache``'s, so the same ``BlockManager`` runs either design."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from pagedlib import figures
from pagedlib.core import _checks as checks
from pagedlib.util import as_int


@dataclass(eq=False, repr=False, slots=True)  # a node is itself: compared and hashed by identity
class TreeNode:
    """A run of ``tokens`` (``len(blocks) * block_size`` ids) whose K/V lives in ``blocks``, in order."""

    parent: TreeNode | None
    tokens: list[int]
    blocks: list[int]
    last_used: int
    # first block's token ids -> child
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)


class RadixCache:
    """``root``: the empty run; ``node_of[b]``: the node holding cached block ``b``; ``free_queue``: cached
    blocks nobody holds (SGLang's unlocked nodes: a table holding a block is its lock); ``leaves``: a heap of
    eviction candidates ``(last use, leaf)``, stale once the leaf is used again, grows or loses its blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = as_int("block_size", block_size, minimum=1)
        self.root = TreeNode(None, [], [], 0)
        self.node_of: dict[int, TreeNode] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict()
        # (last use, id: ties never compare nodes, leaf)
        self.leaves: list[tuple[int, int, TreeNode]] = []
        # ticks at every lookup and release: a node's age is the tick it was last used
        self.clock = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], TreeNode, int]:
        """Walk down from the root along ``token_ids``, at most ``len(token_ids) - 1`` tokens (the last one
        is computed for its logits). Returns the blocks found, the node the walk ended in and how many of
        that node's blocks matched. Changes nothing."""
        block_size = self.block_size
        ids = list(token_ids[:(len(token_ids) - 1) // block_size * block_size])
        node = self.root
        matched = 0  # blocks of ``node`` matched so far
        found: list[int] = []
        for at in range(0, len(ids), block_size):
            page = ids[at:at + block_size]
            if matched == len(node.blocks):  # the end of this node's run: a child may go on
                child = node.children.get(tuple(page))
                if child is None:
                    break
                node = child
                matched = 0
            elif node.tokens[matched * block_size:(matched + 1) * block_size] != page:
                break
            found.append(node.blocks[matched])
            matched += 1
        return found, node, matched

    def peek(self, token_ids: Sequence[int], keys: object = None) -> list[int]:
        """The cached blocks holding the longest run of full leading blocks of ``token_ids`` (``keys``, the
        hash cache's block keys, go unused: the tree walks token ids)."""
        return self.match_prefix(token_ids)[0]

    def lookup(self, token_ids: Sequence[int], keys: object = None) -> list[int]:
        """``peek``, counted in the statistics; the path it took becomes the most recently used (a partly
        matched node is split first, so its unmatched tail keeps its age)."""
        found, node, matched = self.match_prefix(token_ids)
        if matched < len(node.blocks):
            node = self._split(node, matched)
        self.clock += 1
        while node is not self.root:
            node.last_used = self.clock
            node = node.parent
        self.queried_tokens += len(token_ids)
        self.hit_tokens += len(found) * self.block_size
        return found

    def partial_match(self, token_ids: Sequence[int], found: list[int],
                      unwritten: Collection[int] = ()) -> tuple[int, int]:
        """The cached block whose first tokens continue ``found`` (the blocks ``lookup`` gave for
        ``token_ids``) furthest, and how many: a copy of it saves computing them. ``(-1, 0)`` if none. A
        block in ``unwritten`` (registered in this step, its K/V not yet computed) is never a source."""
        block_size = self.block_size
        at = len(found) * block_size
        want = list(token_ids[at:min(at + block_size, len(token_ids) - 1)])
        node = self.root
        index = 0  # where the next block sits in ``node``
        if found:
            node = self.node_of[found[-1]]
            index = node.blocks.index(found[-1]) + 1
        # the run goes on inside this node: one candidate; else each child's first block
        candidates = [(node, index)]
        if index == len(node.blocks):
            candidates = [(child, 0) for child in node.children.values()]
        # (tokens, block): the most tokens win; of equals, the highest block id; (0, -1) if none shares any
        scores = [(0, -1)]
        for owner, position in candidates:
            page = owner.tokens[position * block_size:(position + 1) * block_size]
            same = 0
            while same < len(want) and page[same] == want[same]:
                same += 1
            if same > 0 and owner.blocks[position] not in unwritten:
                scores.append((same, owner.blocks[position]))
        tokens, block = max(scores)
        return block, tokens

    def insert(self, block: int, parent: int | None, tokens: Sequence[int]) -> int:
        """``block`` just became full with ``tokens`` after block ``parent``: it extends its parent's run when
        that run ends a leaf, else starts a new child. Returns the block the tree holds for this content:
        ``block``, or the block that holds it already (computed twice at once: the caller then holds that
        one and frees its duplicate, as SGLang's insert does). A block whose parent is not in the tree stays
        out of it."""
        checks.page(tokens, self.block_size)
        node = self.root
        if parent is not None:
            node = self.node_of.get(parent)
        if node is None:
            return block
        # where the new block goes in ``node``: usually a sequence grows its own leaf
        at = len(node.blocks)
        if parent is not None and node.blocks[-1] != parent:
            at = node.blocks.index(parent) + 1
        page = tuple(tokens)
        if at < len(node.blocks):  # the parent ends mid-run: the run's next block or a branch
            if tuple(node.tokens[at * self.block_size:(at + 1) * self.block_size]) == page:
                return node.blocks[at]
            node = self._split(node, at)
        elif page in node.children:
            return node.children[page].blocks[0]
        if node is not self.root and not node.children:
            node.tokens += page
            node.blocks.append(block)
        else:
            child = TreeNode(node, list(page), [block], self.clock)
            node.children[page] = child
            node = child
        self.node_of[block] = node
        return block

    register = insert  # the name the BlockManager calls (PrefixCache.register)

    def _split(self, node: TreeNode, count: int) -> TreeNode:
        """Cut ``node`` after its first ``count`` blocks: a new parent holds them, ``node`` keeps the rest
        (and its children, age and heap entries). Returns the new parent."""
        block_size = self.block_size
        cut = count * block_size
        top = TreeNode(node.parent, node.tokens[:cut], node.blocks[:count], node.last_used)
        node.parent.children[tuple(node.tokens[:block_size])] = top  # type: ignore[union-attr]
        top.children[tuple(node.tokens[cut:cut + block_size])] = node
        node.parent = top
        node.tokens = node.tokens[cut:]
        node.blocks = node.blocks[count:]
        for block in top.blocks:
            self.node_of[block] = top
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
        self._offer_leaf(node)
        return True

    def forget(self, block: int) -> None:
        """``block``'s content is gone (a write into it was rolled back): it leaves the tree with every block
        after it (registered by the same rolled-back call)."""
        node = self.node_of.get(block)
        if node is None:
            return
        at = node.blocks.index(block)
        gone = node.blocks[at:]
        todo = list(node.children.values())
        del node.blocks[at:]
        del node.tokens[at * self.block_size:]
        node.children = {}
        while todo:
            below = todo.pop()
            gone += below.blocks
            todo += below.children.values()
        for block in gone:
            del self.node_of[block]
        if not node.blocks:
            self._remove_leaf(node)

    def evict(self) -> int:
        """Take the last block of the least recently used leaf nobody holds for new content."""
        while self.leaves:
            used, _, node = heapq.heappop(self.leaves)
            if used != node.last_used or node.children or not node.blocks:
                continue  # stale: used again since, grown a child, or emptied
            block = node.blocks[-1]
            if self.node_of.get(block) is not node or block not in self.free_queue:
                continue  # stale: detached, or its last block is held again
            node.blocks.pop()
            del node.tokens[-self.block_size:]
            del self.node_of[block]
            del self.free_queue[block]
            if node.blocks:
                self._offer_leaf(node)  # its new last block may go next
            else:
                self._remove_leaf(node)
            self.evicted_blocks += 1
            return block
        raise RuntimeError("no leaf of the radix tree is free to evict: "
                           "running requests hold them all")

    def _remove_leaf(self, node: TreeNode) -> None:
        """Detach an emptied ``node``; its parent may become a leaf to evict."""
        parent = node.parent  # never None: the root holds no block, so it is never emptied
        siblings = parent.children.items()
        parent.children = {key: child for key, child in siblings if child is not node}
        self._offer_leaf(parent)

    def _offer_leaf(self, node: TreeNode) -> None:
        """A leaf whose last block nobody holds joins the heap of eviction candidates (an entry that goes
        stale is skipped by ``evict``)."""
        if node is not self.root and not node.children and node.blocks[-1] in self.free_queue:
            heapq.heappush(self.leaves, (node.last_used, id(node), node))

    stats = figures.prefix_cache_stats  # the lookup counters, hit rate, blocks a lookup finds, nodes
