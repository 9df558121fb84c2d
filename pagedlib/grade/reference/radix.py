"""pagedlib's answer to task ``radix``: ``core.radix_cache.RadixCache`` with one token per block behind the
task's signatures (each token is its own block, numbered as it joins the tree); ``root`` is a ``Node``
picture of the cache's tree, drawn when read."""

from dataclasses import dataclass, field

from pagedlib.core.radix_cache import RadixCache


@dataclass(eq=False)
class Node:
    edge: tuple[int, ...] = ()
    children: dict[int, "Node"] = field(default_factory=dict)


class RadixTree:
    def __init__(self):
        self.cache = RadixCache(block_size=1)
        self.blocks = 0

    def insert(self, tokens):
        parent = None
        for token in tokens:
            block = self.cache.insert(self.blocks, parent, [token])
            self.blocks += block == self.blocks       # a new block joined the tree
            parent = block

    def match(self, tokens):
        found, _, _ = self.cache.match_prefix([*tokens, 0])   # + a token: the cache never matches the last
        return len(found)

    @property
    def root(self):
        return picture(self.cache.root)


def picture(node):
    return Node(tuple(node.tokens), {key[0]: picture(child) for key, child in node.children.items()})
