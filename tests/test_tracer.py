"""The block-table tracer widget, driven through its own buttons: the real cache's state and the rendered
HTML (holders, free stack, tables, lookup path, decode reads, error messages) must agree, and a failed
action must change nothing."""

from __future__ import annotations

from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from helpers import assert_unchanged, snapshot
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.teach.colors import CACHED_COLOR, FREE_COLOR
from pagedlib.teach.tracer import SCENARIO, BlockTableTracer
from pagedlib.teach.tracer_view import MAX_SEQUENCES, MAX_SLOTS, _block_card, render_html
from pagedlib.testing import block_holders, check_invariants


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

    def __init__(self, html: str) -> None:
        super().__init__()
        self.root = _Node("root", {})
        self.stack = [self.root]
        self.feed(html)
        self.close()
        assert self.stack == [self.root], "unclosed elements"

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        self.stack.append(node)

    def handle_endtag(self, tag):
        assert self.stack[-1].tag == tag, f"unbalanced </{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)

    def find(self, attr: str, value: str | None = None) -> list[_Node]:
        return [n for n in self.root.iter() if attr in n.attrs and (value is None or n.attrs[attr] == value)]

    def one(self, attr: str, value: str | None = None) -> _Node:
        found = self.find(attr, value)
        assert len(found) == 1, f"expected one element with {attr}={value!r}, found {len(found)}"
        return found[0]


def view(tracer: BlockTableTracer) -> _Tree:
    return _Tree(tracer.html())


def holders(tree: _Tree) -> dict[int, str]:
    return {int(n.attrs["data-block"]): n.attrs["data-holders"] for n in tree.find("data-block")}


def slot_labels(tree: _Tree, block: int) -> list[str]:
    return [s.all_text() for s in tree.one("data-block", str(block)).iter() if "data-slot" in s.attrs]


def free_stack_shown(tree: _Tree) -> list[int]:
    stack = tree.one("data-role", "free-stack")
    return [int(n.attrs["data-free"]) for n in stack.iter() if "data-free" in n.attrs]


def table_shown(tree: _Tree, seq: int) -> list[int]:
    row = tree.one("data-seq", str(seq))
    return [int(n.all_text()) for n in row.iter() if "data-entry" in n.attrs]


def error_shown(tracer: BlockTableTracer) -> str:
    return view(tracer).one("data-role", "error").all_text()


def shown_state(tracer: BlockTableTracer) -> tuple:
    """What the reader sees apart from the error line: the view without it, the selection, the controls."""
    html = tracer.html()
    start = html.find("<div class='pt-error'")
    if start >= 0:
        html = html[:start] + html[html.index("</div>", start) + len("</div>"):]
    picker = tracer.seq_picker
    return html, tracer.selected, list(picker.options), picker.value, tracer.position.value


def queue_shown(tree: _Tree) -> list[int]:
    queue = tree.one("data-role", "cached-queue")
    return [int(n.attrs["data-queued"]) for n in queue.iter() if "data-queued" in n.attrs]


def card(tree: _Tree, block: int) -> _Node:
    return tree.one("data-block", str(block))


def assert_view_matches_cache(tracer: BlockTableTracer) -> None:
    """Everything the picture claims, checked against the cache it draws, and every sequence reads back
    its own positions (token ``p`` is written as ``k = v = p``, shared or not)."""
    cache, tree = tracer.cache, view(tracer)
    check_invariants(cache)
    assert holders(tree) == {b: " ".join(map(str, hs)) for b, hs in enumerate(block_holders(cache))}
    assert free_stack_shown(tree) == cache.free[::-1]  # top first
    queue = list(cache.prefix_cache.free_queue) if cache.prefix_cache is not None else []
    if cache.prefix_cache is not None:
        assert queue_shown(tree) == queue
    for b in range(cache.num_blocks):
        node = card(tree, b)
        assert node.attrs["data-refs"] == str(cache.ref_count(b))
        assert ("is-shared" in node.classes) == (cache.ref_count(b) > 1)
        assert ("is-cached" in node.classes) == (b in queue)
    assert tree.one("data-role", "counts").attrs["data-copies"] == str(cache.cow_copies)
    for s, table in cache.tables.items():
        assert table_shown(tree, s) == table
        assert tree.one("data-seq", str(s)).attrs["data-len"] == str(cache.seq_lens[s])
        for pos in range(cache.seq_lens[s]):
            block, offset = cache.slot(s, pos)
            label = f"s{s}:t{pos}" if cache.ref_count(block) == 1 else f"t{pos}"
            assert slot_labels(tree, block)[offset] == label
        k, v = cache.gather(s)  # [1, len, 1, 2]
        positions = torch.arange(cache.seq_lens[s], dtype=k.dtype)
        assert torch.equal(k[0, :, 0, 0], positions) and torch.equal(v[0, :, 0, 1], positions)


def test_a_fresh_pool_shows_every_block_free_with_the_stack_top_marked():
    tracer = BlockTableTracer(num_blocks=5, block_size=3, free_order=[4])
    tree = view(tracer)
    assert holders(tree) == {b: "" for b in range(5)}
    runs = [n for n in tree.root.iter() if "pt-run" in n.classes]  # empty free blocks collapse into one run
    assert len(runs) == 1 and " ".join(runs[0].all_text().split()) == "free, empty blocks: 0 1 2 3 4"
    top = [n for n in tree.one("data-role", "free-stack").iter() if "is-top" in n.classes]
    assert [n.attrs["data-free"] for n in top] == ["4"]
    assert tracer.selected is None and list(tracer.seq_picker.options) == []


