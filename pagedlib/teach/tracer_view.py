"""The tracer's view: ``render_html(cache, ...)``, a pure function from a ``PagedKVCache``'s state to one
HTML string, built by one small function per panel (log, counters, pool, free blocks, block tables, lookup,
decode reads). ``BlockTableTracer`` (``pagedlib.teach.tracer``) shows it in a widget.

Sharing (notebook 06) is drawn from the cache's public state: a block several tables hold has a black
border and a ``×N`` badge with its holders (``block_holders()``, ``ref_counts``); the block a copy-on-write
just made is tinted amber; a free block whose content prefix caching keeps (``prefix_cache.free_queue``)
is green (``CACHED_COLOR``) and still shows its tokens.

Same state, same HTML (no random ids), so tests and nbval can compare it. Styles are inline: an untrusted
notebook strips ``<style>`` elements and ``data-*`` attributes from stored outputs but keeps inline styles.
The classes and ``data-*`` attributes (``data-block``, ``data-holders``, ``data-refs``, ``data-cached``,
``data-slot``, ``data-free``, ``data-queued``, ``data-seq``, ``data-len``, ``data-entry``, ``data-read``,
``data-copies``, ``data-role``) are for tests reading the live widget.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from pagedlib.checks import as_int
from pagedlib.core.cache import PagedKVCache
from pagedlib.teach.colors import CACHED_COLOR, CACHED_EDGE, FREE_COLOR, owner_color

__all__ = ["MAX_SEQUENCES", "MAX_SLOTS", "render_html"]

# The view draws every slot and every sequence; beyond these it refuses (a 20,000-block pool would be
# tens of MiB of HTML per click). The largest view allowed is ~0.3 MiB.
MAX_SLOTS = 512       # num_blocks * block_size
MAX_SEQUENCES = 32    # live sequences


_MONO = "font-family:Menlo,Consolas,DejaVu Sans Mono,monospace"
_ROOT = ("font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;font-size:13px;color:#222;"
         "line-height:1.35;max-width:1060px")
_LOG = "background:#F4F6FA;border-left:4px solid #4C72B0;padding:6px 10px;margin:4px 0 8px"
_ERROR = ("background:#FDECEA;border-left:4px solid #C44E52;color:#8A1F24;padding:6px 10px;margin:4px 0 8px;"
          "font-weight:600")
_ROW = "display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start"
_HEAD = ("font-weight:700;font-size:12px;text-transform:uppercase;letter-spacing:.04em;color:#555;"
         "margin:0 0 5px")
_BLOCK = "border-radius:6px;padding:3px"
_BHEAD = "display:flex;justify-content:space-between;font-size:11px;color:#444;padding:0 2px 2px"
_SLOTS = f"display:flex;gap:3px;font-size:11px;{_MONO};text-align:center"  # inherited by the slots
_SLOT = "width:39px;height:24px;line-height:22px;border-radius:3px;box-sizing:border-box"
_CHIPS = "display:flex;flex-wrap:wrap;gap:3px;align-items:center;margin-bottom:10px"
_CHIP = f"min-width:22px;padding:2px 5px;border-radius:4px;text-align:center;font-size:12px;{_MONO}"
_NOTE = "font-size:11px;color:#666"
_TABLE = ("display:flex;gap:5px;align-items:center;margin:0 0 4px;padding:2px 4px;border-radius:4px;"
          "white-space:nowrap")
_PANEL = "margin-top:8px;padding:6px 10px;border:1px solid #DDD;border-radius:6px"
_CODE = f"{_MONO};background:#F1F1F1;padding:0 3px;border-radius:3px"
_LOOKUP = "outline:3px solid #111"  # the highlighted lookup path
_SHARED = "2px solid #111"           # the border of a block several tables hold
_BADGE = "background:#111;color:#fff;border-radius:3px;padding:0 4px;margin-left:4px;font-weight:700"
_COPY = "#FFF1C2"                    # the background of the block a copy-on-write just made
_COPY_EDGE = "#E0A800"


def _el(tag: str, style: str, body: str = "", cls: str = "", title: str = "", **data: object) -> str:
    """``<tag class=.. data-..=.. title=.. style=..>body</tag>``; ``data`` keys lose the ``data-`` prefix.
    Attribute values are ints and fixed words, never user text (which is escaped where it is shown)."""
    attrs = f" class='{cls}'" if cls else ""
    for k, v in data.items():
        attrs += f" data-{k}='{v}'"
    if title:
        attrs += f" title='{title}'"
    return f"<{tag}{attrs} style='{style}'>{body}</{tag}>"


def _note(text: str) -> str:
    return _el("span", _NOTE, text)


def _code(text: str) -> str:
    return _el("code", _CODE, text)


def _chip(color: str, text: object, highlight: bool = False, title: str = "", shared: bool = False,
          **data: object) -> str:
    """A small coloured label (a block id in a table, a slot in the read order); ``shared``: ringed."""
    style = f"{_CHIP};background:{color};color:#fff" + (f";{_LOOKUP}" if highlight else "")
    if shared:
        style, title = f"{style};box-shadow:inset 0 0 0 2px #111", f"{title}, shared"
    cls = "pt-chip" + (" is-lookup" if highlight else "") + (" is-shared" if shared else "")
    return _el("span", style, str(text), cls, title, **data)


def render_html(
    cache: PagedKVCache,
    *,
    selected: int | None = None,
    lookup: tuple[int, int] | None = None,
    copied: tuple[int, int] | None = None,
    log: str = "",
    error: str = "",
) -> str:
    """The tracer's view of ``cache`` as one self-contained HTML string (a pure function of its arguments).

    Args:
        cache: the ``PagedKVCache`` to draw (integer sequence ids; at most ``MAX_SLOTS`` slots and
            ``MAX_SEQUENCES`` sequences, else ``ValueError``).
        selected: the sequence the buttons act on; its blocks are outlined and its decode reads listed.
        lookup: ``(seq_id, pos)`` whose path ``pos -> logical block -> physical block, offset`` is drawn.
        copied: ``(original, copy)`` block ids of the copy-on-write the last action made: the copy is
            tinted amber.
        log, error: the explanation of the last operation and the last error message (plain text).
    """
    slots, seqs = cache.num_blocks * cache.block_size, len(cache.tables)
    if slots > MAX_SLOTS or seqs > MAX_SEQUENCES:
        raise ValueError(f"render_html draws every slot and sequence: at most {MAX_SLOTS} slots and "
                         f"{MAX_SEQUENCES} sequences, got a cache with {slots} slots and {seqs} sequences")
    for s in cache.tables:
        as_int("sequence id", s)  # ints only: they are printed as they are
    hit = cache.slot(*lookup) if lookup is not None else None  # (block, offset) of the lookup
    lookup_entry = (lookup[0], lookup[1] // cache.block_size) if lookup is not None else None
    side = _free_panel(cache) + _tables_panel(cache, selected, lookup_entry)
    parts = [
        _el("div", _LOG, html.escape(log or "Ready."), "pt-log", role="log"),
        _el("div", _ERROR, html.escape(error), "pt-error", role="error") if error else "",
        _counts_panel(cache),
        _el("div", _ROW, _pool_panel(cache, selected, hit, copied)
            + _el("div", "flex:1 1 200px;min-width:200px", side)),
        _lookup_panel(cache.block_size, lookup, hit[0]) if lookup is not None and hit is not None else "",
        _reads_panel(cache, selected) if selected in cache.tables else "",
    ]
    return _el("div", _ROOT, "".join(parts), "pt-tracer")


def _counts_panel(cache: PagedKVCache) -> str:
    """One line of counters: blocks used / shared / free / cached, copies made, prefix-cache hits."""
    shared = sum(c > 1 for c in cache.ref_counts)
    pc = cache.prefix_cache
    cached = f" (<b>{len(pc.free_queue)}</b> cached)" if pc is not None else ""
    text = (f"<b>{cache.num_used_blocks}</b> blocks used (<b>{shared}</b> shared), "
            f"<b>{cache.num_free_blocks}</b> free{cached} &middot; "
            f"copy-on-write copies: <b>{cache.cow_copies}</b>")
    if pc is not None:
        st = cache.prefix_cache_stats()
        text += (f" &middot; prefix cache: <b>{st['hit_tokens']}</b> of {st['queried_tokens']} prompt tokens "
                 f"found, {st['evicted_blocks']} blocks evicted")
    return _el("div", f"{_NOTE};margin:0 0 6px", text, "pt-counts", role="counts", copies=cache.cow_copies)


def _pool_panel(cache: PagedKVCache, selected: int | None, hit: tuple[int, int] | None,
                copied: tuple[int, int] | None) -> str:
    """Every physical block, in id order, as a card of ``block_size`` slots, four cards a row."""
    holders, labels = cache.block_holders(), _slot_labels(cache)
    cards = []
    for b in range(cache.num_blocks):
        mark = "lookup" if hit is not None and hit[0] == b else "selected" if selected in holders[b] else ""
        copy_of = copied[0] if copied is not None and copied[1] == b and holders[b] else None
        cards.append(_block_card(b, holders[b], labels[b], mark, hit[1] if mark == "lookup" else None,
                                 cached=cache.is_cached(b), copy_of=copy_of))
    grid = "display:grid;gap:7px;grid-template-columns:repeat(4,max-content)"
    head = f"Physical pool: {cache.num_blocks} blocks &times; {cache.block_size} slots"
    return _el("div", "", _el("div", _HEAD, head) + _el("div", grid, "".join(cards), "pt-pool"))


def _slot_labels(cache: PagedKVCache) -> list[list[str]]:
    """``labels[b][offset]``: ``s<seq>:t<pos>`` for a block one sequence holds, ``t<pos>`` for a shared one
    (the header names its holders) and for a cached free block (the tokens it keeps), ``""`` if empty."""
    bs, holders = cache.block_size, cache.ref_counts
    labels = [[""] * bs for _ in range(cache.num_blocks)]
    for s, table in cache.tables.items():
        for pos in range(cache.seq_lens[s]):
            b = table[pos // bs]
            labels[b][pos % bs] = f"t{pos}" if holders[b] > 1 else f"s{s}:t{pos}"
    for b in cache.prefix_cache.free_queue if cache.prefix_cache is not None else ():
        key, depth = cache.prefix_cache.keys[b], 0  # depth: how many full blocks come before this one
        parent = key.parent
        while parent is not None:
            depth, parent = depth + 1, parent.parent
        labels[b] = [f"t{depth * bs + i}" for i in range(len(key.tokens))]
    return labels


def _block_card(block: int, holders: Sequence[int], labels: Sequence[str], mark: str = "",
                hit_offset: int | None = None, *, cached: bool = False, copy_of: int | None = None) -> str:
    """One physical block: a header (its id, who holds it) over its slots.

    Args:
        holders: the sequences holding the block, empty when it is free. With more than one (a shared
            block) the card gets a black border and the header a ``×N`` badge, N the reference count.
        labels: ``block_size`` slot labels (``""``: empty slot).
        mark: ``"lookup"`` (the block of the highlighted lookup), ``"selected"`` (held by the selected
            sequence) or ``""``; ``hit_offset`` is the looked-up slot.
        cached: prefix caching can find the block's content; a free cached block is drawn green.
        copy_of: the block this one was just copied from (copy-on-write): tinted amber.
    """
    color, cls, style = _card_look(holders, cached and not holders, copy_of is not None)
    if mark == "lookup":
        cls, style = f"{cls} is-lookup", f"{style};box-shadow:0 0 0 3px #111"
    elif mark == "selected":
        cls, style = f"{cls} is-selected", f"{style};box-shadow:0 0 0 2px {color}"
    head = _el("div", _BHEAD, f"<b style='color:#111'>block {block}</b>"
               f"<span>{_card_tag(holders, cached, copy_of)}</span>")
    slots = "".join(_slot(i, text, color, not holders, i == hit_offset) for i, text in enumerate(labels))
    title = f"held by seq {', '.join(map(str, holders))}" if len(holders) > 1 else ""
    return _el("div", style, head + _el("div", _SLOTS, slots), cls, title, block=block,
               holders=" ".join(map(str, holders)), refs=len(holders), cached=int(cached))


def _card_look(holders: Sequence[int], cached_free: bool, copy: bool) -> tuple[str, str, str]:
    """``(slot colour, classes, style)`` of a block card: owned, shared, copied, free or cached free."""
    if not holders:
        color = CACHED_EDGE if cached_free else FREE_COLOR
        background, edge = (CACHED_COLOR, CACHED_EDGE) if cached_free else (FREE_COLOR, "#C9C9C9")
        cls = "pt-block is-cached" if cached_free else "pt-block"
        return color, cls, f"{_BLOCK};border:2px solid {edge};background:{background}"
    color, cls = owner_color(holders[0]), "pt-block"
    border = f"2px solid {color}"
    if len(holders) > 1:
        cls, border = f"{cls} is-shared", _SHARED
    if copy:
        cls = f"{cls} is-copy"
    return color, cls, f"{_BLOCK};border:{border};background:{_COPY if copy else '#fff'}"


def _card_tag(holders: Sequence[int], cached: bool, copy_of: int | None) -> str:
    """The right side of a card's header: ``free``, ``cached, free``, ``seq 1``, ``seq 0, 1 ×2`` or
    ``seq 1, copy of 2`` (more than four holders: the first three and ``+N``)."""
    if not holders:
        return "cached, free" if cached else "free"
    shown = list(map(str, holders)) if len(holders) <= 4 else [*map(str, holders[:3]), f"+{len(holders) - 3}"]
    tag = "seq " + ", ".join(shown)
    if copy_of is not None:
        tag += f", <b style='color:{_COPY_EDGE}'>copy of {copy_of}</b>"
    if len(holders) > 1:
        tag += _el("span", _BADGE, f"&times;{len(holders)}", "pt-refs")
    return tag


def _slot(offset: int, label: str, color: str, free: bool, hit: bool) -> str:
    """One slot: filled in its sequence's colour (green for a cached free block), or dashed and empty."""
    if label:
        cls, style = "pt-slot is-filled", f"{_SLOT};background:{color};border:1px solid {color};color:#fff"
    else:
        empty = "#F7F7F7" if free else "#fff"
        cls, style = "pt-slot", f"{_SLOT};background:{empty};border:1px dashed #BBB;color:#999"
    if hit:
        cls, style = cls + " is-lookup", f"{style};{_LOOKUP}"
    return _el("div", style, label or "&middot;", cls, slot=offset)


