"""Build it yourself, notebook 11: a radix tree over token ids, its match and its insert (with a split).

Write the class below, then grade it:  python -m pagedlib.grade radix
(or, in a notebook: ``from pagedlib.grade import grade; grade("radix")``).

The tree of notebook 11, section 2, with one token per page (block size 1, SGLang's default): no blocks,
no K/V, no eviction, only the structure. Each ``Node`` has an ``edge``, the tuple of token ids on the way
into it (the root's is ``()``), and ``children``, a dict from the first token of each child's edge to the
child. The grader reads ``tree.root`` and walks it: keep these two attributes (``Node`` is given).

The tree holds every prefix of what was inserted and marks no ends, as pagedlib's ``RadixCache`` (a cache
only needs to know which prefixes it holds). So it stays compressed: every node but the root has no child
or two or more, and no edge is empty. Inserting ``[1, 2, 3, 4]`` after ``[1, 2]`` grows the leaf ``[1, 2]``
into ``[1, 2, 3, 4]``; inserting ``[1, 2, 9]`` then splits that edge into ``[1, 2]`` with two children,
``[3, 4]`` and ``[9]``; inserting ``[1, 2]`` again, or ``[1]``, changes nothing.

Checked, over generated sets of token sequences (hypothesis): ``match`` against a brute-force longest
common prefix, and leaving the tree as it was; the split of an edge a new sequence leaves in its middle,
the part below keeping its children; after every insert, the very tree pagedlib's ``RadixCache`` (block
size 1) builds from the same sequences, which is the compressed one; inserting what the tree holds changes
nothing.
"""

from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    edge: tuple[int, ...] = ()                                    # the token ids on the edge into this node
    children: dict[int, "Node"] = field(default_factory=dict)    # first token of a child's edge -> child


class RadixTree:
    """A radix tree of token-id sequences."""

    def __init__(self) -> None:
        """An empty tree: ``self.root = Node()``."""
        raise NotImplementedError

    def insert(self, tokens: list[int]) -> None:
        """Make ``tokens`` (and so every prefix of it) a path from the root. Walk down while the tokens follow
        the edges; where they part from an edge in its middle, split it (a new node holds the edge's first
        part, the old node keeps the rest and its children below it); what is left of ``tokens`` then
        either grows a leaf (a node with no child, not the root) or becomes a new child. ``tokens`` stays the
        caller's: leave the list as it was, and keep copies of its tokens (the caller may change it later)."""
        raise NotImplementedError

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens of ``tokens`` the tree holds: the longest common prefix of ``tokens`` with
        any inserted sequence, counting the tokens matched inside the last edge reached (a partial edge
        counts its matching tokens). Changes nothing."""
        raise NotImplementedError
