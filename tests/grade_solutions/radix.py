from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    edge: tuple[int, ...] = ()
    children: dict[int, "Node"] = field(default_factory=dict)


def common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixTree:
    def __init__(self):
        self.root = Node()

    def insert(self, tokens):
        node, rest = self.root, tuple(tokens)
        while rest:
            child = node.children.get(rest[0])
            if child is None:
                if node is not self.root and not node.children:
                    node.edge += rest                       # a leaf grows
                else:
                    node.children[rest[0]] = Node(rest)
                return
            n = common(child.edge, rest)
            if n == len(rest):
                return                                      # the tree holds it already
            if n < len(child.edge):                         # it parts inside the edge: split it
                top = Node(child.edge[:n], {child.edge[n]: child})
                child.edge = child.edge[n:]
                node.children[rest[0]] = child = top
            node, rest = child, rest[n:]

    def match(self, tokens):
        node, rest, matched = self.root, tuple(tokens), 0
        while rest and rest[0] in node.children:
            node = node.children[rest[0]]
            n = common(node.edge, rest)
            matched += n
            if n < len(node.edge):
                break
            rest = rest[n:]
        return matched
