"""``BlockTableTracer``: an ipywidgets view of a real ``PagedKVCache`` (notebooks 03 and 06). Each button
calls one of the cache's methods; Back and Forward walk a history of snapshots. Token ``p`` is written as
``k = v = p``, token id ``p``. A failed action changes nothing (checks first; the cache is all-or-nothing)."""

from __future__ import annotations

import collections
import copy
import functools
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import torch

from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.teach import _checks
from pagedlib.teach.tracer_view import _s, render_history, render_html
from pagedlib.util import as_int

# Play's scenario, one (operation, seq id or None, token count, narration) per step, for block_size 4.
SCENARIO: tuple[tuple[str, int | None, int, str], ...] = (
    ("add", None, 0, "a request arrives: seq 0 starts with an empty table"),
    ("append", 0, 6, "its prompt of 6 tokens is written in one go"),
    ("add", None, 0, "a second request arrives: seq 1"),
    ("append", 1, 5, "its prompt of 5 tokens"),
    ("append", 0, 1, "decode step 1 begins: seq 0's token"),
    ("append", 1, 1, "decode step 1 ends: seq 1's token"),
    ("append", 0, 1, "decode step 2: seq 0's token"),
    ("append", 1, 1, "decode step 2: seq 1's token"),
    ("append", 0, 1, "decode step 3: seq 0 crosses a block boundary"),
    ("append", 1, 1, "decode step 3: seq 1 fills its last block"),
    ("free", 1, 0, "seq 1 finishes: all its blocks go back on the free stack"),
    ("add", None, 0, "a third request arrives: seq 2"),
    ("append", 2, 8, "its 8-token prompt reuses the blocks seq 1 just gave back"),
    ("append", 0, 1, "decode step 4: seq 0's token"),
    ("append", 2, 1, "decode step 4: seq 2 crosses a block boundary"),
)

_USER_ERRORS = (ValueError, LookupError, OutOfBlocksError)  # bad input or a full pool; never a bug
# One step of the history: a copy of the cache (never written to) and what the view showed.
_Step = collections.namedtuple("_Step", "cache next_id selected lookup copied log")


def _action(method: Callable[..., Any]) -> Callable[..., Any]:
    """A tracer action: redraw; on failure (which changes nothing) show the error and re-raise it."""
    @functools.wraps(method)
    def run(self: BlockTableTracer, *args: Any, **kwargs: Any) -> Any:
        copied, self._copied, self._error = self._copied, None, ""  # highlight only the last action's copy
        try:
            return method(self, *args, **kwargs)
        except _USER_ERRORS as exc:
            hint = " Free a sequence to make room." if isinstance(exc, OutOfBlocksError) else ""
            self._copied, self._error = copied, f"Error: {str(exc).rstrip('.')}.{hint} Nothing changed."
            raise
        finally:
            self._render()
    return run


_BUTTONS: dict[str, tuple[str, str, Callable[[BlockTableTracer], Any]]] = {  # attribute: label, icon, click
    "add_button": ("Add sequence", "plus", lambda t: t.add_sequence()),
    "append_button": ("Append token", "pencil", lambda t: t.append(None, 1)),
    "fork_button": ("Fork", "code-fork", lambda t: t.fork()),
    "free_button": ("Free", "trash", lambda t: t.free()),
    "reset_button": ("Reset", "refresh", lambda t: t.reset()),
    "append_n_button": ("Append N", "fast-forward", lambda t: t.append(None, t.n_tokens.value)),
    "add_prompt_button": ("Add with prompt N", "plus-square", lambda t: t.add_sequence(t.n_tokens.value)),
    "lookup_button": ("Look up", "search", lambda t: t.lookup(None, t.position.value)),
    "back_button": ("Back", "step-backward", lambda t: t.back()),
    "forward_button": ("Forward", "step-forward", lambda t: t.forward()),
}


