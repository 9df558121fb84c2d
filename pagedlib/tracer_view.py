"""The tracer's view: ``render_html(cache, ...)``, a pure function from a ``PagedKVCache``'s state to one
HTML string, built by one small function per panel (log, pool, free stack, block tables, lookup, decode
reads). ``BlockTableTracer`` (``pagedlib.tracer``) shows it in a widget.

Same state, same HTML (no random ids), so tests and nbval can compare it. Styles are inline: an untrusted
notebook strips ``<style>`` elements and ``data-*`` attributes from stored outputs but keeps inline styles.
The classes and ``data-*`` attributes (``data-block``, ``data-holders``, ``data-slot``, ``data-free``,
``data-seq``, ``data-len``, ``data-entry``, ``data-read``, ``data-role``) are for tests reading the live
widget.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from pagedlib.cache import PagedKVCache
from pagedlib.checks import as_int
from pagedlib.colors import FREE_COLOR, owner_color

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


def _chip(color: str, text: object, highlight: bool = False, title: str = "", **data: object) -> str:
    """A small coloured label (a block id in a table, a slot in the read order)."""
    style = f"{_CHIP};background:{color};color:#fff" + (f";{_LOOKUP}" if highlight else "")
    return _el("span", style, str(text), "pt-chip is-lookup" if highlight else "pt-chip", title, **data)


def render_html(
    cache: PagedKVCache,
    *,
    selected: int | None = None,
    lookup: tuple[int, int] | None = None,
    log: str = "",
    error: str = "",
) -> str:
    """The tracer's view of ``cache`` as one self-contained HTML string (a pure function of its arguments).

    Args:
        cache: the ``PagedKVCache`` to draw (integer sequence ids; at most ``MAX_SLOTS`` slots and
            ``MAX_SEQUENCES`` sequences, else ``ValueError``).
        selected: the sequence the buttons act on; its blocks are outlined and its decode reads listed.
        lookup: ``(seq_id, pos)`` whose path ``pos -> logical block -> physical block, offset`` is drawn.
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
    side = _free_stack_panel(cache.free) + _tables_panel(cache, selected, lookup_entry)
    parts = [
        _el("div", _LOG, html.escape(log or "Ready."), "pt-log", role="log"),
        _el("div", _ERROR, html.escape(error), "pt-error", role="error") if error else "",
        _el("div", _ROW, _pool_panel(cache, selected, hit)
            + _el("div", "flex:1 1 200px;min-width:200px", side)),
        _lookup_panel(cache.block_size, lookup, hit[0]) if lookup is not None and hit is not None else "",
        _reads_panel(cache, selected) if selected in cache.tables else "",
    ]
    return _el("div", _ROOT, "".join(parts), "pt-tracer")


def _pool_panel(cache: PagedKVCache, selected: int | None, hit: tuple[int, int] | None) -> str:
    """Every physical block, in id order, as a card of ``block_size`` slots, four cards a row."""
    bs = cache.block_size
    holders: list[list[int]] = [[] for _ in range(cache.num_blocks)]  # [b]: the sequences holding b
    labels = [[""] * bs for _ in range(cache.num_blocks)]             # [b][offset]: "s<seq>:t<pos>"
    for s, table in cache.tables.items():
        for b in table:
            holders[b].append(s)
        for pos in range(cache.seq_lens[s]):
            labels[table[pos // bs]][pos % bs] = f"s{s}:t{pos}"
    cards = []
    for b in range(cache.num_blocks):
        mark = "lookup" if hit is not None and hit[0] == b else "selected" if selected in holders[b] else ""
        cards.append(_block_card(b, holders[b], labels[b], mark, hit[1] if mark == "lookup" else None))
    grid = "display:grid;gap:7px;grid-template-columns:repeat(4,max-content)"
    head = f"Physical pool: {cache.num_blocks} blocks &times; {bs} slots"
    return _el("div", "", _el("div", _HEAD, head) + _el("div", grid, "".join(cards), "pt-pool"))


def _block_card(block: int, holders: Sequence[int], labels: Sequence[str], mark: str = "",
                hit_offset: int | None = None) -> str:
    """One physical block: a header (its id, who holds it) over its slots.

    Args:
        holders: the sequences holding the block, empty when it is free. With more than one (a shared
            block), the header lists them and shows the reference count.
        labels: ``block_size`` slot labels (``""``: empty slot).
        mark: ``"lookup"`` (the block of the highlighted lookup), ``"selected"`` (held by the selected
            sequence) or ``""``; ``hit_offset`` is the looked-up slot.
    """
    color = owner_color(holders[0]) if holders else FREE_COLOR
    style = f"{_BLOCK};border:2px solid {color};background:#fff" if holders else \
        f"{_BLOCK};border:2px solid #C9C9C9;background:{FREE_COLOR}"
    cls = "pt-block"
    if mark == "lookup":
        cls, style = "pt-block is-lookup", f"{style};box-shadow:0 0 0 3px #111"
    elif mark == "selected":
        cls, style = "pt-block is-selected", f"{style};box-shadow:0 0 0 2px {color}"
    tag = "free" if not holders else "seq " + ", ".join(map(str, holders))
    tag += f" ({len(holders)} refs)" if len(holders) > 1 else ""
    head = _el("div", _BHEAD, f"<b style='color:#111'>block {block}</b><span>{tag}</span>")
    slots = "".join(_slot(i, text, color, not holders, i == hit_offset) for i, text in enumerate(labels))
    return _el("div", style, head + _el("div", _SLOTS, slots), cls, block=block,
               holders=" ".join(map(str, holders)))


def _slot(offset: int, label: str, color: str, free: bool, hit: bool) -> str:
    """One slot: filled in its sequence's colour, or dashed and empty."""
    if label:
        cls, style = "pt-slot is-filled", f"{_SLOT};background:{color};border:1px solid {color};color:#fff"
    else:
        empty = "#F7F7F7" if free else "#fff"
        cls, style = "pt-slot", f"{_SLOT};background:{empty};border:1px dashed #BBB;color:#999"
    if hit:
        cls, style = cls + " is-lookup", f"{style};{_LOOKUP}"
    return _el("div", style, label or "&middot;", cls, slot=offset)


def _free_stack_panel(free: Sequence[int]) -> str:
    """The free stack, top first: the next append that needs a block pops the leftmost entry."""
    chips = []
    for i, b in enumerate(reversed(free)):
        border = "2px solid #111;font-weight:700" if i == 0 else "1px solid #BBB"
        style = f"{_CHIP};background:#fff;color:#333;border:{border}"
        chips.append(_el("span", style, str(b), "pt-chip is-top" if i == 0 else "pt-chip", free=b))
    chips.append(_note("&larr; top: popped next" if free else "empty: no new block can be handed out"))
    head = _el("div", _HEAD, f"Free stack: {len(free)}, top first")
    return head + _el("div", _CHIPS, "".join(chips), "pt-free-stack", role="free-stack")


def _tables_panel(cache: PagedKVCache, selected: int | None, lookup_entry: tuple[int, int] | None) -> str:
    """One row per sequence: its colour, length and ``[physical block ids]`` in logical order."""
    rows = [_el("div", _HEAD, "Block tables")]
    if not cache.tables:
        rows.append(_el("div", _NOTE, "no sequences yet: press <i>Add sequence</i>"))
    for s, table in cache.tables.items():
        color, n = owner_color(s), cache.seq_lens[s]
        entries = "".join(_chip(color, b, (s, i) == lookup_entry, f"logical block {i}", entry=i)
                          for i, b in enumerate(table))
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
