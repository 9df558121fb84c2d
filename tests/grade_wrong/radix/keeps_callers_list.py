"""Catches: the tree stays compressed, the very tree pagedlib's RadixCache builds (block size 1)

Keeps the list insert is given as a new edge, not a copy of it: the caller changing its list changes the
tree, and a leaf that grows with += extends the caller's list."""

from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    edge: list = field(default_factory=list)
    children: dict = field(default_factory=dict)


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixTree:
    def __init__(self):
        self.root = Node()

    def insert(self, tokens):
        node, rest = self.root, tokens
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                if node is not self.root and not node.children:
                    node.edge += rest
                else:
                    node.children[rest[0]] = Node(rest)
                return
            n = common(child.edge, rest)
            if n == len(rest):
                return
            if n < len(child.edge):
                top = Node(child.edge[:n], {child.edge[n]: child})
                child.edge = child.edge[n:]
                node.children[rest[0]] = child = top
            node, rest = child, rest[n:]

    def match(self, tokens):
        node, rest, matched = self.root, tokens, 0
        while rest and rest[0] in node.children:
            node = node.children[rest[0]]
            n = common(node.edge, rest)
            matched += n
            if n < len(node.edge):
                break
            rest = rest[n:]
        return matched
