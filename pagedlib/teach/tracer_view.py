"""The tracer's view: ``render_html(cache, ...)``, a pure function from a ``PagedKVCache``'s public state to
one HTML string, one small function per panel. Styles are inline (an untrusted notebook keeps only those),
and the text still reads without them; classes and ``data-*`` attributes are for the tests."""

from __future__ import annotations

import html
import itertools
from collections.abc import Sequence

from pagedlib.core.cache import PagedKVCache
from pagedlib.teach._checks import MAX_SEQUENCES, MAX_SLOTS, drawable  # noqa: F401 (the limits, re-exported)
from pagedlib.teach.colors import CACHED_COLOR, CACHED_EDGE, FREE_COLOR, OWNER_NAMES, owner_color
from pagedlib.testing import block_holders

_MONO = "font-family:Menlo,Consolas,DejaVu Sans Mono,monospace"
_ROOT = "font-family:system-ui,sans-serif;font-size:13px;color:#222;line-height:1.35;max-width:1060px"
_LOG = "background:#F4F6FA;border-left:4px solid #4C72B0;padding:6px 10px;margin:4px 0 6px"
_ERROR = "background:#FDECEA;border-left:4px solid #C44E52;color:#8A1F24;padding:6px 10px;font-weight:600"
_FLEX = "display:flex;flex-wrap:wrap;gap:3px;align-items:center"
_HEAD = "font-weight:700;font-size:12px;text-transform:uppercase;color:#555;margin:6px 0 4px"
_CARD = "border-radius:6px;padding:3px;display:flex;flex-direction:column;gap:2px"
_SLOT = f"width:39px;height:22px;line-height:20px;border-radius:3px;font-size:11px;text-align:center;{_MONO}"
_CHIP = f"min-width:20px;padding:1px 4px;border-radius:4px;text-align:center;font-size:12px;{_MONO}"
_NOTE = "font-size:11px;color:#666"
_PANEL = "margin-top:6px;padding:5px 10px;border:1px solid #DDD;border-radius:6px"
_CODE = f"{_MONO};background:#F1F1F1;padding:0 3px;border-radius:3px"
LOOKUP = "#E0007A"  # the ring of the looked-up slot, its block and its table entry
_RING = f"outline:3px solid {LOOKUP};outline-offset:1px"
_SHARED = "4px double #111"  # the border of a block several tables hold
_COPY, _COPY_EDGE = "#FFF1C2", "#B07D00"  # the block a copy-on-write just made
_HATCH = ("background:repeating-linear-gradient(45deg,#fff 0 3px,{0}88 3px 6px);color:#999;"
          "border:1px solid {0}")  # a slot held but not yet written: hatched in its holder's colour {0}


def _el(tag: str, style: str, body: str = "", cls: str = "", title: str = "", **data: object) -> str:
    """``<tag class=.. data-..=.. title=.. style=..>body</tag>``; values are ints and fixed words."""
    attrs = f" class='{cls}'" * bool(cls) + "".join(f" data-{k}='{v}'" for k, v in data.items())
    return f"<{tag}{attrs}{f' title={title!r}' * bool(title)} style='{style}'>{body}</{tag}>"


def _s(items: Sequence[object]) -> str:
    return "s" if len(items) > 1 else ""


def _note(text: str) -> str:
    return _el("span", _NOTE, text)


def _chip(color: str, text: object, ring: bool = False, shared: bool = False, **data: object) -> str:
    """A small label: a block id in a table, a slot in the read order (``ring``: the lookup's)."""
    style = f"{_CHIP};background:{color};color:#fff;border:{_SHARED if shared else '1px solid transparent'}"
    cls = "pt-chip" + " is-lookup" * ring + " is-shared" * shared
    return _el("span", style + f";{_RING}" * ring, str(text), cls, **data)