def _free_panel(cache: PagedKVCache) -> str:
    """The free stack, top first (the next append that needs a block pops the leftmost entry), then, with
    prefix caching, the cached free blocks in eviction order (taken only when the stack is empty)."""
    free = cache.free
    chips = []
    for i, b in enumerate(reversed(free)):
        border = "2px solid #111;font-weight:700" if i == 0 else "1px solid #BBB"
        style = f"{_CHIP};background:#fff;color:#333;border:{border}"
        chips.append(_el("span", style, str(b), "pt-chip is-top" if i == 0 else "pt-chip", free=b))
    chips.append(_note("&larr; top: popped next" if free else "empty: no new block can be handed out"))
    out = _el("div", _HEAD, f"Free stack: {len(free)}, top first") + \
        _el("div", _CHIPS, "".join(chips), "pt-free-stack", role="free-stack")
    if cache.prefix_cache is None:
        return out
    queue = list(cache.prefix_cache.free_queue)
    style = f"{_CHIP};background:{CACHED_COLOR};color:#222;border:1px solid {CACHED_EDGE}"
    chips = [_el("span", style, str(b), "pt-chip", queued=b) for b in queue]
    chips.append(_note("&larr; evicted first, when the stack is empty" if queue else
                       "none: a freed full block waits here with its content"))
    return out + _el("div", _HEAD, f"Cached, free: {len(queue)}, eviction order") + \
        _el("div", _CHIPS, "".join(chips), "pt-cached-queue", role="cached-queue")


