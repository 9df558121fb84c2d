"""``BlockTableTracer``: an ipywidgets view of a real ``PagedKVCache`` (notebook 03).

Every button calls the cache's own methods (``add_sequence``, ``append_token``, ``append_tokens``,
``free_sequence``, ``slot``); the tracer only remembers what the reader is looking at (the selected sequence,
the highlighted lookup, the last log line or error) and turns the cache's state into HTML with
``render_html``, a pure function. That HTML is stable (no random ids) so tests and nbval can compare it:

- each physical block is ``<div data-block="<id>" data-owner="<seq_id>|free">`` holding ``block_size``
  slots ``<div data-slot="<offset>">`` labelled ``s<seq>:t<pos>``;
- the free stack is ``data-role="free-stack"`` with entries ``data-free="<id>"``, top first (``is-top``);
- each block table is ``data-seq="<id>" data-len="<n>"`` with entries ``data-entry="<logical block>"``;
- the highlighted lookup carries the class ``is-lookup`` (slot, block and table entry);
- ``data-role`` marks the ``log``, ``error``, ``lookup`` and ``reads`` (decode read order) panels.

K and V are real tensors in the cache; each token is written with ``k = v = its position`` so that what a
slot holds is easy to check, while the picture needs only the bookkeeping.
"""

from __future__ import annotations

import html as _html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ipywidgets as widgets
import torch

from pagedlib.cache import OutOfBlocksError, PagedKVCache
from pagedlib.plots import FREE_COLOR, owner_color

__all__ = ["BlockTableTracer", "TracerError", "render_html", "SCENARIO"]


class TracerError(ValueError):
    """A request the tracer cannot carry out (no sequence selected, position out of range, bad N)."""


# The scripted scenario that Play animates: two sequences interleave, one is freed, a third reuses its
# blocks. Each step is (operation, sequence id or None, token count, narration); the narration's block
# boundaries assume block_size 4, the default.
SCENARIO: tuple[tuple[str, int | None, int, str], ...] = (
    ("add", None, 0, "a request arrives: seq 0 starts with an empty table"),
    ("append", 0, 6, "its prompt of 6 tokens is written in one go"),
    ("add", None, 0, "a second request arrives: seq 1"),
    ("append", 1, 5, "its prompt of 5 tokens"),
    ("append", 0, 1, "decode step: seq 0 gets one token"),
    ("append", 1, 1, "decode step: seq 1 gets one token"),
    ("append", 0, 1, "decode step: seq 0 again"),
    ("append", 1, 1, "decode step: seq 1 again"),
    ("append", 0, 1, "decode step: seq 0 crosses a block boundary"),
    ("append", 1, 1, "decode step: seq 1 fills its last block"),
    ("free", 1, 0, "seq 1 finishes: all its blocks go back on the free stack"),
    ("add", None, 0, "a third request arrives: seq 2"),
    ("append", 2, 8, "its 8-token prompt reuses the blocks seq 1 just gave back"),
    ("append", 0, 1, "decode step: seq 0"),
    ("append", 2, 1, "decode step: seq 2 crosses a block boundary"),
)


@dataclass(frozen=True)
class _Lookup:
    seq_id: int
    pos: int


def _esc(text: object) -> str:
    return _html.escape(str(text), quote=True)


# Inline styles only: JupyterLab strips <style> elements (and data-* attributes) from the outputs of an
# untrusted notebook but keeps inline styles, so the committed snapshots look the same to every reader.
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


def _chip(color: str, text: object, attrs: str = "", highlight: bool = False) -> str:
    """A small coloured label (a block id in a table, a slot in the read order)."""
    cls, look = "pt-chip", f"{_CHIP};background:{color};color:#fff"
    if highlight:
        cls, look = "pt-chip is-lookup", f"{look};{_LOOKUP}"
    return f"<span class='{cls}' {attrs} style='{look}'>{text}</span>"


def _code(text: str) -> str:
    return f"<code style='{_CODE}'>{text}</code>"


