"""Task ``radix`` (notebook 11): a radix tree over token ids, one token per page (block size 1, SGLang's
default): ``match``, and ``insert`` with the split of an edge where a new sequence parts from it.

A tree is compared as ``drawn`` draws it: ``{edge: {child's edge: {...}}}`` from the root's children down
(a child's place among its siblings does not matter). The oracles: a brute-force longest common prefix
for ``match``; for the structure, pagedlib's ``RadixCache(block_size=1)`` fed the same sequences token by
token, and ``compressed``, the compressed tree of every prefix of the sequences built from scratch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedlib.core.radix_cache import RadixCache
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal

TOKENS = st.lists(st.integers(0, 3), max_size=10)           # 4 token ids: sequences share prefixes often
SEQUENCES = st.lists(TOKENS, max_size=8)


def drawn(node, depth: int = 0) -> dict:
    """The reader's tree below ``node`` as nested dicts keyed by edge (a tuple of token ids)."""
    if depth > 200:
        raise Failed("the tree is deeper than 200 nodes: does a node reach itself?")
    return {tuple(child.edge): drawn(child, depth + 1) for child in node.children.values()}


def problem(node, inside: bool = False) -> str | None:
    """The first place where the tree below ``node`` is not a compressed tree keyed by first tokens."""
    if inside and len(node.children) == 1:
        return f"the node with edge {list(node.edge)} has exactly one child: it should be one edge"
    for key, child in node.children.items():
        if len(child.edge) == 0 or key != child.edge[0]:
            return f"a child with edge {list(child.edge)} is keyed {key!r}, not by its first token"
        found = problem(child, inside=True)
        if found:
            return found
    return None


def compressed(sequences: list[list[int]]) -> dict:
    """The compressed tree of every prefix of ``sequences``, drawn as ``drawn`` draws one (brute force)."""
    tree = {}
    for first in sorted({s[0] for s in sequences if s}):
        group = [s for s in sequences if s and s[0] == first]
        n = 1                                     # the edge runs on while every longer sequence agrees
        while len({s[n] for s in group if len(s) > n}) == 1:
            n += 1
        longest = max(group, key=len)
        tree[tuple(longest[:n])] = compressed([s[n:] for s in group])
    return tree


def pagedlib_tree(sequences: list[list[int]]) -> dict:
    """What pagedlib's ``RadixCache`` with one token per block builds from ``sequences``, drawn."""
    cache, blocks = RadixCache(block_size=1), 0
    for tokens in sequences:
        parent = None
        for token in tokens:
            parent = cache.insert(blocks, parent, [token])
            blocks += parent == blocks
    return drawn_cache(cache.root)


def drawn_cache(node) -> dict:
    return {tuple(child.tokens): drawn_cache(child) for child in node.children.values()}


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def built(impl, sequences: list[list[int]]):
    tree = impl.RadixTree()
    for tokens in sequences:
        tree.insert(list(tokens))
    return tree


def match_is_longest_prefix(impl) -> None:
    @cases(150)
    @given(sequences=SEQUENCES, queries=st.lists(TOKENS, min_size=1, max_size=4))
    def prop(sequences, queries):
        tree = built(impl, sequences)
        before = drawn(tree.root)
        extended = [s + q for s, q in zip(sequences, queries)]          # past an inserted sequence's end
        for query in [*queries, *sequences, *extended]:
            case = dict(inserted=sequences, query=query)
            expected = max((common(query, s) for s in sequences), default=0)
            expect_equal("match: tokens of the longest common prefix with an inserted sequence", expected,
                         tree.match(list(query)), case)
            expect_equal("the tree after match (match changes nothing)", before, drawn(tree.root), case)
    prop()


def split_keeps_tail(impl) -> None:
    tree = built(impl, [[1, 2, 3, 4], [1, 2, 9]])
    expect_equal("the tree (each edge with the edges below it)", {(1, 2): {(3, 4): {}, (9,): {}}},
                 drawn(tree.root), dict(inserted=[[1, 2, 3, 4], [1, 2, 9]]))

    @cases(200)
    @given(edge=st.lists(st.integers(0, 3), min_size=2, max_size=10), at=st.integers(0, 99),
           below=st.integers(0, 99), tail=st.lists(st.integers(0, 7), max_size=3), branch=st.booleans())
    def prop(edge, at, below, tail, branch):
        at = 1 + at % (len(edge) - 1)                   # where the new sequence parts from the edge
        sequences = [edge]
        if branch and at + 1 < len(edge):              # the edge's node has children: they must stay below
            cut = at + 1 + below % (len(edge) - at - 1)
            sequences.append(edge[:cut] + [edge[cut] + 4])
        sequences.append(edge[:at] + [edge[at] + 4] + tail)
        expect_equal("the tree (each edge with the edges below it)", compressed(sequences),
                     drawn(built(impl, sequences).root), dict(inserted=sequences))
    prop()


def compressed_as_pagedlib(impl) -> None:
    @cases(150)
    @given(sequences=SEQUENCES)
    def prop(sequences):
        tree, given = impl.RadixTree(), []
        for count, tokens in enumerate(sequences, start=1):
            given.append(list(tokens))
            tree.insert(given[-1])
            case = dict(inserted=sequences[:count])
            expect_equal("the lists given to insert, after it (insert leaves them as they were)",
                         sequences[:count], given, case)
            found = problem(tree.root)
            if found:
                raise Failed(f"the tree is not compressed: {found}", case=case,
                             expected="every node but the root with no child or two or more",
                             got=drawn(tree.root))
            expect_equal("the tree, against pagedlib's RadixCache on the same sequences",
                         pagedlib_tree(sequences[:count]), drawn(tree.root), case)
        for tokens in given:            # the caller's lists are theirs: the tree holds copies of its tokens
            tokens[:] = [9] * len(tokens)
        expect_equal("the tree once the lists given to insert are changed (the tree keeps its own copies)",
                     pagedlib_tree(sequences), drawn(tree.root), dict(inserted=sequences))
    prop()


def insert_again_changes_nothing(impl) -> None:
    @cases(100)
    @given(sequences=st.lists(TOKENS, min_size=1, max_size=8), picks=st.lists(st.tuples(
        st.integers(0, 7), st.integers(0, 10)), min_size=1, max_size=4))
    def prop(sequences, picks):
        tree = built(impl, sequences)
        before = drawn(tree.root)
        for pick, length in picks:
            again = sequences[pick % len(sequences)][:length]    # a sequence inserted, or a prefix of one
            tree.insert(list(again))
            expect_equal(f"the tree after inserting {again} again", before, drawn(tree.root),
                         dict(inserted=sequences, again=again))
    prop()


TASK = Task("radix", "11", "radix.py", "A radix tree over token ids: match, and insert with a split", (
    Check("match counts the longest common prefix with any inserted sequence, and changes nothing",
          match_is_longest_prefix,
          "notebook 11, section 2 (The lookup code, side by side): match_prefix"),
    Check("inserting [1, 2, 9] after [1, 2, 3, 4] splits the edge [1, 2, 3, 4] into [1, 2] and [3, 4]",
          split_keeps_tail,
          "notebook 11, section 2 (The lookup code, side by side): insert, which splits a node"),
    Check("the tree stays compressed, the very tree pagedlib's RadixCache builds (block size 1)",
          compressed_as_pagedlib,
          "notebook 11, section 2 (The lookup code, side by side): insert grows a leaf or adds a child"),
    Check("inserting a sequence the tree holds, or a prefix of one, changes nothing",
          insert_again_changes_nothing,
          "notebook 11, section 2 (The lookup code, side by side): insert"),
))