def _tables_panel(cache: PagedKVCache, selected: int | None, lookup_entry: tuple[int, int] | None) -> str:
    """One row per sequence: its colour, length and ``[physical block ids]`` in logical order; an entry
    naming a shared block is ringed in black."""
    rows = [_el("div", _HEAD, "Block tables")]
    if not cache.tables:
        rows.append(_el("div", _NOTE, "no sequences yet: press <i>Add sequence</i>"))
    for s, table in cache.tables.items():
        color, n = owner_color(s), cache.seq_lens[s]
        entries = "".join(_chip(color, b, (s, i) == lookup_entry, f"logical block {i}",
                                cache.ref_counts[b] > 1, entry=i) for i, b in enumerate(table))
        dot = _el("span", f"width:10px;height:10px;border-radius:5px;background:{color}")
        body = f"{dot}<b>seq {s}</b>{_note(f'len {n}')}[{entries}]"
        is_selected = s == selected
        rows.append(_el("div", f"{_TABLE};background:#F4F6FA" if is_selected else _TABLE, body,
                        "pt-table is-selected" if is_selected else "pt-table", seq=s, len=n))
    return "".join(rows)


def _lookup_panel(block_size: int, lookup: tuple[int, int], block: int) -> str:
    """The arithmetic of one lookup: position -> logical block -> physical block, offset."""
    (s, pos), bs = lookup, block_size
    logical, offset = pos // bs, pos % bs
    text = (f"<b>Lookup of seq {s}, position {pos}:</b> logical block {_code(f'{pos} // {bs} = {logical}')} "
            f"&rarr; table[{logical}] = <b>physical block {block}</b> &rarr; offset "
            f"{_code(f'{pos} % {bs} = {offset}')} &rarr; slot {_code(f'(block {block}, offset {offset})')}")
    return _el("div", _PANEL, text, "pt-lookup", role="lookup")


def _reads_panel(cache: PagedKVCache, seq: int) -> str:
    """The slots one decode step of ``seq`` reads, in position order (``block.offset``)."""
    n, color, bs = cache.seq_lens[seq], owner_color(seq), cache.block_size
    chips = []
    for pos in range(n):
        if pos and pos % bs == 0:  # the walk jumps to the next table entry, wherever that block lives
            chips.append(_note("&rarr;"))
        block = cache.tables[seq][pos // bs]
        chips.append(_chip(color, f"{block}.{pos % bs}", title=f"position {pos}", read=pos))
    if n == 0:
        chips.append(_note("nothing yet: the sequence holds no tokens"))
    head = f"<b>A decode step for seq {seq} reads {n} slots, in this order</b> (block.offset):"
    return _el("div", _PANEL, head + _el("div", f"{_CHIPS};margin:4px 0 0", "".join(chips)), "pt-reads",
               role="reads")
