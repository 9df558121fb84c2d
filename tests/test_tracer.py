"""The block-table tracer widget, driven through its own buttons: the real cache's state and the rendered
HTML (owners, free stack, tables, lookup path, decode reads, error messages) must agree."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
import torch

from pagedlib.cache import OutOfBlocksError, PagedKVCache
from pagedlib.tracer import SCENARIO, BlockTableTracer, TracerError, render_html


class _Node:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs = tag, attrs
        self.children: list[_Node | str] = []  # elements and text, in document order

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all_text(self) -> str:
        return "".join(c if isinstance(c, str) else c.all_text() for c in self.children)

    def iter(self):
        yield self
        for c in self.children:
            if isinstance(c, _Node):
                yield from c.iter()


class _Tree(HTMLParser):
    """A minimal DOM: enough to select elements by attribute and read their text."""

    VOID = {"br", "img", "hr", "meta", "input"}

    def __init__(self, html: str) -> None:
        super().__init__()
        self.root = _Node("root", {})
        self.stack = [self.root]
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        assert self.stack[-1].tag == tag, f"unbalanced </{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        if self.stack[-1].tag != "style":
            self.stack[-1].children.append(data)

    def find(self, attr: str, value: str | None = None) -> list[_Node]:
        return [n for n in self.root.iter() if attr in n.attrs and (value is None or n.attrs[attr] == value)]

    def one(self, attr: str, value: str | None = None) -> _Node:
        found = self.find(attr, value)
        assert len(found) == 1, f"expected one element with {attr}={value!r}, found {len(found)}"
        return found[0]


def view(tracer: BlockTableTracer) -> _Tree:
    return _Tree(tracer.html())


def owners(tree: _Tree) -> dict[int, str]:
    return {int(n.attrs["data-block"]): n.attrs["data-owner"] for n in tree.find("data-block")}


def slot_labels(tree: _Tree, block: int) -> list[str]:
    return [s.all_text() for s in tree.one("data-block", str(block)).iter() if "data-slot" in s.attrs]


def free_stack_shown(tree: _Tree) -> list[int]:
    stack = tree.one("data-role", "free-stack")
    return [int(n.attrs["data-free"]) for n in stack.iter() if "data-free" in n.attrs]


def table_shown(tree: _Tree, seq: int) -> list[int]:
    row = tree.one("data-seq", str(seq))
    return [int(n.all_text()) for n in row.iter() if "data-entry" in n.attrs]


def snapshot(cache: PagedKVCache) -> tuple:
    return (list(cache.free), {s: list(t) for s, t in cache.tables.items()}, dict(cache.seq_lens),
            cache.k.clone(), cache.v.clone())


def assert_same_state(before: tuple, cache: PagedKVCache) -> None:
    after = snapshot(cache)
    assert before[:3] == after[:3]
    torch.testing.assert_close(before[3], after[3], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(before[4], after[4], rtol=0, atol=0, equal_nan=True)


def assert_view_matches_cache(tracer: BlockTableTracer) -> None:
    """Everything the picture claims, checked against the cache it draws."""
    cache, tree = tracer.cache, view(tracer)
    cache.check_invariants()
    expected_owner = {b: "free" if o is None else str(o) for b, o in enumerate(cache.block_owners())}
    assert owners(tree) == expected_owner
    assert free_stack_shown(tree) == cache.free[::-1]  # top first
    for s, table in cache.tables.items():
        assert table_shown(tree, s) == table
        assert tree.one("data-seq", str(s)).attrs["data-len"] == str(cache.seq_lens[s])
        for pos in range(cache.seq_lens[s]):
            block, offset = cache.slot(s, pos)
            assert slot_labels(tree, block)[offset] == f"s{s}:t{pos}"


def test_default_pool_is_small_and_starts_free():
    tracer = BlockTableTracer()
    cache, tree = tracer.cache, view(tracer)
    assert (cache.num_blocks, cache.block_size, cache.num_layers) == (12, 4, 1)
    assert set(owners(tree).values()) == {"free"} and len(owners(tree)) == 12
    assert all(len(slot_labels(tree, b)) == 4 for b in range(12))
    top = tree.one("data-role", "free-stack").iter()
    assert next(n for n in top if "is-top" in n.classes).attrs["data-free"] == str(cache.free[-1])
    assert tracer.selected is None


def test_append_button_crosses_a_block_boundary_like_the_article():
    tracer = BlockTableTracer.article_trace()
    cache = tracer.cache
    assert cache.tables == {0: [5, 2]} and cache.seq_lens == {0: 7}
    assert free_stack_shown(view(tracer))[0] == 9, "block 9 is on top of the free stack"

    tracer.append_button.click()  # position 7: still room in block 2
    assert cache.tables[0] == [5, 2] and cache.seq_lens[0] == 8
    assert owners(view(tracer))[9] == "free"
    assert "7 % 4 == 3" in view(tracer).one("data-role", "log").all_text()
    assert_view_matches_cache(tracer)

    tracer.append_button.click()  # position 8: 8 % 4 == 0, a new block comes off the stack
    tree = view(tracer)
    assert cache.tables[0] == [5, 2, 9] and cache.seq_lens[0] == 9
    assert owners(tree)[9] == "0"
    assert 9 not in free_stack_shown(tree)
    assert table_shown(tree, 0) == [5, 2, 9]
    assert slot_labels(tree, 9)[0] == "s0:t8"
    log = tree.one("data-role", "log").all_text()
    assert "8 % 4 == 0" in log and "block 9 was popped" in log and "[5, 2, 9]" in log
    # the cache is real: token 8's K and V (written as its position) sit at block 9, offset 0
    assert cache.k[9, :, 0].eq(8).all() and cache.v[9, :, 0].eq(8).all()
    assert_view_matches_cache(tracer)


def test_lookup_highlights_the_path_with_its_arithmetic():
    tracer = BlockTableTracer.article_trace()
    assert tracer.lookup(0, 6) == (1, 2, 2)
    tracer.position.value = 3  # the position box looks up in the selected sequence
    tree = view(tracer)
    hits = [n for n in tree.root.iter() if "is-lookup" in n.classes]
    slot = next(n for n in hits if "data-slot" in n.attrs)
    assert slot.attrs["data-slot"] == "3" and slot.all_text() == "s0:t3"
    assert {n.attrs.get("data-block") for n in hits if "data-block" in n.attrs} == {"5"}
    assert [n.attrs["data-entry"] for n in hits if "data-entry" in n.attrs] == ["0"]
    text = " ".join(tree.one("data-role", "lookup").all_text().split())
    assert "3 // 4 = 0" in text and "3 % 4 = 3" in text and "physical block 5" in text

    tracer.position.value = 6
    tracer.lookup_button.click()
    text = " ".join(view(tracer).one("data-role", "lookup").all_text().split())
    assert "6 // 4 = 1" in text and "table[1] = physical block 2" in text and "6 % 4 = 2" in text


def test_decode_read_order_follows_the_table():
    tracer = BlockTableTracer(free_order=[7, 3, 10])
    s = tracer.add_sequence()
    tracer.n_tokens.value = 10
    tracer.append_n_button.click()
    reads = [n.all_text() for n in view(tracer).root.iter() if "data-read" in n.attrs]
    assert reads == [f"{b}.{o}" for b, o in (tracer.cache.slot(s, p) for p in range(10))]
    assert reads[:5] == ["7.0", "7.1", "7.2", "7.3", "3.0"]


def test_buttons_drive_the_whole_lifecycle():
    tracer = BlockTableTracer()
    cache = tracer.cache
    tracer.add_button.click()
    tracer.n_tokens.value = 6
    tracer.append_n_button.click()
    assert cache.seq_lens == {0: 6} and len(cache.tables[0]) == 2
    tracer.add_button.click()
    assert tracer.selected == 1, "a new sequence becomes the selected one"
    tracer.append_button.click()
    assert cache.seq_lens == {0: 6, 1: 1}
    assert_view_matches_cache(tracer)

    tracer.seq_picker.value = 0  # choose seq 0 in the dropdown: the buttons now act on it
    assert tracer.selected == 0
    freed = list(cache.tables[0])
    tracer.free_button.click()
    assert 0 not in cache.tables and cache.free[-len(freed):] == freed[::-1]
    tree = view(tracer)
    assert all(owners(tree)[b] == "free" for b in freed)
    assert free_stack_shown(tree)[: len(freed)] == freed, "freed blocks are on top, first block first"
    assert list(tracer.seq_picker.options) == [("seq 1", 1)]
    assert_view_matches_cache(tracer)

    tracer.append(1, 1)  # the freed blocks are the next ones handed out
    tracer.append(1, 3)
    assert cache.tables[1][1] == freed[0]

    tracer.reset_button.click()
    assert tracer.cache.tables == {} and tracer.cache.num_free_blocks == 12 and tracer.selected is None
    assert set(owners(view(tracer)).values()) == {"free"}


def test_an_action_selects_its_sequence():
    tracer = BlockTableTracer()
    a, b = tracer.add_sequence(), tracer.add_sequence()
    tracer.append(a, 2)
    assert tracer.selected == a and tracer.seq_picker.value == a
    tracer.select(b)
    assert tracer.selected == b
    tracer.append_button.click()
    assert tracer.cache.seq_lens == {a: 2, b: 1}


def test_errors_show_in_the_widget_and_change_nothing(capsys):
    tracer = BlockTableTracer()
    before = snapshot(tracer.cache)
    tracer.append_button.click()  # nothing selected yet
    assert "No sequence selected" in view(tracer).one("data-role", "error").all_text()
    assert_same_state(before, tracer.cache)

    small = BlockTableTracer(num_blocks=2, block_size=4)
    small.add_button.click()
    small.n_tokens.value = 6
    small.append_n_button.click()
    before = snapshot(small.cache)
    html_before = view(small).one("data-role", "free-stack").all_text()
    small.n_tokens.value = 3  # 6 + 3 tokens need a third block
    small.append_n_button.click()
    error = view(small).one("data-role", "error").all_text()
    assert "out of kv blocks" in error.lower() and "1 needed, 0 free" in error and "Nothing changed" in error
    assert_same_state(before, small.cache)
    assert view(small).one("data-role", "free-stack").all_text() == html_before
    small.append_button.click()  # token 6 fits in the second block, so this still works ...
    small.append_button.click()  # ... and token 7
    small.append_button.click()  # token 8 needs a block
    assert "1 needed, 0 free" in view(small).one("data-role", "error").all_text()
    assert small.cache.seq_lens[0] == 8

    lookup_before = view(small).one("data-role", "lookup").all_text()
    small.position.value = 20
    error = view(small).one("data-role", "error").all_text()
    assert "position 20 is out of range" in error.lower() and "0..7" in error
    assert view(small).one("data-role", "lookup").all_text() == lookup_before

    small.reset_button.click()  # a successful action clears the message
    assert not view(small).find("data-role", "error")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "", "errors must not print tracebacks"


def test_methods_raise_after_showing_the_error():
    tracer = BlockTableTracer(num_blocks=1)
    with pytest.raises(TracerError, match="no sequence selected"):
        tracer.append()
    s = tracer.add_sequence()
    with pytest.raises(OutOfBlocksError):
        tracer.append(s, 5)
    assert "out of kv blocks" in view(tracer).one("data-role", "error").all_text().lower()
    assert tracer.cache.seq_lens[s] == 0 and tracer.cache.num_free_blocks == 1
    with pytest.raises(TracerError, match="out of range"):
        tracer.lookup(s, 0)
    with pytest.raises(KeyError):
        tracer.free(99)
    with pytest.raises(TracerError, match="N must be"):
        tracer.append(s, 0)


def test_play_runs_the_scenario_and_reuses_freed_blocks():
    tracer = BlockTableTracer()
    freed: list[int] = []
    for step in range(1, len(SCENARIO) + 1):
        op, seq, _, _ = SCENARIO[step - 1]
        if op == "free":
            freed = list(tracer.cache.tables[seq])
        tracer.play.value = step  # what one tick of the Play widget does
        assert_view_matches_cache(tracer)
        assert f"Scenario step {step}/{len(SCENARIO)}" in view(tracer).one("data-role", "log").all_text()
    cache = tracer.cache
    assert freed and set(cache.tables) == {0, 2}, "seq 1 was freed, seq 2 arrived"
    assert cache.tables[2][: len(freed)] == freed, "seq 2 reuses seq 1's blocks, in the same order"
    final = snapshot(cache)

    jumped = BlockTableTracer()
    jumped.play.value = len(SCENARIO)  # dragging the slider to the end replays every step
    assert_same_state(final, jumped.cache)
    jumped.play.value = 0
    assert jumped.cache.tables == {} and jumped.cache.num_free_blocks == 12


def test_play_on_a_pool_too_small_shows_the_error_and_stops(capsys):
    tracer = BlockTableTracer(num_blocks=4)  # the script's 9th step needs a 5th block
    tracer.play.playing = True
    for step in range(1, 10):
        tracer.play.value = step
    error = view(tracer).one("data-role", "error").all_text()
    assert "1 needed, 0 free" in error and "Nothing changed" in error
    assert tracer.cache.seq_lens == {0: 8, 1: 7} and tracer.cache.num_free_blocks == 0
    assert not tracer.play.playing
    assert capsys.readouterr().err == ""


def test_html_is_deterministic():
    def build() -> str:
        t = BlockTableTracer.article_trace()
        t.append_button.click()
        t.add_sequence()
        return t.html()

    first, second = build(), build()
    assert first == second
    assert " id=" not in first
    cache = PagedKVCache(4, 1, 2, 1, 1)
    assert render_html(cache) == render_html(cache)


def test_forty_clicks_in_a_row_fill_blocks_in_order():
    """Speed is measured by ``python -m pagedlib.bench tracer``; here: repeated clicks stay correct."""
    tracer = BlockTableTracer()
    tracer.add_sequence()
    clicks = 40  # 40 tokens need 10 of the 12 blocks: every click stays a success
    for _ in range(clicks):
        tracer.append_button.click()
    assert tracer.cache.seq_lens[0] == clicks
    assert tracer.cache.tables[0] == list(range(10))
    assert tracer.cache.num_free_blocks == 2


def test_click_benchmark_runs_and_writes_json(tmp_path, capsys):
    import json

    from pagedlib.bench.__main__ import main

    out = tmp_path / "tracer.json"
    assert main(["tracer", "--repeats", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["control"] for r in rows] == ["append token", "look up position", "render the view to HTML"]
    assert all(r["median_ms"] > 0 for r in rows)
    assert "append token" in capsys.readouterr().out