def test_append_button_crosses_a_block_boundary_like_the_article():
    tracer = BlockTableTracer.article_trace()
    cache = tracer.cache
    assert cache.tables == {0: [5, 2]} and cache.seq_lens == {0: 7}
    assert free_stack_shown(view(tracer))[0] == 9, "block 9 is on top of the free stack"

    tracer.append_button.click()  # position 7: still room in block 2
    assert cache.tables[0] == [5, 2] and cache.seq_lens[0] == 8
    assert holders(view(tracer))[9] == ""
    assert "7 % 4 == 3" in view(tracer).one("data-role", "log").all_text()
    assert_view_matches_cache(tracer)

    tracer.append_button.click()  # position 8: 8 % 4 == 0, a new block comes off the stack
    tree = view(tracer)
    assert cache.tables[0] == [5, 2, 9] and cache.seq_lens[0] == 9
    assert holders(tree)[9] == "0"
    assert 9 not in free_stack_shown(tree)
    assert table_shown(tree, 0) == [5, 2, 9]
    assert slot_labels(tree, 9)[0] == "s0:t8"
    log = tree.one("data-role", "log").all_text()
    assert "8 % 4 == 0; a new block: block 9 popped from the free stack" in log and "[5, 2, 9]" in log
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
    assert 0 not in cache.tables and cache.free[-len(freed):] == freed
    tree = view(tracer)
    assert all(holders(tree)[b] == "" for b in freed)
    assert free_stack_shown(tree)[: len(freed)] == freed[::-1], "freed: on top, last first"
    assert list(tracer.seq_picker.options) == [("seq 1", 1)]
    assert_view_matches_cache(tracer)

    tracer.append(1, 1)  # the freed blocks are the next ones handed out
    tracer.append(1, 3)
    assert cache.tables[1][1] == freed[-1]

    tracer.reset_button.click()
    assert tracer.cache.tables == {} and tracer.cache.num_free_blocks == 12 and tracer.selected is None
    assert set(holders(view(tracer)).values()) == {""}


def test_an_action_selects_its_sequence():
    tracer = BlockTableTracer()
    a, b = tracer.add_sequence(), tracer.add_sequence()
    tracer.append(a, 2)
    assert tracer.selected == a and tracer.seq_picker.value == a
    tracer.select(b)
    assert tracer.selected == b
    tracer.append_button.click()
    assert tracer.cache.seq_lens == {a: 2, b: 1}


def _cache_error(fn, *args) -> str:
    """The message the cache itself gives for a call (the tracer must show the cache's own error)."""
    with pytest.raises(Exception) as info:
        fn(*args)
    return str(info.value).rstrip(".")


def test_errors_show_in_the_widget_and_change_nothing(capsys):
    tracer = BlockTableTracer()
    before = snapshot(tracer.cache)
    tracer.append_button.click()  # nothing selected yet
    assert "no sequence selected" in error_shown(tracer)
    assert_unchanged(tracer.cache, before)

    small = BlockTableTracer(num_blocks=3, block_size=4)
    small.add_button.click()
    small.n_tokens.value = 6
    small.append_n_button.click()  # seq 0 holds two blocks ...
    small.append(small.add_sequence(), 1)  # ... and seq 1 the third
    small.seq_picker.value = 0
    before, shown = snapshot(small.cache), shown_state(small)
    small.n_tokens.value = 3  # 6 + 3 tokens need a third block
    small.append_n_button.click()
    k3 = torch.zeros(1, 3, 1, 2)
    error = error_shown(small)
    assert _cache_error(PagedKVCache.append_tokens, small.cache, 0, k3, k3) in error
    assert error.endswith("Nothing changed.")
    assert_unchanged(small.cache, before)
    assert shown_state(small) == shown
    small.append_button.click()  # token 6 fits in the second block, so this still works ...
    small.append_button.click()  # ... and token 7
    small.append_button.click()  # token 8 needs a block
    assert "1 needed, 0 free" in error_shown(small)
    assert small.cache.seq_lens[0] == 8

    shown = shown_state(small)[0]
    small.position.value = 20
    assert _cache_error(small.cache.slot, 0, 20) in error_shown(small)
    assert shown_state(small)[0] == shown and small.position.value == 7, "the box snaps back to the lookup"

    small.reset_button.click()  # a successful action clears the message
    assert not view(small).find("data-role", "error")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "", "errors must not print tracebacks"


def test_methods_raise_the_caches_own_errors_after_showing_them():
    tracer = BlockTableTracer(num_blocks=2)
    with pytest.raises(ValueError, match="no sequence selected"):
        tracer.append()
    tracer.append(tracer.add_sequence(), 4)
    s = tracer.add_sequence()
    with pytest.raises(OutOfBlocksError):
        tracer.append(s, 5)
    assert "out of kv blocks" in error_shown(tracer).lower()
    assert tracer.cache.seq_lens[s] == 0 and tracer.cache.num_free_blocks == 1
    with pytest.raises(IndexError):
        tracer.lookup(s, 0)
    with pytest.raises(KeyError) as info:
        tracer.free(99)
    assert _cache_error(tracer.cache.free_sequence, 99) in error_shown(tracer)
    assert str(info.value) == _cache_error(tracer.cache.free_sequence, 99)
    with pytest.raises(ValueError, match="n must be >= 1"):
        tracer.append(s, 0)