def render_html(cache: PagedKVCache, *, selected: int | None = None, lookup: tuple[int, int] | None = None,
                copied: tuple[int, int] | None = None, log: str = "", error: str = "") -> str:
    """The tracer's view of ``cache`` as one self-contained HTML string.

    Args:
        selected: the sequence the buttons act on; lookup: the ``(seq_id, pos)`` ringed.
        copied: ``(original, copy)`` of the last copy-on-write; log, error: plain text.
    """
    drawable(cache)
    hit = cache.slot(*lookup) if lookup is not None else None
    entry = (lookup[0], lookup[1] // cache.block_size) if lookup is not None else None
    side = _el("div", "flex:1 1 220px", _free_panel(cache) + _tables_panel(cache, entry, selected))
    return _el("div", _ROOT, "".join([
        _el("div", _LOG, html.escape(log or "Ready."), "pt-log", role="log"),
        _el("div", _ERROR, html.escape(error), "pt-error", role="error") if error else "",
        _counts_panel(cache), _legend(cache),
        _el("div", "display:flex;flex-wrap:wrap;gap:14px", _pool_panel(cache, selected, hit, copied) + side),
        _lookup_panel(cache.block_size, lookup, hit[0]) if hit is not None else "",
        _reads_panel(cache, selected) if selected in cache.tables else ""]), "pt-tracer")


def render_history(logs: Sequence[str], at: int) -> str:
    """The log of every step, newest first: the current step in bold, undone ones (``> at``) greyed."""
    rows = [_el("div", "font-weight:700" if i == at else "color:#999" if i > at else "color:#444",
                f"{i}. {html.escape(line)}", "pt-step" + " is-current" * (i == at), step=i)
            for i, line in reversed(list(enumerate(logs)))]
    return _el("div", f"{_NOTE};line-height:1.35;max-height:9em;overflow-y:auto;{_PANEL}",
               _el("div", _HEAD, "Log, newest first") + "".join(rows), "pt-history", role="history")


def _counts_panel(cache: PagedKVCache) -> str:
    """One line of counters: blocks used / shared / free / cached, copies made, prefix-cache hits."""
    pc = cache.prefix_cache
    text = (f"<b>{cache.num_used_blocks}</b> blocks used (<b>{sum(c > 1 for c in cache.ref_counts)}</b> "
            f"shared), <b>{cache.num_free_blocks}</b> free"
            + (f" (<b>{len(pc.free_queue)}</b> cached)" if pc is not None else "")
            + f" &middot; copy-on-write copies: <b>{cache.cow_copies}</b>")
    if pc is not None:
        st = cache.prefix_cache_stats()
        text += (f" &middot; prefix cache: <b>{st['hit_tokens']}</b> of {st['queried_tokens']} prompt tokens "
                 f"found (all prompts so far), {st['evicted_blocks']} blocks evicted")
    return _el("div", f"{_NOTE};margin:4px 0", text, "pt-counts", role="counts", copies=cache.cow_copies)


def _legend(cache: PagedKVCache) -> str:
    """What every colour, hatching, border and ring of the view means."""
    keys = [(f"background:{owner_color(s)}", f"seq {s} ({OWNER_NAMES[s % 8]})") for s in cache.tables]
    keys += [(f"background:{FREE_COLOR};border:1px dashed #BBB", "grey: free")]
    if cache.prefix_cache is not None:
        keys += [(f"background:{CACHED_COLOR};border:1px solid {CACHED_EDGE}", "green: free, content cached")]
    keys += [(_HATCH.format("#555"), "hatched: held, not yet written"),
             (f"border:{_SHARED}", "double border: shared by N tables (N refs)"),
             (f"background:{_COPY};border:1px solid {_COPY_EDGE}", "amber: just copied (copy-on-write)"),
             (f"border:3px solid {LOOKUP}", "pink ring: the lookup")]
    box = "display:inline-block;width:14px;height:12px;border-radius:2px;vertical-align:middle"
    items = [_el("span", "", f"{_el('span', f'{box};{swatch}')} {text}") for swatch, text in keys]
    return _el("div", f"{_FLEX};gap:4px 8px;{_NOTE}", "<b>Legend:</b> " + " &middot; ".join(items),
               "pt-legend", role="legend")


def _pool_panel(cache: PagedKVCache, selected: int | None, hit: tuple[int, int] | None,
                copied: tuple[int, int] | None) -> str:
    """Every physical block in id order: a card of ``block_size`` slots, or a run of empty free blocks."""
    holders, labels, cards = block_holders(cache), _slot_labels(cache), []
    for empty, run in itertools.groupby(range(cache.num_blocks), lambda b: not (holders[b] or labels[b][0])):
        if empty:
            cards.append(_free_run(list(run)))
        for b in [] if empty else run:
            ring = hit[1] if hit is not None and hit[0] == b else None
            copy_of = copied[0] if copied is not None and copied[1] == b and holders[b] else None
            cards.append(_block_card(b, holders[b], labels[b], ring, selected in holders[b],
                                     cached=cache.is_cached(b), copy_of=copy_of))
    head = _el("div", _HEAD, f"Physical pool: {cache.num_blocks} blocks &times; {cache.block_size} slots")
    return _el("div", "flex:0 1 760px", head + _el("div", f"{_FLEX};gap:7px", " ".join(cards), "pt-pool"))


def _free_run(blocks: Sequence[int]) -> str:
    """Consecutive free blocks that hold nothing: one card listing their ids."""
    chips = " ".join(_el("span", f"{_CHIP};background:{FREE_COLOR};color:#555;border:1px dashed #BBB", str(b),
                         "pt-block", block=b, holders="", refs=0, cached=0) for b in blocks)
    return _el("div", f"{_CARD};{_FLEX};flex-direction:row;border:2px dashed #C9C9C9;background:#FAFAFA",
               f"{_note(f'free, empty block{_s(blocks)}:')} {chips}", "pt-run")


def _slot_labels(cache: PagedKVCache) -> list[list[str]]:
    """``labels[b][offset]``: ``s<seq>:t<pos>``, or ``t<pos>`` in a shared or cached free block; ``""``."""
    bs, refs = cache.block_size, cache.ref_counts
    labels = [[""] * bs for _ in range(cache.num_blocks)]
    for s, table in cache.tables.items():
        for pos in range(cache.seq_lens[s]):
            b = table[pos // bs]
            labels[b][pos % bs] = f"t{pos}" if refs[b] > 1 else f"s{s}:t{pos}"
    for b in cache.prefix_cache.free_queue if cache.prefix_cache is not None else ():
        key, depth = cache.prefix_cache.keys[b], 0  # depth: how many full blocks come before this one
        parent = key.parent
        while parent is not None:
            depth, parent = depth + 1, parent.parent
        labels[b] = [f"t{depth * bs + i}" for i in range(len(key.tokens))]
    return labels


def _block_card(block: int, holders: Sequence[int], labels: Sequence[str], ring: int | None = None,
                selected: bool = False, *, cached: bool = False, copy_of: int | None = None) -> str:
    """One block on one line, ``block 2 · seq 0, 1 · 2 refs:`` and its slots (``ring``: the looked-up one)."""
    color = owner_color(holders[0]) if holders else CACHED_EDGE
    style = (f"{_CARD};border:{_SHARED if len(holders) > 1 else f'2px solid {color}'};background:"
             f"{_COPY if copy_of is not None else '#fff' if holders else CACHED_COLOR}")
    style += f";{_RING}" if ring is not None else f";box-shadow:0 0 0 2px {color}" * selected
    cls = "pt-block" + " is-shared" * (len(holders) > 1) + " is-copy" * (copy_of is not None) + \
        " is-cached" * (not holders) + (" is-lookup" if ring is not None else " is-selected" * selected)
    head = _el("span", f"font-size:11px;color:#444;{_MONO}",
               f"<b style='color:#111'>block {block}</b> &middot; {_card_tag(holders, copy_of)}:")
    slots = " ".join(_slot(i, text, color, i == ring) for i, text in enumerate(labels))
    return _el("div", style, f"{head} {_el('span', 'display:flex;gap:3px', slots)}", cls,
               f"held by seq {', '.join(map(str, holders))}" * (len(holders) > 1), block=block,
               holders=" ".join(map(str, holders)), refs=len(holders), cached=int(cached))


def _card_tag(holders: Sequence[int], copy_of: int | None) -> str:
    """``free, content cached``, ``seq 1``, ``seq 0, 1 · 2 refs``, ``seq 1, copy of 2``, ``seq 0, 1, +3``."""
    if not holders:
        return "free, content cached"
    shown = list(map(str, holders)) if len(holders) <= 4 else [*map(str, holders[:3]), f"+{len(holders) - 3}"]
    copy = f", <b style='color:{_COPY_EDGE}'>copy of {copy_of}</b>" * (copy_of is not None)
    refs = (" &middot; " + _el("b", "color:#111", f"{len(holders)} refs", "pt-refs")) * (len(holders) > 1)
    return "seq " + ", ".join(shown) + copy + refs


def _slot(offset: int, label: str, color: str, ring: bool) -> str:
    """One slot: filled in its holder's colour, or hatched (held, not yet written)."""
    look = f"background:{color};border:1px solid {color};color:#fff" if label else _HATCH.format(color)
    return _el("span", f"{_SLOT};{look}" + f";{_RING}" * ring, label or "&middot;",
               "pt-slot" + " is-filled" * bool(label) + " is-lookup" * ring, slot=offset)


def _free_panel(cache: PagedKVCache) -> str:
    """The free stack, top first, then (prefix caching) the cached free blocks in eviction order."""
    free, pc = cache.free[::-1], cache.prefix_cache
    chips = [_el("span", f"{_CHIP};background:#fff;color:#333;border:" + ("2px solid #111;font-weight:700"
             if i == 0 else "1px solid #BBB"), str(b), "pt-chip" + " is-top" * (i == 0), free=b)
             for i, b in enumerate(free)]
    out = _row(f"Free stack: {len(free)} block{_s(free)}", "top (popped next) &rarr;" if free else
               "empty: no new block can be handed out", chips, "free-stack")
    if pc is None:
        return out
    style = f"{_CHIP};background:{CACHED_COLOR};color:#222;border:1px solid {CACHED_EDGE}"
    chips = [_el("span", style, str(b), "pt-chip", queued=b) for b in pc.free_queue]
    return out + _row(f"Cached, free: {len(chips)} block{_s(chips)}", "evicted first, when the stack is "
                      "empty &rarr;" if chips else "none: a freed full block waits here, its K/V kept", chips,
                      "cached-queue")


def _row(head: str, lead: str, chips: Sequence[str], role: str) -> str:
    return _el("div", _HEAD, head) + _el("div", _FLEX, f"{_note(lead)} {' '.join(chips)}", f"pt-{role}",
                                         role=role)


def _tables_panel(cache: PagedKVCache, entry: tuple[int, int] | None, selected: int | None) -> str:
    """One row per sequence, ``seq 0 len 7 [5, 2]``: shared entries double-bordered, the lookup's ringed."""
    rows = [_el("div", _HEAD, "Block tables"), _note("no sequences yet: add one") * (not cache.tables)]
    for s, table in cache.tables.items():
        color, n = owner_color(s), cache.seq_lens[s]
        entries = ", ".join(_chip(color, b, (s, i) == entry, cache.ref_counts[b] > 1, entry=i)
                            for i, b in enumerate(table))
        dot = _el("span", f"width:10px;height:10px;border-radius:5px;background:{color}")
        rows.append(_el("div", f"{_FLEX};gap:5px;margin:0 0 4px;white-space:nowrap" + ";background:#E4EAF4" *
                        (s == selected), f"{dot} <b>seq {s}</b> {_note(f'len {n}')} [{entries}]",
                        "pt-table" + " is-selected" * (s == selected), seq=s, len=n))
    return "".join(rows)


def _lookup_panel(bs: int, lookup: tuple[int, int], block: int) -> str:
    """The arithmetic of one lookup: position -> logical block -> physical block, offset."""
    s, pos = lookup
    text = (f"<b>Lookup of seq {s}, position {pos}:</b> logical block <code style='{_CODE}'>{pos} // {bs} = "
            f"{pos // bs}</code> &rarr; table[{pos // bs}] = <b>physical block {block}</b> &rarr; offset "
            f"<code style='{_CODE}'>{pos} % {bs} = {pos % bs}</code> &rarr; slot ({block}, {pos % bs})")
    return _el("div", _PANEL, text, "pt-lookup", role="lookup")


def _reads_panel(cache: PagedKVCache, seq: int) -> str:
    """The slots a decode step of ``seq`` reads, in order (``block.offset``); arrows: the next table entry."""
    n, color, bs = cache.seq_lens[seq], owner_color(seq), cache.block_size
    chips = [f"{_note('&rarr;')} " * (pos > 0 and pos % bs == 0)
             + _chip(color, f"{cache.tables[seq][pos // bs]}.{pos % bs}", read=pos) for pos in range(n)]
    head = _el("b", "", f"A decode step for seq {seq} reads {n} slots, in this order (block.offset):")
    body = " ".join(chips) or _note("nothing yet: the sequence holds no tokens")
    return _el("div", f"{_PANEL};{_FLEX}", f"{head} {body}", "pt-reads", role="reads")