class BlockTableTracer:
    """Interactive block-table tracer over a real ``PagedKVCache`` (its arguments; at most ``MAX_SLOTS``
    slots, so every one fits on screen); its buttons act on ``selected``."""

    def __init__(self, num_blocks: int = 12, block_size: int = 4, *,
                 free_order: Sequence[int] | None = None, enable_prefix_caching: bool = False) -> None:
        self._geometry = _checks.geometry(num_blocks, block_size)
        self._free_order = None if free_order is None else list(free_order)
        self._prefix_caching = enable_prefix_caching  # checked by the cache (a bool, else ValueError)
        self._start()
        self._error, self._syncing = "", False  # _syncing: _render is updating the controls
        self._build_widgets()
        self._render()

    @classmethod
    def article_trace(cls) -> BlockTableTracer:
        """The article's starting point: seq 0 holds 7 tokens in blocks [5, 2]; the next block is 9."""
        tracer = cls(num_blocks=12, block_size=4, free_order=[5, 2, 9])
        tracer.append(tracer.add_sequence(), 7)
        return tracer

    @property
    def selected(self) -> int | None:
        """The sequence the buttons act on (``None`` when there is none)."""
        return self._selected

    @property
    def step(self) -> int:
        """The step of the history shown: 0 is the empty pool, ``k`` the state after ``k`` actions."""
        return self._at

    @_action
    def select(self, seq_id: int | None) -> None:
        """Make ``seq_id`` the sequence the buttons act on (``None``: no sequence)."""
        self._choose(None if seq_id is None else _checks.target(seq_id, None, self.cache.tables))

    @_action
    def add_sequence(self, prompt_len: int = 0) -> int:
        """Add and select a sequence with a ``prompt_len``-token prompt (cached blocks attached); its id."""
        n, found = _checks.new_prompt(self.cache, self._next_id, prompt_len)  # counts its blocks first
        seq_id, cache = self._next_id, self.cache
        hit = cache.add_sequence(seq_id, list(range(n)) if cache.prefix_cache is not None and n else None)
        self._next_id += 1
        self._log = f"Added seq {seq_id} with an empty block table: it holds no block until its first token."
        if n:
            found_text = (f"prefix caching found its first {hit} tokens in cached {_ids(found)} (attached, "
                          f"not written again); the rest: " if hit else "")
            written = self._write(seq_id, hit, n - hit)  # "Position(s) ...": lower-cased below
            self._log = f"Added seq {seq_id} with a {n}-token prompt: {found_text}p{written[1:]}"
        self._record(seq_id)
        return seq_id

    @_action
    def fork(self, seq_id: int | None = None) -> int:
        """Fork ``seq_id`` (default: the selected one) into a new, selected sequence; return its id."""
        parent = _checks.target(seq_id, self._selected, self.cache.tables)
        _checks.room(self.cache.tables)
        child, cache = self._next_id, self.cache
        cache.fork(parent, child)
        self._next_id += 1
        table, n, bs = cache.tables[child], cache.seq_lens[child], cache.block_size
        then = (f"its last block {table[-1]} is partly filled ({n % bs} of {bs} slots), so the first append "
                f"to either sequence copies it (copy-on-write)" if n % bs else
                "every block is full, so appends take new blocks and nothing will be copied")
        self._log = (f"Forked seq {parent} into seq {child}: the child's table is a copy of the parent's, "
                     f"{table}, length {n}; no K/V was copied, each block has one more ref; {then}.")
        self._record(child)
        return child

    @_action
    def append(self, seq_id: int | None = None, n: int = 1) -> None:
        """Append ``n`` tokens to ``seq_id`` (default: the selected sequence) and select it."""
        seq_id = _checks.target(seq_id, self._selected, self.cache.tables)
        n = _checks.tokens("n", n, self.cache, minimum=1)  # before any K/V is built for them
        start = self.cache.seq_lens[seq_id]
        self._log = self._write(seq_id, start, n)
        self._record(seq_id)

    @_action
    def free(self, seq_id: int | None = None) -> None:
        """Free ``seq_id`` (default: the selected sequence): each of its blocks loses a ref."""
        seq_id, cache = _checks.target(seq_id, self._selected, self.cache.tables), self.cache
        blocks, freed = list(cache.tables[seq_id]), cache.free_sequence(seq_id)
        plain, cached = ([b for b in freed if cache.is_cached(b) == q] for q in (False, True))
        kept = [b for b in blocks if b not in freed]
        said = [f"{_ids(plain)} went back on the free stack, {cache.free[-1]} on top" if plain else "",
                f"{_ids(cached)} kept as cached free: the K/V stay findable" if cached else "",
                f"{_ids(kept)} still held by other sequences (one ref fewer)" if kept else ""]
        self._log = (f"Freed seq {seq_id}: {'; '.join(filter(None, said)) or 'it held no block'}; "
                     f"{cache.num_free_blocks} blocks free.")
        self._record(next(reversed(cache.tables), None))

    @_action
    def lookup(self, seq_id: int | None, pos: int) -> tuple[int, int, int]:
        """Ring where token ``pos`` of ``seq_id`` lives: ``(logical_block, physical_block, offset)``."""
        seq_id, pos = _checks.target(seq_id, self._selected, self.cache.tables), as_int("pos", pos)
        block, offset = self.cache.slot(seq_id, pos)  # the cache's IndexError if pos is out of range
        bs = self.cache.block_size
        self._selected, self._lookup = seq_id, (seq_id, pos)
        self._log = (f"Lookup of position {pos} in seq {seq_id}: logical block {pos} // {bs} = {pos // bs}, "
                     f"physical block table[{pos // bs}] = {block}, offset {pos} % {bs} = {offset}.")
        return pos // bs, block, offset

    @_action
    def reset(self) -> None:
        """Start again from an empty pool with the same geometry and free order (and an empty history)."""
        self._start()

    @_action
    def back(self) -> None:
        """Show the state one step earlier (``cache`` becomes a copy of that step's)."""
        self._restore(_checks.history_step(self._at - 1, len(self._history) - 1))

    @_action
    def forward(self) -> None:
        """Show the next step of the history or, at its end after ``play_to``, play the scenario's next."""
        if self._scripted and self._at == len(self._history) - 1 and self._at < len(SCENARIO):
            self._play_step()
        else:
            self._restore(_checks.history_step(self._at + 1, len(self._history) - 1))

    def play_to(self, step: int) -> None:
        """Show the scenario after its first ``step`` steps, played as ordinary actions on a fresh pool."""
        step = as_int("step", step, minimum=0, maximum=len(SCENARIO))
        self.reset()
        self._scripted = True
        self._log = f"Scenario ready: press play or step forward through its {len(SCENARIO)} steps."
        self._history[0] = self._history[0]._replace(log=self._log)
        for _ in range(step):
            self._play_step()
        self._render()

    def html(self) -> str:
        """The current view as an HTML string (what the widget shows, without its controls)."""
        return self.view.value

    def frames(self) -> list[str]:
        """The view of every step of the history, first to last: what Back and Forward show."""
        return [render_html(s.cache, selected=s.selected, lookup=s.lookup, copied=s.copied, log=s.log)
                for s in self._history]

    def _start(self) -> None:
        """A new cache and a history holding one step, the empty pool."""
        num_blocks, block_size = self._geometry
        self.cache = PagedKVCache(num_blocks, num_layers=1, block_size=block_size, kv_heads=1, head_dim=2,
                                  free_order=self._free_order, enable_prefix_caching=self._prefix_caching)
        self._next_id, self._copied = 0, None
        self._log = f"Empty pool: {num_blocks} free blocks, no sequences."
        self._history, self._at = [], -1  # _record appends step 0
        self._record(None)

    def _record(self, selected: int | None) -> None:
        """The cache changed: select ``selected``, drop the steps after this one, snapshot the new state."""
        self._choose(selected)
        del self._history[self._at + 1:]
        self._history.append(_Step(copy.deepcopy(self.cache), self._next_id, self._selected, self._lookup,
                                   self._copied, self._log))
        self._at, self._scripted = len(self._history) - 1, False

    def _restore(self, at: int) -> None:
        self._at, step = at, copy.deepcopy(self._history[at])  # the snapshot itself is never written to
        self.cache, self._next_id, self._selected, self._lookup, self._copied, self._log = step

    def _choose(self, seq_id: int | None) -> None:
        """Select ``seq_id`` and ring its last token: the lookup and the reads show the same sequence."""
        n = self.cache.seq_lens[seq_id] if seq_id is not None else 0
        self._selected, self._lookup = seq_id, (seq_id, n - 1) if n else None

    def _play_step(self) -> None:
        """The scenario's next step, as an ordinary action whose log line starts with the narration."""
        op, seq_id, n, story = SCENARIO[self._at]
        {"add": lambda: self.add_sequence(), "append": lambda: self.append(seq_id, n),
         "free": lambda: self.free(seq_id)}[op]()
        self._log = f"Scenario step {self._at}/{len(SCENARIO)}: {story}. {self._log}"
        self._history[-1] = self._history[-1]._replace(log=self._log)
        self._scripted = True

    def _write(self, seq_id: int, start: int, n: int) -> str:
        """Write tokens ``start .. start+n-1`` of ``seq_id`` (K = V = position); return the log line."""
        cache, bs, r = self.cache, self.cache.block_size, start % self.cache.block_size
        old, copies = list(cache.tables[seq_id]), cache.cow_copies
        refs = cache.ref_counts[old[-1]] if old else 0
        queued = set(cache.prefix_cache.free_queue) if cache.prefix_cache is not None else set()
        # [num_layers=1, n, kv_heads=1, head_dim=2]: token p is written as k = v = p, with token id p
        kv = torch.arange(start, start + n, dtype=cache.dtype).view(1, n, 1, 1).repeat(1, 1, 1, 2)
        if n == 1:  # a decode step's call, as notebook 03 says
            cache.append_token(seq_id, kv[:, 0], kv[:, 0], start)
        else:
            cache.append_tokens(seq_id, kv, kv, list(range(start, start + n)))
        table = cache.tables[seq_id]
        if cache.cow_copies > copies:
            self._copied = (old[-1], table[len(old) - 1])
        src, dst = self._copied or (None, None)
        popped, evicted = ([b for b in table[len(old):] if (b in queued) == q] for q in (False, True))
        said = [f"block {src} was shared ({refs} refs), so copy-on-write first copied its {r} "
                f"token{_s(range(r))} (K and V, every layer) to block {dst}, the table now names {dst} and "
                f"block {src} keeps {refs - 1} ref{_s(range(refs - 1))}" if src is not None else "",
                f"{'a new block: ' * (n == 1)}{_ids(popped)} popped from the free stack" if popped else "",
                f"cached {_ids(evicted)} evicted (the free stack was empty)" if evicted else ""]
        said = [x for x in said if x] or [f"no new block: block {table[start // bs]} has room at offset {r}"]
        head = f"Position {start}: {start} % {bs} == {r}" if n == 1 else \
            f"Positions {start}..{start + n - 1} ({n} tokens) written at once"
        return f"{head}; {'; '.join(said)}; table of seq {seq_id} is now {table}, length {start + n}."

    def _render(self) -> None:
        """Redraw the view and bring the controls in line with the state (without triggering them)."""
        self.view.value = render_html(self.cache, selected=self._selected, lookup=self._lookup,
                                      copied=self._copied, log=self._log, error=self._error)
        self.history_view.value = render_history([s.log for s in self._history], self._at)
        last = max(len(self._history) - 1, len(SCENARIO) if self._scripted else 0)
        self._syncing = True
        try:
            self.seq_picker.options = [(f"seq {s}", s) for s in self.cache.tables]
            self.seq_picker.value = self._selected
            if self._lookup is not None:
                self.position.value = self._lookup[1]
            if self._scripted:
                self.play.value = self._at
            self.back_button.disabled, self.forward_button.disabled = self._at == 0, self._at == last
            self.step_label.value = f"step {self._at} of {last}"
        finally:
            self._syncing = False

    def _build_widgets(self) -> None:
        self.view, self.history_view = widgets.HTML(), widgets.HTML()
        self.step_label, self.scenario_label = widgets.Label(), widgets.Label("scenario (Play, Stop):")
        self.seq_picker = widgets.Dropdown(description="sequence", layout={"width": "180px"})
        self.n_tokens = widgets.IntText(value=5, description="N", layout={"width": "150px"})
        self.position = widgets.IntText(description="position", layout={"width": "180px"})
        self.play = widgets.Play(max=len(SCENARIO), interval=900, show_repeat=False)
        for name, (label, icon, click) in _BUTTONS.items():
            setattr(self, name, widgets.Button(description=label, icon=icon, layout={"width": "auto"}))
            getattr(self, name).on_click(lambda _, click=click: self._from_ui(click, self))
        for name in ("view", "step_label", "seq_picker", "n_tokens", "position", "play", *_BUTTONS):
            getattr(self, name).add_class("pt-" + name.removesuffix("_button").replace("_", "-"))
        rows = [("seq_picker", "add_button", "append_button", "fork_button", "free_button", "reset_button"),
                ("n_tokens", "append_n_button", "add_prompt_button", "position", "lookup_button"),
                ("scenario_label", "play", "back_button", "forward_button", "step_label")]
        boxes = [widgets.HBox([getattr(self, name) for name in row]) for row in rows]
        self.widget = widgets.VBox([*boxes, self.view, self.history_view])
        self.widget.add_class("pt-widget")
        self.seq_picker.observe(lambda c: c["new"] != self._selected and self._from_ui(self.select, c["new"]),
                                names="value")
        self.position.observe(lambda c: self._from_ui(self.lookup, None, c["new"]), names="value")
        # a tick of Play shows the step it points at; a step that fails stops the animation
        self.play.observe(lambda c: self._from_ui(self.play_to, c["new"])
                          or self.play.set_trait("playing", False), names="value")

    def _from_ui(self, action: Callable[..., Any], *args: Any) -> bool:
        """Run an action for a control (unless ``_render`` is syncing them); the view shows its error."""
        try:
            return self._syncing or action(*args) or True
        except _USER_ERRORS:
            return False

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = "BlockTableTracer({} blocks, block_size {})".format(*self._geometry)
        return bundle


def _ids(blocks: Sequence[int]) -> str:
    """``block 3`` or ``blocks 3, 5``."""
    return f"block{_s(blocks)} {', '.join(map(str, blocks))}"