def test_a_huge_append_fails_before_any_kv_is_built(monkeypatch):
    """issue 11, item 4: ``append(seq, 10**9)`` used to build ~4 GB of K/V before the pool said no."""
    tracer = BlockTableTracer()
    s = tracer.add_sequence()
    tracer.append(s, 7)
    before, shown = snapshot(tracer.cache), shown_state(tracer)
    arange = torch.arange

    def small_arange(*args, **kwargs):
        out = arange(*args, **kwargs)
        assert out.numel() <= MAX_SLOTS, f"built a {out.numel()}-element tensor before checking n"
        return out

    monkeypatch.setattr(torch, "arange", small_arange)
    with pytest.raises(ValueError, match="n must be <= 48, got 1000000000"):  # 12 blocks x 4 slots
        tracer.append(s, 10**9)
    assert "n must be <= 48" in error_shown(tracer)
    assert_unchanged(tracer.cache, before)
    assert shown_state(tracer) == shown


def test_numpy_integers_work_and_bad_arguments_are_named():
    """issue 11, item 8: ``lookup(0, np.int64(1))`` said "out of range"; each error names its argument."""
    tracer = BlockTableTracer(np.int64(6), np.int32(4))
    s = tracer.add_sequence()
    tracer.append(np.int64(s), np.int32(6))
    assert tracer.lookup(np.int64(s), np.int64(5)) == (1, 1, 1)
    tracer.select(np.int64(s))
    assert type(tracer.selected) is int and tracer.seq_picker.value == s
    tracer.play_to(np.int64(0))
    s = tracer.add_sequence()
    for call, name in [(lambda: tracer.append(s, 2.0), "n"), (lambda: tracer.append(s, True), "n"),
                       (lambda: tracer.lookup(s, "1"), "pos"), (lambda: tracer.select(1.5), "seq_id"),
                       (lambda: tracer.free("0"), "seq_id"), (lambda: tracer.fork(2.5), "seq_id"),
                       (lambda: tracer.add_sequence(True), "prompt_len"),
                       (lambda: tracer.add_sequence(-1), "prompt_len"),
                       (lambda: BlockTableTracer(enable_prefix_caching=1), "enable_prefix_caching"),
                       (lambda: tracer.play_to(len(SCENARIO) + 1), "step"),
                       (lambda: BlockTableTracer(num_blocks=True), "num_blocks"),
                       (lambda: BlockTableTracer(block_size=0), "block_size")]:
        with pytest.raises(ValueError, match=rf"^{name} must be"):
            call()


