"""The tracer's view: ``render_html(cache, ...)``, a pure function from a ``PagedKVCache``'s state to one
HTML string, one small function per panel; ``render_history`` draws the log of every step.

It reads sharing from the cache's public state (``block_holders()``, ``ref_counts``,
``prefix_cache.free_queue``). Same state, same HTML. Styles are inline (an untrusted notebook keeps only
those), and the text reads on its own where a static page drops them: ids are separated, every card is
one line, runs of empty free blocks collapse into one. Classes and ``data-*`` attributes are for tests.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from pagedlib.core.cache import PagedKVCache
from pagedlib.teach._checks import MAX_SEQUENCES, MAX_SLOTS, drawable
from pagedlib.teach.colors import CACHED_COLOR, CACHED_EDGE, FREE_COLOR, OWNER_NAMES, owner_color

__all__ = ["MAX_SEQUENCES", "MAX_SLOTS", "render_html", "render_history"]

_MONO = "font-family:Menlo,Consolas,DejaVu Sans Mono,monospace"
_ROOT = ("font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;font-size:13px;color:#222;"
         "line-height:1.35;max-width:1060px")
_LOG = "background:#F4F6FA;border-left:4px solid #4C72B0;padding:6px 10px;margin:4px 0 6px"
_ERROR = ("background:#FDECEA;border-left:4px solid #C44E52;color:#8A1F24;padding:6px 10px;margin:4px 0 8px;"
          "font-weight:600")
_FLEX = "display:flex;flex-wrap:wrap;gap:3px;align-items:center"
_HEAD = "font-weight:700;font-size:12px;text-transform:uppercase;color:#555;margin:6px 0 4px"
_CARD = "border-radius:6px;padding:3px;display:flex;flex-direction:column;gap:2px"
_SLOT = f"width:39px;height:22px;line-height:20px;border-radius:3px;font-size:11px;text-align:center;{_MONO}"
_CHIP = f"min-width:20px;padding:1px 4px;border-radius:4px;text-align:center;font-size:12px;{_MONO}"
_NOTE = "font-size:11px;color:#666"
_PANEL = "margin-top:6px;padding:5px 10px;border:1px solid #DDD;border-radius:6px"
_CODE = f"{_MONO};background:#F1F1F1;padding:0 3px;border-radius:3px"
LOOKUP = "#E0007A"                     # the ring of the looked-up slot, its block and its table entry
_RING = f"outline:3px solid {LOOKUP};outline-offset:1px"
_SHARED = "4px double #111"           # the border of a block several tables hold
_COPY, _COPY_EDGE = "#FFF1C2", "#B07D00"  # the block a copy-on-write just made


def _hatch(color: str) -> str:
    """A slot its block holds but no token fills yet: hatched in the holder's colour."""
    return f"background:repeating-linear-gradient(45deg,#fff 0 3px,{color}55 3px 6px);color:#999;" \
        f"border:1px solid {color}"


def _el(tag: str, style: str, body: str = "", cls: str = "", title: str = "", **data: object) -> str:
    """``<tag class=.. data-..=.. title=.. style=..>body</tag>``. Values are ints and fixed words."""
    attrs = f" class='{cls}'" if cls else ""
    attrs += "".join(f" data-{k}='{v}'" for k, v in data.items()) + (f" title='{title}'" if title else "")
    return f"<{tag}{attrs} style='{style}'>{body}</{tag}>"


def _note(text: str) -> str:
    return _el("span", _NOTE, text)


def _chip(color: str, text: object, ring: bool = False, shared: bool = False, **data: object) -> str:
    """A small label: a block id in a table, a slot in the read order (``ring``: the lookup's)."""
    style = f"{_CHIP};background:{color};color:#fff" + (f";{_RING}" if ring else "")
    style += f";border:{_SHARED}" if shared else ";border:1px solid transparent"
    cls = "pt-chip" + (" is-lookup" if ring else "") + (" is-shared" if shared else "")
    return _el("span", style, str(text), cls, **data)