def render_html(
    cache: PagedKVCache,
    *,
    selected: int | None = None,
    lookup: tuple[int, int] | None = None,
    log: str = "",
    error: str = "",
    columns: int = 4,
) -> str:
    """The tracer's view of ``cache`` as one self-contained HTML string (a pure function of its arguments).

    Args:
        cache: the ``PagedKVCache`` to draw (integer sequence ids).
        selected: the sequence the buttons act on; its blocks are outlined and its decode reads listed.
        lookup: ``(seq_id, pos)`` whose path ``pos -> logical block -> physical block, offset`` is drawn.
        log, error: the explanation of the last operation and the last error message (plain text).
        columns: blocks per row in the pool grid.
    """
    bs = cache.block_size
    owners = cache.block_owners()
    labels: dict[tuple[int, int], str] = {}  # (block, offset) -> "s<seq>:t<pos>"
    for s, table in cache.tables.items():
        for pos in range(cache.seq_lens[s]):
            labels[(table[pos // bs], pos % bs)] = f"s{s}:t{pos}"
    hit = cache.slot(*lookup) if lookup is not None else None

    parts = [f"<div class='pt-tracer' style='{_ROOT}'>",
             f"<div class='pt-log' data-role='log' style='{_LOG}'>{_esc(log or 'Ready.')}</div>"]
    if error:
        parts.append(f"<div class='pt-error' data-role='error' style='{_ERROR}'>{_esc(error)}</div>")
    parts.append(f"<div style='{_ROW}'><div><div style='{_HEAD}'>Physical pool: {cache.num_blocks} blocks "
                 f"&times; {bs} slots</div><div class='pt-pool' "
                 f"style='display:grid;gap:7px;grid-template-columns:repeat({columns},max-content)'>")
    for b, owner in enumerate(owners):
        cls, look = "pt-block", _BLOCK
        if owner is None:
            color = FREE_COLOR
            look += f";border:2px solid #C9C9C9;background:{FREE_COLOR}"
        else:
            color = owner_color(owner)
            look += f";border:2px solid {color};background:#fff"
        if hit is not None and hit.block == b:
            cls, look = cls + " is-lookup", look + ";box-shadow:0 0 0 3px #111"
        elif owner is not None and owner == selected:
            cls, look = cls + " is-selected", look + f";box-shadow:0 0 0 2px {color}"
        tag = "free" if owner is None else f"seq {owner}"
        data_owner = _esc("free" if owner is None else owner)
        parts.append(f"<div class='{cls}' data-block='{b}' data-owner='{data_owner}' style='{look}'>"
                     f"<div style='{_BHEAD}'><b style='color:#111'>block {b}</b>"
                     f"<span>{_esc(tag)}</span></div><div style='{_SLOTS}'>")
        for off in range(bs):
            label = labels.get((b, off), "")
            if label:
                scls = "pt-slot is-filled"
                slook = f"{_SLOT};background:{color};border:1px solid {color};color:#fff"
            else:
                empty = "#F7F7F7" if owner is None else "#fff"
                scls, slook = "pt-slot", f"{_SLOT};background:{empty};border:1px dashed #BBB;color:#999"
            if hit is not None and (hit.block, hit.offset) == (b, off):
                scls, slook = scls + " is-lookup", f"{slook};{_LOOKUP}"
            text = _esc(label) or "&middot;"
            parts.append(f"<div class='{scls}' data-slot='{off}' style='{slook}'>{text}</div>")
        parts.append("</div></div>")
    parts.append("</div></div><div style='flex:1 1 200px;min-width:200px'>")

    # the free stack, top first: the next append that needs a block pops the leftmost entry
    parts.append(f"<div style='{_HEAD}'>Free stack: {len(cache.free)}, top first</div>"
                 f"<div class='pt-free-stack' data-role='free-stack' style='{_CHIPS}'>")
    for i, b in enumerate(reversed(cache.free)):
        border = "2px solid #111;font-weight:700" if i == 0 else "1px solid #BBB"
        parts.append(f"<span class='pt-chip{' is-top' if i == 0 else ''}' data-free='{b}' "
                     f"style='{_CHIP};background:#fff;color:#333;border:{border}'>{b}</span>")
    parts.append(f"<span style='{_NOTE}'>&larr; top: popped next</span>" if cache.free
                 else f"<span style='{_NOTE}'>empty: no new block can be handed out</span>")
    parts.append(f"</div><div style='{_HEAD}'>Block tables</div>")
    if not cache.tables:
        parts.append(f"<div style='{_NOTE}'>no sequences yet: press <i>Add sequence</i></div>")
    for s, table in cache.tables.items():
        n, color = cache.seq_lens[s], owner_color(s)
        cls, look = "pt-table", _TABLE
        if s == selected:
            cls, look = "pt-table is-selected", f"{_TABLE};background:#F4F6FA"
        parts.append(f"<div class='{cls}' data-seq='{_esc(s)}' data-len='{n}' style='{look}'>"
                     f"<span style='width:10px;height:10px;border-radius:5px;background:{color}'></span>"
                     f"<b>seq {_esc(s)}</b><span style='{_NOTE}'>len {n}</span>[")
        for i, b in enumerate(table):
            is_hit = lookup is not None and lookup[0] == s and lookup[1] // bs == i
            parts.append(_chip(color, b, f"data-entry='{i}' title='logical block {i}'", is_hit))
        parts.append("]</div>")
    parts.append("</div></div>")

    if lookup is not None and hit is not None:
        s, pos = lookup
        logical = pos // bs
        parts.append(
            f"<div class='pt-lookup' data-role='lookup' style='{_PANEL}'><b>Lookup of seq {_esc(s)}, "
            f"position {pos}:</b> logical block {_code(f'{pos} // {bs} = {logical}')} &rarr; "
            f"table[{logical}] = "
            f"<b>physical block {hit.block}</b> &rarr; offset {_code(f'{pos} % {bs} = {hit.offset}')} "
            f"&rarr; slot {_code(f'(block {hit.block}, offset {hit.offset})')}</div>")

    if selected is not None and selected in cache.tables:
        n, color = cache.seq_lens[selected], owner_color(selected)
        parts.append(f"<div class='pt-reads' data-role='reads' style='{_PANEL}'><b>A decode step for seq "
                     f"{_esc(selected)} reads {n} slots, in this order</b> (block.offset):"
                     f"<div style='{_CHIPS};margin:4px 0 0'>")
        for pos in range(n):
            b, off = cache.slot(selected, pos)
            if pos and off == 0:  # the walk jumps to the next table entry, wherever that block lives
                parts.append(f"<span style='{_NOTE}'>&rarr;</span>")
            parts.append(_chip(color, f"{b}.{off}", f"data-read='{pos}' title='position {pos}'"))
        if n == 0:
            parts.append(f"<span style='{_NOTE}'>nothing yet: the sequence holds no tokens</span>")
        parts.append("</div></div>")
    parts.append("</div>")
    return "".join(parts)


class BlockTableTracer:
    """Interactive block-table tracer over a real ``PagedKVCache`` (display it in a notebook cell).

    Args:
        num_blocks, block_size: the pool (small by default so every slot fits on screen).
        free_order: the order in which blocks are handed out (``PagedKVCache``'s ``free_order``):
            ``free_order[0]`` is popped first; unlisted blocks follow in ascending order.
        num_layers, kv_heads, head_dim: the K/V geometry (tiny: the picture needs only the bookkeeping).

    The buttons act on ``selected``. The same actions exist as methods for notebooks and tests; a method
    that fails raises (``TracerError``, ``OutOfBlocksError``, ``KeyError``) after showing the message in the
    widget, while a button shows the message only. A failed action changes nothing.
    """

    def __init__(
        self,
        num_blocks: int = 12,
        block_size: int = 4,
        *,
        free_order: Sequence[int] | None = None,
        num_layers: int = 1,
        kv_heads: int = 1,
        head_dim: int = 2,
    ) -> None:
        self._geometry = dict(num_blocks=num_blocks, num_layers=num_layers, block_size=block_size,
                              kv_heads=kv_heads, head_dim=head_dim)
        self._free_order = None if free_order is None else list(free_order)
        self.cache = self._new_cache()
        self._next_id = 0
        self._selected: int | None = None
        self._lookup: _Lookup | None = None
        self._log = ""
        self._error = ""
        self._scenario_done: int | None = 0  # scenario steps applied since the last reset (None: diverged)
        self._syncing = False
        self._build_widgets()
        self._render()

    @classmethod
    def article_trace(cls) -> BlockTableTracer:
        """The article's starting point: block_size 4, seq 0 holds 7 tokens in blocks [5, 2], the next
        block handed out is 9, and the lookup of position 6 is highlighted."""
        tracer = cls(num_blocks=12, block_size=4, free_order=[5, 2, 9])
        seq = tracer.add_sequence()
        tracer.append(seq, 7)
        tracer.lookup(seq, 6)
        return tracer

    # ---------------------------------------------------------------------------------------------
    # programmatic API (the buttons call these)

    @property
    def selected(self) -> int | None:
        """The sequence the buttons act on (``None`` when there is none)."""
        return self._selected

    def select(self, seq_id: int | None) -> None:
        """Make ``seq_id`` the sequence the buttons act on."""
        if seq_id is not None and seq_id not in self.cache.tables:
            self._fail(KeyError(f"seq {seq_id} does not exist (live: {sorted(self.cache.tables)})"))
        self._selected = seq_id
        self._error = ""
        self._render()

    def add_sequence(self) -> int:
        """Register a new, empty sequence in the cache, select it and return its id."""
        seq_id = self._next_id
        self.cache.add_sequence(seq_id)
        self._next_id += 1
        self._selected = seq_id
        self._done(f"Added seq {seq_id} with an empty block table: it holds no block until its first token.")
        return seq_id

    def append(self, seq_id: int | None = None, n: int = 1) -> None:
        """Append ``n`` tokens to ``seq_id`` (default: the selected sequence) and select it.

        One token goes through ``cache.append_token``; several (a prompt) through ``cache.append_tokens``,
        which takes every block they need up front, or none if the pool is short.
        """
        seq_id = self._target(seq_id)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            self._fail(TracerError(f"N must be a positive whole number of tokens, got {n!r}"))
        cache, bs = self.cache, self.cache.block_size
        start = cache.seq_lens[seq_id]
        shape = (cache.num_layers, n, cache.kv_heads, cache.head_dim)
        values = torch.arange(start, start + n, dtype=cache.dtype).view(1, n, 1, 1).expand(shape)
        try:
            if n == 1:
                cache.append_token(seq_id, values[:, 0], values[:, 0])  # [num_layers, kv_heads, head_dim]
                new = [cache.tables[seq_id][-1]] if start % bs == 0 else []
            else:
                new = cache.append_tokens(seq_id, values, values)  # [num_layers, n, kv_heads, head_dim]
        except OutOfBlocksError as exc:
            self._fail(exc, f" Seq {seq_id} keeps its {start} tokens; free a sequence to make room.")
        self._selected = seq_id
        self._lookup = _Lookup(seq_id, start + n - 1)
        self._done(self._explain_append(seq_id, start, n, new))

    def free(self, seq_id: int | None = None) -> None:
        """Free ``seq_id`` (default: the selected sequence): its blocks go back on the free stack."""
        seq_id = self._target(seq_id)
        blocks = self.cache.free_sequence(seq_id)
        if self._lookup is not None and self._lookup.seq_id == seq_id:
            self._lookup = None
        self._selected = next(reversed(self.cache.tables), None)
        top = f"; block {self.cache.free[-1]} is now on top" if self.cache.free else ""
        self._done(f"Freed seq {seq_id}: its blocks {blocks} went back on the free stack{top}, "
                   f"{self.cache.num_free_blocks} blocks free.")

    def lookup(self, seq_id: int | None, pos: int) -> tuple[int, int, int]:
        """Highlight where token ``pos`` of ``seq_id`` lives; returns ``(logical_block, physical_block,
        offset)``, i.e. ``(pos // block_size, table[pos // block_size], pos % block_size)``."""
        seq_id = self._target(seq_id)
        n = self.cache.seq_lens[seq_id]
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < n:
            held = f"positions 0..{n - 1}" if n else "no tokens yet"
            self._fail(TracerError(f"position {pos!r} is out of range: seq {seq_id} holds {held}."))
        block, offset = self.cache.slot(seq_id, pos)
        self._selected = seq_id
        self._lookup = _Lookup(seq_id, pos)
        bs = self.cache.block_size
        self._done(f"Lookup of position {pos} in seq {seq_id}: {pos} // {bs} = {pos // bs} is the "
                   f"logical block, table[{pos // bs}] = {block} is the physical block, "
                   f"{pos} % {bs} = {offset} is the offset.")
        return pos // bs, block, offset

    def reset(self) -> None:
        """Start again from an empty pool with the same geometry and free order."""
        self.cache = self._new_cache()
        self._next_id = 0
        self._selected = None
        self._lookup = None
        self._done(f"Reset: {self.cache.num_blocks} free blocks, no sequences.")
        self._scenario_done = 0

    def scenario_step(self) -> None:
        """Apply the next step of ``SCENARIO`` (restarting it from a fresh pool when the state has diverged
        from it or it is finished)."""
        if self._scenario_done is None or self._scenario_done >= len(SCENARIO):
            self.reset()
        step = self._scenario_done
        op, seq_id, n, story = SCENARIO[step]
        if op == "add":
            self.add_sequence()
        elif op == "append":
            self.append(seq_id, n)
        else:
            self.free(seq_id)
        self._scenario_done = step + 1
        self._log = f"Scenario step {step + 1}/{len(SCENARIO)}: {story}. {self._log}"
        self._render()

    def html(self) -> str:
        """The current view as an HTML string (what the widget shows)."""
        return self.view.value

    # ---------------------------------------------------------------------------------------------
    # internals

    def _new_cache(self) -> PagedKVCache:
        return PagedKVCache(**self._geometry, dtype=torch.float32, device="cpu", free_order=self._free_order)

    def _target(self, seq_id: int | None) -> int:
        """The sequence an action applies to: ``seq_id`` or, if ``None``, the selected one."""
        if seq_id is None:
            seq_id = self._selected
        if seq_id is None:
            self._fail(TracerError("no sequence selected: press Add sequence first, or choose one."))
        if seq_id not in self.cache.tables:
            self._fail(KeyError(f"seq {seq_id} does not exist (live: {sorted(self.cache.tables)})"))
        return seq_id

    def _explain_append(self, seq_id: int, start: int, n: int, new: list[int]) -> str:
        bs, table = self.cache.block_size, self.cache.tables[seq_id]
        if n == 1:
            pos = start
            if new:
                why = f"{pos} % {bs} == 0, so block {new[0]} was popped from the free stack"
            else:
                why = (f"{pos} % {bs} == {pos % bs}, so it goes to offset {pos % bs} of block "
                       f"{table[pos // bs]}, no new block needed")
            return f"Position {pos}: {why}; table of seq {seq_id} is now {table}, length {start + 1}."
        popped = (f"{len(new)} block{'s' if len(new) > 1 else ''} popped from the free stack ({new})"
                  if new else f"no new block (block {table[-1]} had room)")
        return (f"Positions {start}..{start + n - 1} ({n} tokens) written at once: {popped}; "
                f"table of seq {seq_id} is now {table}, length {start + n}.")

    def _done(self, log: str) -> None:
        """A successful action: record its explanation, clear any error, re-render."""
        self._log = log
        self._error = ""
        self._scenario_done = None
        self._render()

    def _fail(self, exc: Exception, hint: str = "") -> NoReturn:
        """Show ``exc`` in the widget (state untouched) and raise it."""
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        message = message[:1].upper() + message[1:].rstrip(".") + "."
        self._error = f"{message}{hint} Nothing changed."
        self._render()
        raise exc

    def _render(self) -> None:
        lookup = None
        if self._lookup is not None and self._lookup.pos < self.cache.seq_lens.get(self._lookup.seq_id, 0):
            lookup = (self._lookup.seq_id, self._lookup.pos)
        self.view.value = render_html(self.cache, selected=self._selected, lookup=lookup, log=self._log,
                                      error=self._error)
        self._syncing = True
        try:
            options = [(f"seq {s}", s) for s in self.cache.tables]
            if list(self.seq_picker.options) != options:
                self.seq_picker.options = options
            self.seq_picker.value = self._selected
            if lookup is not None:
                self.position.value = lookup[1]
        finally:
            self._syncing = False

    def _build_widgets(self) -> None:
        def button(description: str, css: str, icon: str, tooltip: str) -> widgets.Button:
            b = widgets.Button(description=description, icon=icon, tooltip=tooltip,
                               layout=widgets.Layout(width="auto"))
            b.add_class(css)
            return b

        self.view = widgets.HTML()
        self.view.add_class("pt-view")
        self.seq_picker = widgets.Dropdown(description="sequence", options=[], value=None,
                                           layout=widgets.Layout(width="180px"))
        self.seq_picker.style.description_width = "66px"
        self.seq_picker.add_class("pt-seq")
        self.add_button = button("Add sequence", "pt-add", "plus", "register a new, empty sequence")
        self.append_button = button("Append token", "pt-append", "step-forward",
                                    "append one token to the selected sequence (a decode step)")
        self.n_tokens = widgets.BoundedIntText(value=5, min=1, max=256, description="N",
                                               layout=widgets.Layout(width="90px"))
        self.n_tokens.style.description_width = "18px"
        self.n_tokens.add_class("pt-n")
        self.append_n_button = button("Append N", "pt-append-n", "fast-forward",
                                      "append N tokens at once (a prompt)")
        self.free_button = button("Free", "pt-free", "trash", "free the selected sequence")
        self.reset_button = button("Reset", "pt-reset", "refresh", "start again from an empty pool")
        self.position = widgets.IntText(value=0, description="position", layout=widgets.Layout(width="180px"))
        self.position.style.description_width = "66px"
        self.position.add_class("pt-pos")
        self.lookup_button = button("Look up", "pt-lookup", "search",
                                    "highlight where this position of the selected sequence lives")
        self.play = widgets.Play(value=0, min=0, max=len(SCENARIO), step=1, interval=900,
                                 description="Play scenario", tooltip="play the scripted scenario")
        self.play.add_class("pt-play")
        play_label = widgets.Label("scenario: two sequences interleave, one is freed, its blocks are reused")

        self.add_button.on_click(lambda _: self._from_ui(self.add_sequence))
        self.append_button.on_click(lambda _: self._from_ui(self.append, None, 1))
        self.append_n_button.on_click(lambda _: self._from_ui(self.append, None, self.n_tokens.value))
        self.free_button.on_click(lambda _: self._from_ui(self.free))
        self.reset_button.on_click(lambda _: self._from_ui(self.reset))
        self.lookup_button.on_click(lambda _: self._from_ui(self.lookup, None, self.position.value))
        self.seq_picker.observe(self._on_pick, names="value")
        self.position.observe(self._on_position, names="value")
        self.play.observe(self._on_play, names="value")

        self.widget = widgets.VBox([
            widgets.HBox([self.seq_picker, self.add_button, self.append_button, self.n_tokens,
                          self.append_n_button, self.free_button, self.reset_button]),
            widgets.HBox([self.position, self.lookup_button, self.play, play_label]),
            self.view,
        ])
        self.widget.add_class("pt-widget")

    def _from_ui(self, action: Any, *args: Any) -> None:
        """Run an action for a control: its error is already shown in the widget, so swallow it."""
        try:
            action(*args)
        except (TracerError, OutOfBlocksError, KeyError):
            pass

    def _on_pick(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] != self._selected:
            self._from_ui(self.select, change["new"])

    def _on_position(self, change: dict[str, Any]) -> None:
        if not self._syncing:
            self._from_ui(self.lookup, None, change["new"])

    def _on_play(self, change: dict[str, Any]) -> None:
        """One tick of Play: apply the step the slider now points at (replaying from scratch if needed).
        A step that fails (a pool too small for the script) shows its message and stops the animation."""
        try:
            self._play_to(change["new"])
        except (TracerError, OutOfBlocksError, KeyError):
            self.play.playing = False

    def _play_to(self, target: int) -> None:
        if target == 0:
            self.reset()
            self._log = f"Scenario ready: press play to run its {len(SCENARIO)} steps."
            self._render()
            return
        if self._scenario_done != target - 1:
            self.reset()
            for _ in range(target - 1):
                self.scenario_step()
        self.scenario_step()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (f"BlockTableTracer({self.cache.num_blocks} blocks, "
                                f"block_size {self.cache.block_size})")
        return bundle