def test_pools_too_big_to_draw_are_refused_and_the_largest_view_stays_small():
    """issue 11, item 9: a 20,000-block tracer re-rendered 27 MiB of HTML per click."""
    with pytest.raises(ValueError, match=r"num_blocks \* block_size must be <= 512.*20000 \* 4 = 80000"):
        BlockTableTracer(num_blocks=20_000)
    with pytest.raises(ValueError, match="at most 512 slots"):
        render_html(PagedKVCache(20_000, 1, 4, 1, 2))

    largest = BlockTableTracer(num_blocks=MAX_SLOTS // 4, block_size=4)  # every slot filled and selected
    s = largest.add_sequence()
    largest.append(s, MAX_SLOTS)
    largest.lookup(s, 0)
    assert len(largest.html()) < 512 * 1024

    many = BlockTableTracer()
    for _ in range(MAX_SEQUENCES):
        many.add_sequence()
    many.add_button.click()
    assert f"at most {MAX_SEQUENCES} sequences" in error_shown(many)
    with pytest.raises(ValueError, match=f"at most {MAX_SEQUENCES} sequences"):
        many.add_sequence()
    assert len(many.cache.tables) == MAX_SEQUENCES


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
    assert cache.tables[2][: len(freed)] == freed[::-1], "seq 2 reuses seq 1's blocks, the last one first"
    final = snapshot(cache)

    jumped = BlockTableTracer()
    jumped.add_sequence()  # a state off the script: Play replays from a fresh pool anyway
    jumped.play.value = len(SCENARIO)
    assert_unchanged(jumped.cache, final)
    jumped.play.value = 0
    assert jumped.cache.tables == {} and jumped.cache.num_free_blocks == 12


def test_play_on_a_pool_too_small_shows_the_error_and_stops(capsys):
    tracer = BlockTableTracer(num_blocks=4)  # the script's 9th step needs a 5th block
    tracer.play.playing = True
    for step in range(1, 10):
        tracer.play.value = step
    error = error_shown(tracer)
    assert "1 needed, 0 free" in error and "Nothing changed" in error
    assert tracer.cache.seq_lens == {0: 8, 1: 7} and tracer.cache.num_free_blocks == 0
    assert not tracer.play.playing
    assert capsys.readouterr().err == ""


def test_html_is_deterministic_and_styled_inline():
    def build() -> str:
        t = BlockTableTracer.article_trace()
        t.append_button.click()
        t.add_sequence()
        return t.html()

    first = build()
    assert first == build()
    assert " id=" not in first and "<style" not in first
    # every drawn element carries its look inline (untrusted notebooks keep only inline styles)
    parts = [n for n in _Tree(first).root.iter() if any(c.startswith("pt-") for c in n.classes)]
    assert len(parts) > 40 and all(n.attrs.get("style") for n in parts)


def test_a_shared_block_lists_its_holders_and_reference_count():
    """A block card takes all the sequences holding it: a shared one shows them and a ``×N`` badge."""
    block = _Tree(_block_card(3, [0, 2], ["t4", "t5", "", ""])).one("data-block", "3")
    assert block.attrs["data-holders"] == "0 2" and block.attrs["data-refs"] == "2"
    assert "is-shared" in block.classes and "border:4px double #111" in block.attrs["style"]
    assert "seq 0, 2 · 2 refs" in block.all_text()
    many = _Tree(_block_card(3, [0, 1, 2, 3, 4], ["t4"])).one("data-block", "3")
    assert "seq 0, 1, 2, +2 · 5 refs" in many.all_text()
    assert many.attrs["title"] == "held by seq 0, 1, 2, 3, 4"
    alone = _Tree(_block_card(3, [1], ["s1:t4"])).one("data-block", "3")
    assert "is-shared" not in alone.classes and "refs" not in alone.all_text()
    assert _Tree(_block_card(3, [], ["", ""])).one("data-block", "3").attrs["data-holders"] == ""


def test_render_html_draws_shared_and_cached_free_blocks_of_a_cache_built_directly():
    """The view reads sharing from the cache's public state, whoever built the cache."""
    cache = PagedKVCache(6, 1, 2, 1, 2, enable_prefix_caching=True)
    kv = torch.zeros(1, 3, 1, 2)
    cache.add_sequence(0)  # seq 0: tokens 7, 8, 9 in blocks [0, 1]; block 0 is full: cached
    cache.append_tokens(0, kv, kv, token_ids=[7, 8, 9])
    cache.fork(0, 1)
    cache.add_sequence(2)
    cache.append_tokens(2, kv, kv, token_ids=[1, 2, 3])  # blocks [2, 3]
    cache.free_sequence(2)  # block 2 (full) waits in the cached queue, block 3 goes on the stack
    tree = _Tree(render_html(cache))
    for b in (0, 1):
        assert card(tree, b).attrs["data-holders"] == "0 1" and "2 refs" in card(tree, b).all_text()
    assert slot_labels(tree, 1) == ["t2", "·"]
    cached, plain = card(tree, 2), card(tree, 3)
    assert "is-cached" in cached.classes and CACHED_COLOR in cached.attrs["style"]
    assert "free, content cached" in cached.all_text() and slot_labels(tree, 2) == ["t0", "t1"], "kept"
    assert "is-cached" not in plain.classes and CACHED_COLOR not in plain.attrs["style"]
    assert FREE_COLOR in plain.attrs["style"] and slot_labels(tree, 3) == [], "empty and free: in a run"
    assert queue_shown(tree) == [2] and free_stack_shown(tree)[0] == 3
    counts = " ".join(tree.one("data-role", "counts").all_text().split())
    assert "2 blocks used (2 shared), 4 free (1 cached)" in counts and "copies: 0" in counts
    assert "0 of 0 prompt tokens found" in counts


def test_forty_clicks_in_a_row_fill_blocks_in_order():
    """Speed is measured by ``python -m pagedlib.bench tracer``; here: repeated clicks stay correct."""
    tracer = BlockTableTracer()
    tracer.add_sequence()
    for _ in range(40):  # 40 tokens need 10 of the 12 blocks: every click stays a success
        tracer.append_button.click()
    assert tracer.cache.seq_lens[0] == 40
    assert tracer.cache.tables[0] == list(range(10))
    assert tracer.cache.num_free_blocks == 2


def test_click_benchmark_runs_and_writes_json(tmp_path, capsys):
    import json

    from pagedlib.bench.__main__ import main

    out = tmp_path / "tracer.json"
    assert main(["tracer", "--repeats", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["control"] for r in rows] == ["append token", "look up position", "render the view to HTML",
                                            f"render the largest view ({MAX_SLOTS} slots)"]
    assert rows[-1]["html_kib"] < 512, "the largest view the tracer allows stays under 0.5 MiB"
    assert "append token" in capsys.readouterr().out


def log_shown(tracer: BlockTableTracer) -> str:
    return " ".join(view(tracer).one("data-role", "log").all_text().split())


def test_fork_and_copy_on_write_through_the_buttons():
    tracer = BlockTableTracer()
    cache = tracer.cache
    tracer.add_button.click()
    tracer.n_tokens.value = 6
    tracer.append_n_button.click()  # seq 0: positions 0-5 in blocks [0, 1]; block 1 holds 2 of 4
    pools = cache.k.clone(), cache.v.clone()

    tracer.fork_button.click()
    tree = view(tracer)
    assert tracer.selected == 1 and cache.tables == {0: [0, 1], 1: [0, 1]} and cache.seq_lens[1] == 6
    assert cache.ref_counts[:3] == [2, 2, 0] and cache.cow_copies == 0
    assert torch.equal(cache.k, pools[0]) and torch.equal(cache.v, pools[1]), "a fork copies no K/V"
    assert holders(tree)[0] == holders(tree)[1] == "0 1"
    assert "2 refs" in card(tree, 1).all_text() and slot_labels(tree, 1) == ["t4", "t5", "·", "·"]
    assert all("is-shared" in n.classes for n in tree.one("data-seq", "1").iter() if "data-entry" in n.attrs)
    assert "Forked seq 0 into seq 1" in log_shown(tracer) and "copy-on-write" in log_shown(tracer)
    assert_view_matches_cache(tracer)

    original = cache.k[1].clone(), cache.v[1].clone()
    tracer.append_button.click()  # position 6 of seq 1 would land in shared block 1: copy it first
    tree = view(tracer)
    assert cache.tables == {0: [0, 1], 1: [0, 2]} and cache.seq_lens == {0: 6, 1: 7}
    assert cache.ref_counts[:3] == [2, 1, 1] and cache.cow_copies == 1
    copied = cache.k[2, :, :2], cache.v[2, :, :2]  # the 2 tokens block 1 held, every layer
    assert torch.equal(copied[0], original[0][:, :2]) and torch.equal(copied[1], original[1][:, :2])
    assert torch.equal(cache.k[1], original[0]) and torch.equal(cache.v[1], original[1]), "seq 0's K/V stay"
    copy = card(tree, 2)
    assert "is-copy" in copy.classes and "copy of 1" in copy.all_text()
    assert [n.attrs["data-block"] for n in tree.find("data-block") if "is-copy" in n.classes] == ["2"]
    log = log_shown(tracer)
    assert "block 1 was shared (2 refs)" in log and "copied its 2 tokens" in log and "to block 2" in log
    assert "the table now names 2 and block 1 keeps 1 ref" in log
    assert tree.one("data-role", "counts").attrs["data-copies"] == "1"
    assert "copy-on-write copies: 1" in tree.one("data-role", "counts").all_text()
    assert_view_matches_cache(tracer)

    tracer.append_button.click()  # seq 1 holds block 2 alone: written in place, the highlight goes
    assert cache.cow_copies == 1 and not [n for n in view(tracer).root.iter() if "is-copy" in n.classes]
    tracer.seq_picker.value = 0
    tracer.append_button.click()  # block 1 is seq 0's alone again: no copy either
    assert cache.cow_copies == 1 and cache.tables[0] == [0, 1] and cache.seq_lens[0] == 7
    assert_view_matches_cache(tracer)

    tracer.free_button.click()  # seq 0: block 0 stays for seq 1, block 1 is free
    assert cache.ref_counts[:2] == [1, 0] and "block 0 still held by other sequences" in log_shown(tracer)
    assert_view_matches_cache(tracer)


def test_a_fork_of_full_blocks_never_copies():
    tracer = BlockTableTracer()
    tracer.append(tracer.add_sequence(), 8)
    child = tracer.fork()
    assert "nothing will be copied" in log_shown(tracer)
    tracer.append(child, 1)
    tracer.append(0, 1)
    assert tracer.cache.cow_copies == 0 and tracer.cache.tables == {0: [0, 1, 3], 1: [0, 1, 2]}
    assert_view_matches_cache(tracer)


def test_a_failed_fork_or_copy_on_write_changes_nothing():
    tracer = BlockTableTracer(num_blocks=3)
    tracer.append(tracer.add_sequence(), 6)  # blocks [0, 1], one free
    tracer.fork()
    tracer.append(1, 1)  # copies block 1 into block 2: the pool is now full
    before, shown = snapshot(tracer.cache), shown_state(tracer)
    assert "is-copy" in shown[0]
    tracer.fork_button.click()  # seq 2 shares everything: still no block needed
    tracer.append_button.click()  # seq 2's last block (2) is shared: the copy needs a block, none is free
    assert "1 needed, 0 free" in error_shown(tracer) and "Nothing changed" in error_shown(tracer)
    assert tracer.cache.cow_copies == 1 and tracer.cache.tables[2] == [0, 2]
    tracer.free(2)
    assert_unchanged(tracer.cache, before)

    tracer.select(1)
    tracer.append(1, 1)  # a copy highlight, then a failed click: the view stays as it was
    shown = shown_state(tracer)
    with pytest.raises(OutOfBlocksError):
        tracer.append(1, 5)
    assert shown_state(tracer) == shown
    for call, error in [(lambda: tracer.fork(99), KeyError), (lambda: tracer.fork("0"), ValueError)]:
        before = snapshot(tracer.cache)
        with pytest.raises(error):
            call()
        assert_unchanged(tracer.cache, before)
    empty = BlockTableTracer()
    with pytest.raises(ValueError, match="no sequence selected"):
        empty.fork()
    many = BlockTableTracer()
    many.append(many.add_sequence(), 1)
    for _ in range(MAX_SEQUENCES - 1):
        many.fork_button.click()
    many.fork_button.click()
    assert f"at most {MAX_SEQUENCES} sequences" in error_shown(many)
    assert len(many.cache.tables) == MAX_SEQUENCES and many.cache.ref_count(0) == MAX_SEQUENCES
    assert f"seq 0, 1, 2, +{MAX_SEQUENCES - 3} · {MAX_SEQUENCES} refs" in card(view(many), 0).all_text()


def test_prefix_caching_hits_cached_free_blocks_and_eviction():
    tracer = BlockTableTracer(enable_prefix_caching=True)
    cache = tracer.cache
    tracer.n_tokens.value = 9
    tracer.add_prompt_button.click()  # seq 0: positions 0-8 in blocks [0, 1, 2]; blocks 0 and 1 are full
    assert cache.tables[0] == [0, 1, 2] and [cache.is_cached(b) for b in range(3)] == [True, True, False]
    assert card(view(tracer), 0).attrs["data-cached"] == "1"
    tracer.n_tokens.value = 10
    tracer.add_prompt_button.click()  # seq 1: positions 0-7 are found in blocks 0, 1, only 8-9 are written
    assert cache.tables[1] == [0, 1, 3] and cache.ref_counts[:4] == [2, 2, 1, 1]
    assert cache.prefix_cache_stats()["hit_tokens"] == 8
    assert ("found its first 8 tokens in cached blocks 0, 1 (attached, not written again); the rest: "
            "positions 8..9 (2 tokens) written at once") in log_shown(tracer)
    assert_view_matches_cache(tracer)

    tracer.free(0)  # block 2 (partly filled) goes on the stack; 0 and 1 stay with seq 1
    tracer.free(1)  # now 0 and 1 keep their K/V, free but findable; block 3 goes on the stack
    tree = view(tracer)
    assert list(cache.prefix_cache.free_queue) == [1, 0] and cache.num_free_blocks == 12
    assert "blocks 0, 1 kept as cached free: the K/V stay findable" in log_shown(tracer)
    for b in (0, 1):
        assert "is-cached" in card(tree, b).classes and CACHED_COLOR in card(tree, b).attrs["style"]
    assert slot_labels(tree, 1) == ["t4", "t5", "t6", "t7"]
    assert CACHED_COLOR not in card(tree, 2).attrs["style"] and FREE_COLOR in card(tree, 2).attrs["style"]
    counts = " ".join(tree.one("data-role", "counts").all_text().split())
    assert "12 free (2 cached) · copy-on-write copies: 0 · prefix cache: 8 of 19 prompt tokens" in counts
    assert_view_matches_cache(tracer)

    s = tracer.add_sequence(5)  # a later prompt finds block 0 among the cached free blocks
    assert cache.tables[s][0] == 0 and list(cache.prefix_cache.free_queue) == [1]
    assert_view_matches_cache(tracer)

    small = BlockTableTracer(num_blocks=3, enable_prefix_caching=True)
    small.free(small.add_sequence(8))  # blocks 0, 1 wait in the queue (1 evicted first), 2 on the stack
    small.append(small.add_sequence(), 12)  # no lookup: pops 2, then evicts 1 and 0
    assert small.cache.tables[1] == [2, 1, 0] and small.cache.prefix_cache_stats()["evicted_blocks"] == 2
    assert "cached blocks 1, 0 evicted (the free stack was empty)" in log_shown(small)
    assert_view_matches_cache(small)


def test_a_prompt_that_does_not_fit_changes_nothing_even_after_a_hit():
    """The prompt's blocks are counted before the cache looks anything up: a hit on a cached free block
    makes that block busy, so it no longer counts as free for the rest of the prompt."""
    tracer = BlockTableTracer(num_blocks=4, enable_prefix_caching=True)
    tracer.free(tracer.add_sequence(9))  # blocks 0, 1 cached free; 2 (partly filled) and 3 on the stack
    tracer.add_sequence(1)  # seq 1 takes block 2: 3 blocks free, 2 of them cached
    before, shown = snapshot(tracer.cache), shown_state(tracer)
    tracer.n_tokens.value = 13  # 8 tokens found in blocks 0, 1; 5 more need 2 blocks, only 1 is left
    tracer.add_prompt_button.click()
    assert ("out of KV blocks for the last 5 tokens of a 13-token prompt of sequence 2 (the first 8 are "
            "cached): 2 needed, 1 free") in error_shown(tracer)
    assert_unchanged(tracer.cache, before)  # the prefix cache's query counters included
    assert shown_state(tracer) == shown
    assert tracer.add_sequence(12) == 2 and tracer.cache.tables[2] == [0, 1, 3]
    assert_view_matches_cache(tracer)


@settings(max_examples=80, deadline=None)
@given(prefix=st.booleans(), ops=st.lists(st.tuples(st.sampled_from(
    ["prompt", "prompt", "append", "append_n", "fork", "free", "select", "back", "forward"]),
    st.integers(0, 12)),
    min_size=8, max_size=30))
def test_random_clicks_keep_the_view_and_the_cache_in_agreement(prefix, ops):
    """Any sequence of clicks: each succeeds or changes nothing, and the picture always matches the cache."""
    tracer = BlockTableTracer(num_blocks=8, enable_prefix_caching=prefix)
    for op, x in ops:
        before, shown = snapshot(tracer.cache), shown_state(tracer)
        live = list(tracer.cache.tables)
        tracer.n_tokens.value = x
        if op == "select" and live:
            tracer.seq_picker.value = live[x % len(live)]
            continue
        button = {"add": tracer.add_button, "prompt": tracer.add_prompt_button, "fork": tracer.fork_button,
                  "append": tracer.append_button, "append_n": tracer.append_n_button,
                  "free": tracer.free_button, "select": tracer.add_button, "back": tracer.back_button,
                  "forward": tracer.forward_button}[op]
        button.click()
        if view(tracer).find("data-role", "error"):
            assert_unchanged(tracer.cache, before)
            assert shown_state(tracer) == shown
        assert_view_matches_cache(tracer)
    cache, stats = tracer.cache, tracer.cache.prefix_cache_stats()  # pytest --hypothesis-show-statistics
    event(f"copy-on-write: {cache.cow_copies > 0}, prefix hits: {stats['hit_tokens'] > 0}, "
          f"evictions: {stats['evicted_blocks'] > 0}")


def text_lines(html: str) -> list[str]:
    """The view as a static page without styles shows it: one line per block element, whitespace collapsed."""
    lines = [""]

    class Text(HTMLParser):
        def handle_starttag(self, tag, attrs):
            lines.append("") if tag == "div" else None

        def handle_endtag(self, tag):
            lines.append("") if tag == "div" else None

        def handle_data(self, data):
            lines[-1] += data

    Text().feed(html)
    return [" ".join(line.split()) for line in lines if line.strip()]


def test_back_and_forward_walk_a_history_of_unchanging_snapshots():
    tracer = BlockTableTracer.article_trace()
    states = [(snapshot(tracer.cache), tracer.html())]
    for act in (lambda: tracer.append(0), lambda: tracer.fork(0), lambda: tracer.append(1, 2),
                lambda: tracer.free(0)):
        act()
        states.append((snapshot(tracer.cache), tracer.html()))
    assert tracer.step == 6 and tracer.forward_button.disabled and not tracer.back_button.disabled
    for at in range(5, 1, -1):  # back to the article's state, one step at a time
        tracer.back_button.click()
        assert tracer.step == at
        assert_unchanged(tracer.cache, states[at - 2][0])
        assert tracer.html() == states[at - 2][1]
        assert_view_matches_cache(tracer)
    tracer.append(0, 3)  # a change to the restored cache: the snapshots it came from stay as they were
    tracer.back()
    assert_unchanged(tracer.cache, states[0][0])
    assert tracer.step_label.value == "step 2 of 3", "the new action replaced the steps after it"
    tracer.forward()
    assert tracer.cache.seq_lens[0] == 10 and tracer.forward_button.disabled
    before, shown = snapshot(tracer.cache), shown_state(tracer)
    with pytest.raises(ValueError, match="no step 4 to go to: the history holds steps 0 to 3"):
        tracer.forward()
    assert_unchanged(tracer.cache, before)
    assert shown_state(tracer) == shown
    for _ in range(3):
        tracer.back()
    assert tracer.cache.tables == {} and tracer.back_button.disabled
    with pytest.raises(ValueError, match="no step -1"):
        tracer.back()
    history = view_history(tracer)
    assert [int(n.attrs["data-step"]) for n in history] == [3, 2, 1, 0], "newest first"
    assert "is-current" in history[-1].classes and "Empty pool" in history[-1].all_text()


def view_history(tracer: BlockTableTracer) -> list[_Node]:
    return [n for n in _Tree(tracer.history_view.value).root.iter() if "data-step" in n.attrs]


def test_any_scenario_step_can_be_reached_without_timing():
    """Exercise 5 of notebook 03 stops at step 11: Play, then Back or Forward, lands there exactly."""
    direct = BlockTableTracer()
    direct.play_to(11)
    played = BlockTableTracer()
    played.play.value = len(SCENARIO)  # what Play's last tick does
    for _ in range(4):
        played.back_button.click()
    paused = BlockTableTracer()
    paused.play.value = 8  # paused early: Forward plays the next scenario steps
    for _ in range(3):
        paused.forward_button.click()
    for tracer in (played, paused):
        assert tracer.step == 11 and tracer.play.value == 11
        assert_unchanged(tracer.cache, snapshot(direct.cache))
        assert tracer.html() == direct.html()
        assert "Scenario step 11/15: seq 1 finishes" in log_shown(tracer)
        assert tracer.step_label.value == "step 11 of 15"
    paused.append(0)  # a step off the script: the scenario's later steps are gone
    assert paused.forward_button.disabled and paused.step_label.value == "step 12 of 12"


def test_the_lookup_and_the_reads_always_show_the_selected_sequence():
    tracer = BlockTableTracer()
    tracer.add_sequence(6)
    tracer.lookup(0, 2)
    tracer.fork()  # the child is selected: the lookup moves to its last token
    for role in ("lookup", "reads"):
        assert "seq 1" in view(tracer).one("data-role", role).all_text()
    assert tracer.position.value == 5
    tracer.seq_picker.value = 0
    assert "Lookup of seq 0, position 5" in view(tracer).one("data-role", "lookup").all_text()
    tracer.free(0)
    assert tracer.selected == 1 and "Lookup of seq 1" in view(tracer).one("data-role", "lookup").all_text()


def test_the_legend_explains_every_colour_and_mark():
    tracer = BlockTableTracer()
    tracer.add_sequence(6)
    tracer.fork()
    tracer.append(1)  # a copy, a shared block, a lookup, hatched empty slots
    legend = " ".join(view(tracer).one("data-role", "legend").all_text().split())
    for words in ("seq 0 (blue)", "seq 1 (orange)", "grey: free", "hatched: held, not yet written",
                  "double border: shared", "amber: just copied", "pink ring: the lookup"):
        assert words in legend
    assert "green" not in legend, "no prefix cache: no cached free blocks to explain"
    assert "green: free, content cached" in view(BlockTableTracer(enable_prefix_caching=True)).one(
        "data-role", "legend").all_text()
    shared, looked_up = card(view(tracer), 0), card(view(tracer), 2)
    assert "double" in shared.attrs["style"] and "outline" not in shared.attrs["style"]
    assert "outline:3px solid" in looked_up.attrs["style"] and "double" not in looked_up.attrs["style"]
    tracer.lookup(1, 1)  # a ringed entry of a shared block: both marks, each its own
    chip = next(n for n in view(tracer).one("data-seq", "1").iter() if "is-lookup" in n.classes)
    assert "double" in chip.attrs["style"] and "outline:3px solid" in chip.attrs["style"]


def test_no_sequence_colour_can_be_taken_for_a_cached_free_block():
    import colorsys

    from pagedlib.teach.colors import CACHED_EDGE, OWNER_COLORS, OWNER_NAMES

    def hsv(color: str) -> tuple[float, float, float]:
        return colorsys.rgb_to_hsv(*(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)))

    green = hsv(CACHED_EDGE)[0] * 360
    for color, name in zip(OWNER_COLORS, OWNER_NAMES, strict=True):
        hue, saturation, _ = hsv(color)
        assert saturation < 0.1 or abs(hue * 360 - green) > 45, f"{name} {color} looks like cached green"


def test_the_view_reads_as_plain_text_in_a_static_page():
    """GitHub drops the styles: ids must stay apart, the stack top come first, empty free blocks collapse."""
    tracer = BlockTableTracer()
    tracer.play_to(len(SCENARIO))
    lines = text_lines(tracer.html())
    assert len(lines) <= 25, lines
    stack = lines[lines.index(f"Free stack: {len(tracer.cache.free)} blocks") + 1]
    assert stack == "top (popped next) → " + " ".join(map(str, tracer.cache.free[::-1]))
    assert "seq 2 len 9 [3, 2, 5]" in lines and "seq 0 len 10 [0, 1, 4]" in lines
    assert "free, empty blocks: 6 7 8 9 10 11" in lines, "a run of empty free blocks is one line"
    assert any(line.startswith("block 5 · seq 2: s2:t8 · · ·") for line in lines)
    reads = next(line for line in lines if line.startswith("A decode step for seq 2"))
    assert reads.endswith("3.0 3.1 3.2 3.3 → 2.0 2.1 2.2 2.3 → 5.0")
    tracer.fork(2)
    assert "block 3 · seq 2, 3 · 2 refs: t0 t1 t2 t3" in text_lines(tracer.html())
    assert "×" not in tracer.html()


def test_the_readme_screenshot_state_comes_from_the_clicks_notebook_03_lists():
    """``notebooks/images/tracer.png`` is taken by tests/test_browser.py after these same clicks."""
    tracer = BlockTableTracer.article_trace()
    tracer.append_button.click()
    tracer.append_button.click()
    tracer.add_button.click()
    tracer.n_tokens.value = 5
    tracer.append_n_button.click()
    tracer.seq_picker.value = 0
    tracer.position.value = 8
    tracer.seq_picker.value = 1
    tracer.fork_button.click()
    tracer.append_button.click()
    cache = tracer.cache
    assert cache.tables == {0: [5, 2, 9], 1: [0, 1], 2: [0, 3]} and cache.cow_copies == 1
    assert "copy of 1" in card(view(tracer), 3).all_text() and tracer.step == 8


@settings(max_examples=25, deadline=None)
@given(prefix=st.booleans(), ops=st.lists(st.tuples(st.sampled_from(["prompt", "append", "fork", "free"]),
                                                    st.integers(0, 9)), min_size=3, max_size=15))
def test_walking_the_whole_history_back_and_forth_reproduces_every_step(prefix, ops):
    """Each step is an immutable snapshot: later actions, Back and Forward never change an earlier one."""
    tracer = BlockTableTracer(num_blocks=8, enable_prefix_caching=prefix)
    seen = {0: (snapshot(tracer.cache), tracer.html())}
    for op, x in ops:
        live = list(tracer.cache.tables)
        seq = live[x % len(live)] if live else None
        try:
            if op == "prompt" or seq is None:
                tracer.add_sequence(x)
            elif op == "append":
                tracer.append(seq, 1 + x)
            else:
                (tracer.fork if op == "fork" else tracer.free)(seq)
        except (ValueError, OutOfBlocksError):
            continue
        seen[tracer.step] = (snapshot(tracer.cache), tracer.html())
    last = tracer.step
    for at in [*range(last - 1, -1, -1), *range(1, last + 1)]:
        tracer.back() if at < tracer.step else tracer.forward()
        assert tracer.step == at
        assert_unchanged(tracer.cache, seen[at][0])
        assert tracer.html() == seen[at][1]