def render_html(cache: PagedKVCache, *, selected: int | None = None, lookup: tuple[int, int] | None = None,
                copied: tuple[int, int] | None = None, log: str = "", error: str = "") -> str:
    """The tracer's view of ``cache`` as one self-contained HTML string.

    Args:
        selected: the sequence the buttons act on; its blocks are outlined and its decode reads listed.
        lookup: ``(seq_id, pos)`` whose path ``pos -> logical block -> physical block, offset`` is ringed.
        copied: ``(original, copy)`` of the copy-on-write the last action made (the copy is tinted).
        log, error: the explanation of the last action and the last error (plain text).
    """
    drawable(cache)
    hit = cache.slot(*lookup) if lookup is not None else None
    entry = (lookup[0], lookup[1] // cache.block_size) if lookup is not None else None
    parts = [
        _el("div", _LOG, html.escape(log or "Ready."), "pt-log", role="log"),
        _el("div", _ERROR, html.escape(error), "pt-error", role="error") if error else "",
        _counts_panel(cache), _legend(cache),
        _el("div", "display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start",
            _pool_panel(cache, selected, hit, copied)
            + _el("div", "flex:1 1 220px;min-width:220px", _free_panel(cache) + _tables_panel(cache, entry))),
        _lookup_panel(cache.block_size, lookup, hit[0]) if hit is not None else "",
        _reads_panel(cache, selected) if selected in cache.tables else "",
    ]
    return _el("div", _ROOT, "".join(parts), "pt-tracer")


def render_history(logs: Sequence[str], at: int) -> str:
    """The log of every step, newest first: the current step in bold, undone ones (``> at``) greyed."""
    rows = [_el("div", "font-weight:700" if i == at else "color:#999" if i > at else "",
                f"{i}. {html.escape(line)}", "pt-step is-current" if i == at else "pt-step", step=i)
            for i, line in reversed(list(enumerate(logs)))]
    return _el("div", f"{_NOTE};max-height:9em;overflow-y:auto;{_PANEL}",
               _el("div", _HEAD, "Log, newest first") + "".join(rows), "pt-history", role="history")


def _counts_panel(cache: PagedKVCache) -> str:
    """One line of counters: blocks used / shared / free / cached, copies made, prefix-cache hits."""
    pc = cache.prefix_cache
    cached = f" (<b>{len(pc.free_queue)}</b> cached)" if pc is not None else ""
    text = (f"<b>{cache.num_used_blocks}</b> blocks used (<b>{sum(c > 1 for c in cache.ref_counts)}</b> "
            f"shared), <b>{cache.num_free_blocks}</b> free{cached} &middot; copy-on-write copies: "
            f"<b>{cache.cow_copies}</b>")
    if pc is not None:
        st = cache.prefix_cache_stats()
        text += (f" &middot; prefix cache: <b>{st['hit_tokens']}</b> of {st['queried_tokens']} prompt tokens "
                 f"found (all prompts so far), {st['evicted_blocks']} blocks evicted")
    return _el("div", f"{_NOTE};margin:0 0 4px", text, "pt-counts", role="counts", copies=cache.cow_copies)


def _legend(cache: PagedKVCache) -> str:
    """What every colour, hatching, border and ring of the view means."""
    def key(swatch: str, text: str) -> str:
        box = _el("span", f"display:inline-block;width:14px;height:12px;border-radius:2px;{swatch}")
        return _el("span", "display:inline-flex;gap:4px;align-items:center;margin-right:8px", f"{box} {text}")
    items = [key(f"background:{owner_color(s)}", f"seq {s} ({OWNER_NAMES[s % len(OWNER_NAMES)]})")
             for s in cache.tables]
    items += [key(f"background:{FREE_COLOR};border:1px dashed #BBB", "grey: free")]
    if cache.prefix_cache is not None:
        items.append(key(f"background:{CACHED_COLOR};border:1px solid {CACHED_EDGE}",
                         "green: free, content cached"))
    items += [key(_hatch("#555"), "hatched: held, not yet written"),
              key(f"border:{_SHARED}", "double border: shared by several tables (N refs)"),
              key(f"background:{_COPY};border:1px solid {_COPY_EDGE}", "amber: just copied (copy-on-write)"),
              key(f"border:3px solid {LOOKUP}", "pink ring: the lookup")]
    return _el("div", f"{_FLEX};{_NOTE};margin:0 0 4px", "<b>Legend:</b> " + " ".join(items), "pt-legend",
               role="legend")


def _pool_panel(cache: PagedKVCache, selected: int | None, hit: tuple[int, int] | None,
                copied: tuple[int, int] | None) -> str:
    """Every physical block in id order: a card of ``block_size`` slots, or a run of empty free blocks."""
    holders, labels, cards, run = cache.block_holders(), _slot_labels(cache), [], []
    for b in range(cache.num_blocks + 1):
        if b < cache.num_blocks and not holders[b] and not any(labels[b]):
            run.append(b)
            continue
        if run:
            cards.append(_free_run(run))
            run = []
        if b < cache.num_blocks:
            ring = hit[1] if hit is not None and hit[0] == b else None
            copy_of = copied[0] if copied is not None and copied[1] == b and holders[b] else None
            cards.append(_block_card(b, holders[b], labels[b], ring, selected in holders[b],
                                     cached=cache.is_cached(b), copy_of=copy_of))
    head = _el("div", _HEAD, f"Physical pool: {cache.num_blocks} blocks &times; {cache.block_size} slots")
    return _el("div", "flex:0 1 760px", head + _el("div", "display:flex;flex-wrap:wrap;gap:7px",
                                                    " ".join(cards), "pt-pool"))


def _free_run(blocks: Sequence[int]) -> str:
    """Consecutive free blocks that hold nothing: one card listing their ids."""
    chips = " ".join(_el("span", f"{_CHIP};background:{FREE_COLOR};color:#555;border:1px dashed #BBB", str(b),
                         "pt-block", block=b, holders="", refs=0, cached=0) for b in blocks)
    name = "block" if len(blocks) == 1 else "blocks"
    return _el("div", f"{_CARD};{_FLEX};flex-direction:row;border:2px dashed #C9C9C9;background:#FAFAFA",
               f"{_note(f'free, empty {name}:')} {chips}", "pt-run")


def _slot_labels(cache: PagedKVCache) -> list[list[str]]:
    """``labels[b][offset]``: ``s<seq>:t<pos>`` in a block one sequence holds, ``t<pos>`` in a shared one
    (its header names the holders) and in a cached free block (the tokens it keeps), ``""`` if empty."""
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
    """One physical block on one line: ``block 2 · seq 0, 1 · 2 refs`` over its slots.

    Args:
        holders: the sequences holding it (shared: a double border and ``N refs``); empty when free.
        labels: ``block_size`` slot labels (``""``: empty); ``ring``: the looked-up offset.
        cached: prefix caching can find its content (drawn green once free); ``copy_of``: just copied.
    """
    color = owner_color(holders[0]) if holders else CACHED_EDGE
    edge = _SHARED if len(holders) > 1 else f"2px solid {color if holders else CACHED_EDGE}"
    background = _COPY if copy_of is not None else "#fff" if holders else CACHED_COLOR
    cls = "pt-block" + " is-shared" * (len(holders) > 1) + " is-copy" * (copy_of is not None) + \
        " is-cached" * (not holders) + " is-lookup" * (ring is not None)
    cls += " is-selected" * (selected and ring is None)
    style = f"{_CARD};border:{edge};background:{background}"
    style += f";{_RING}" if ring is not None else f";box-shadow:0 0 0 2px {color}" if selected else ""
    head = _el("span", f"font-size:11px;color:#444;{_MONO}",
               f"<b style='color:#111'>block {block}</b> &middot; {_card_tag(holders, copy_of)}")
    slots = " ".join(_slot(i, text, color, i == ring) for i, text in enumerate(labels))
    return _el("div", style, f"{head} {_el('span', 'display:flex;gap:3px', slots)}", cls,
               f"held by seq {', '.join(map(str, holders))}" if len(holders) > 1 else "", block=block,
               holders=" ".join(map(str, holders)), refs=len(holders), cached=int(cached))


def _card_tag(holders: Sequence[int], copy_of: int | None) -> str:
    """``cached, free``, ``seq 1``, ``seq 0, 1 · 2 refs``, ``seq 1, copy of 2`` (over four holders: the
    first three and ``+N``)."""
    if not holders:
        return "free, content cached"
    shown = list(map(str, holders)) if len(holders) <= 4 else [*map(str, holders[:3]), f"+{len(holders) - 3}"]
    tag = "seq " + ", ".join(shown)
    if copy_of is not None:
        tag += f", <b style='color:{_COPY_EDGE}'>copy of {copy_of}</b>"
    if len(holders) > 1:
        tag += " &middot; " + _el("b", "color:#111", f"{len(holders)} refs", "pt-refs")
    return tag


def _slot(offset: int, label: str, color: str, ring: bool) -> str:
    """One slot: filled in its holder's colour, or hatched (held, not yet written)."""
    look = f"background:{color};border:1px solid {color};color:#fff" if label else _hatch(color)
    cls = "pt-slot is-filled" if label else "pt-slot"
    return _el("span", f"{_SLOT};{look}" + (f";{_RING}" if ring else ""), label or "&middot;",
               cls + " is-lookup" * ring, slot=offset)


def _free_panel(cache: PagedKVCache) -> str:
    """The free stack, top first, then (prefix caching) the cached free blocks in eviction order."""
    free = cache.free[::-1]
    chips = [_el("span", f"{_CHIP};background:#fff;color:#333;border:" + ("2px solid #111;font-weight:700"
             if i == 0 else "1px solid #BBB"), str(b), "pt-chip is-top" if i == 0 else "pt-chip", free=b)
             for i, b in enumerate(free)]
    lead = _note("top (popped next) &rarr;" if free else "empty: no new block can be handed out")
    out = _el("div", _HEAD, f"Free stack: {len(free)} blocks") + \
        _el("div", _FLEX, f"{lead} {' '.join(chips)}", "pt-free-stack", role="free-stack")
    if cache.prefix_cache is None:
        return out
    queue = list(cache.prefix_cache.free_queue)
    style = f"{_CHIP};background:{CACHED_COLOR};color:#222;border:1px solid {CACHED_EDGE}"
    chips = [_el("span", style, str(b), "pt-chip", queued=b) for b in queue]
    lead = _note("evicted first, when the stack is empty &rarr;" if queue else
                 "none: a freed full block waits here with its content")
    return out + _el("div", _HEAD, f"Cached, free: {len(queue)} blocks") + \
        _el("div", _FLEX, f"{lead} {' '.join(chips)}", "pt-cached-queue", role="cached-queue")


def _tables_panel(cache: PagedKVCache, entry: tuple[int, int] | None) -> str:
    """One row per sequence: ``seq 0 · len 7 · [5, 2]``, shared entries double-bordered."""
    rows = [_el("div", _HEAD, "Block tables")]
    if not cache.tables:
        rows.append(_el("div", _NOTE, "no sequences yet: press <i>Add sequence</i>"))
    for s, table in cache.tables.items():
        color, n = owner_color(s), cache.seq_lens[s]
        entries = ", ".join(_chip(color, b, (s, i) == entry, cache.ref_counts[b] > 1, entry=i)
                            for i, b in enumerate(table))
        dot = _el("span", f"width:10px;height:10px;border-radius:5px;background:{color}")
        rows.append(_el("div", f"{_FLEX};gap:5px;margin:0 0 4px;white-space:nowrap",
                        f"{dot} <b>seq {s}</b> {_note(f'len {n}')} [{entries}]", "pt-table", seq=s, len=n))
    return "".join(rows)


def _lookup_panel(block_size: int, lookup: tuple[int, int], block: int) -> str:
    """The arithmetic of one lookup: position -> logical block -> physical block, offset."""
    (s, pos), bs = lookup, block_size
    logical, offset = pos // bs, pos % bs
    text = (f"<b>Lookup of seq {s}, position {pos}:</b> logical block <code style='{_CODE}'>{pos} // {bs} = "
            f"{logical}</code> &rarr; table[{logical}] = <b>physical block {block}</b> &rarr; offset "
            f"<code style='{_CODE}'>{pos} % {bs} = {offset}</code> &rarr; slot ({block}, {offset})")
    return _el("div", _PANEL, text, "pt-lookup", role="lookup")


def _reads_panel(cache: PagedKVCache, seq: int) -> str:
    """The slots one decode step of ``seq`` reads, in position order (``block.offset``)."""
    n, color, bs = cache.seq_lens[seq], owner_color(seq), cache.block_size
    chips = []
    for pos in range(n):
        if pos and pos % bs == 0:  # the walk jumps to the next table entry, wherever that block lives
            chips.append(_note("&rarr;"))
        chips.append(_chip(color, f"{cache.tables[seq][pos // bs]}.{pos % bs}", read=pos))
    head = _el("b", "", f"A decode step for seq {seq} reads {n} slots, in this order (block.offset):")
    body = " ".join(chips) or _note("nothing yet: the sequence holds no tokens")
    return _el("div", f"{_PANEL};{_FLEX}", f"{head} {body}", "pt-reads", role="reads")
