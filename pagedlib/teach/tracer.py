"""``BlockTableTracer``: an ipywidgets view of a real ``PagedKVCache`` (notebooks 03 and 06).

Each button calls one of the cache's own methods (``add_sequence``, ``fork``, ``append_token``,
``append_tokens``, ``free_sequence``, ``slot``); the tracer only remembers what the reader is looking at
(the selected sequence, the highlighted lookup, the last copy-on-write, the last log line or error) and
redraws the view with ``render_html`` (``teach.tracer_view``). The cache holds real K and V (one layer,
one head of size 2): token ``p`` is written as ``k = v = p``, so what a slot holds is easy to check.

Sharing (notebook 06): **Fork** shares every block of the selected sequence with a new one; the first
append into a shared, partly filled block copies it (copy-on-write, tinted in the view). With
``enable_prefix_caching=True`` the token at position ``p`` also has token id ``p``. Every sequence then
holds the same tokens at the same positions, so any full block is a cache hit for every later prompt that
reaches past it: **Add with prompt N** attaches those cached blocks instead of writing them, and a freed
full block stays (green) among the cached free blocks until the pool needs it. The K/V a hit reuses are
exactly what the new sequence would have written (``k = v = p`` too), so every sequence still reads back
its own positions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import ipywidgets as widgets
import torch

from pagedlib.checks import as_int, ceil_div
from pagedlib.core.cache import OutOfBlocksError, PagedKVCache, UnknownSequenceError
from pagedlib.teach.tracer_view import MAX_SEQUENCES, MAX_SLOTS, render_html

__all__ = ["SCENARIO", "BlockTableTracer"]

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


_USER_ERRORS = (ValueError, LookupError, OutOfBlocksError)  # bad input or a full pool; never a bug


def _action(method: Callable[..., Any]) -> Callable[..., Any]:
    """A tracer action: on success, clear the last error; on failure (which changes nothing), show the
    error in the view and re-raise it. Redraw either way."""
    @functools.wraps(method)
    def run(self: BlockTableTracer, *args: Any, **kwargs: Any) -> Any:
        copied, self._copied = self._copied, None  # the copy-on-write highlight is the last action's
        try:
            result = method(self, *args, **kwargs)
        except _USER_ERRORS as exc:
            self._copied = copied
            hint = " Free a sequence to make room." if isinstance(exc, OutOfBlocksError) else ""
            self._error = f"Error: {str(exc).rstrip('.')}.{hint} Nothing changed."
            self._render()
            raise
        self._error = ""
        self._render()
        return result
    return run


class BlockTableTracer:
    """Interactive block-table tracer over a real ``PagedKVCache`` (display it in a notebook cell).

    Args:
        num_blocks, block_size: the pool, small so every slot fits on screen (``num_blocks * block_size
            <= MAX_SLOTS``).
        free_order: the order in which blocks are handed out (``PagedKVCache``'s ``free_order``):
            ``free_order[0]`` is popped first; unlisted blocks follow in ascending order.
        enable_prefix_caching: give the cache a prefix cache; token ids are positions (module docstring).

    The buttons act on ``selected``. The same actions exist as methods for notebooks and tests.

    Contract:
        - *A failed action changes nothing.* Arguments are checked before anything happens and every
          cache call is all-or-nothing; the one action that makes two (``add_sequence(prompt_len)``: the
          prefix lookup, then the rest of the prompt) counts the blocks the second needs before the first
          runs. A failed action also keeps the view as it was (copy-on-write highlight included). The
          error (the cache's own ``OutOfBlocksError``, ``UnknownSequenceError`` or ``IndexError``, or a
          ``ValueError`` naming the argument) is shown in the view, then raised by a method or swallowed
          by a button. Play (``play_to``) replays the script as a series of actions: one that fails stops
          it after the last step that succeeded.
        - *One thread.* In a notebook, ipykernel handles widget events one at a time on the thread that
          runs the cells, so clicks never interleave. The tracer, like its cache, is not thread-safe:
          never call it from another thread.
    """

    def __init__(self, num_blocks: int = 12, block_size: int = 4, *,
                 free_order: Sequence[int] | None = None, enable_prefix_caching: bool = False) -> None:
        num_blocks = as_int("num_blocks", num_blocks, minimum=1)
        block_size = as_int("block_size", block_size, minimum=1)
        if num_blocks * block_size > MAX_SLOTS:
            raise ValueError(f"num_blocks * block_size must be <= {MAX_SLOTS} (the tracer draws every "
                             f"slot), got {num_blocks} * {block_size} = {num_blocks * block_size}")
        self._geometry = (num_blocks, block_size)
        self._free_order = None if free_order is None else list(free_order)
        self._prefix_caching = enable_prefix_caching  # checked by the cache (a bool, else ValueError)
        self.cache = self._new_cache()
        self._next_id = 0
        self._selected: int | None = None
        self._lookup: tuple[int, int] | None = None  # (seq_id, pos) highlighted
        self._copied: tuple[int, int] | None = None  # (original, copy) of the last action's copy-on-write
        self._log = ""
        self._error = ""
        self._syncing = False  # True while _render updates the controls (their observers must not act)
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
    # actions (the buttons call these)

    @property
    def selected(self) -> int | None:
        """The sequence the buttons act on (``None`` when there is none)."""
        return self._selected

    @_action
    def select(self, seq_id: int | None) -> None:
        """Make ``seq_id`` the sequence the buttons act on (``None``: no sequence)."""
        self._selected = None if seq_id is None else self._target(seq_id)

    @_action
    def add_sequence(self, prompt_len: int = 0) -> int:
        """Register a new sequence, select it and return its id.

        ``prompt_len`` tokens (ids and K/V ``0 .. prompt_len-1``) are its prompt, written at once. With
        prefix caching the cache first attaches the cached blocks that hold the prompt's leading full
        blocks (``PagedKVCache.add_sequence(seq_id, prompt_token_ids)``) and only the rest is written. The
        blocks the prompt needs are counted first, so a prompt that does not fit changes nothing.
        """
        cache = self.cache
        self._check_room()
        n = as_int("prompt_len", prompt_len, minimum=0, maximum=cache.num_blocks * cache.block_size)
        seq_id = self._next_id
        found = self._check_prompt_fits(seq_id, n)
        hit = cache.add_sequence(seq_id, list(range(n)) if cache.prefix_cache is not None and n else None)
        self._next_id += 1
        self._selected, self._lookup = seq_id, (seq_id, n - 1) if n else None
        if n == 0:
            self._log = (f"Added seq {seq_id} with an empty block table: it holds no block until its first "
                         f"token.")
            return seq_id
        found_text = (f"prefix caching found its first {hit} tokens in cached {_ids(found)} (attached, "
                      f"not written again); the rest: " if hit else "")
        written = self._append_and_explain(seq_id, hit, n - hit)  # "Position(s) ...": lower-cased below
        self._log = f"Added seq {seq_id} with a {n}-token prompt: {found_text}p{written[1:]}"
        return seq_id

    @_action
    def fork(self, seq_id: int | None = None) -> int:
        """Fork ``seq_id`` (default: the selected sequence) into a new sequence, select it and return its
        id: ``cache.fork`` copies the parent's block table, not its K/V, so every block becomes shared."""
        parent = self._target(seq_id)
        self._check_room()
        child, cache = self._next_id, self.cache
        cache.fork(parent, child)
        self._next_id += 1
        self._selected, table, n, bs = child, cache.tables[child], cache.seq_lens[child], cache.block_size
        if n % bs:
            then = (f"its last block {table[-1]} is partly filled ({n % bs} of {bs} slots), so the first "
                    f"append to either sequence copies it first (copy-on-write)")
        else:
            then = "every block is full, so appends take new blocks and nothing will be copied"
        self._log = (f"Forked seq {parent} into seq {child}: the child's table is a copy of the parent's, "
                     f"{table}, length {n}; no K/V was copied, each of those blocks has one more ref; "
                     f"{then}.")
        return child

    @_action
    def append(self, seq_id: int | None = None, n: int = 1) -> None:
        """Append ``n`` tokens to ``seq_id`` (default: the selected sequence) and select it.

        One token goes through ``cache.append_token``; several (a prompt) through ``cache.append_tokens``,
        which takes every block they need up front, or none if the pool is short. If the sequence's last
        block is shared and partly filled, the cache copies it first (copy-on-write); the log says which
        block went where and the view tints the copy.
        """
        seq_id, cache = self._target(seq_id), self.cache
        # n is checked against the whole pool before any K/V is built; an n that fits the pool but not its
        # free blocks is refused by the cache itself (OutOfBlocksError) before it takes anything
        n = as_int("n", n, minimum=1, maximum=cache.num_blocks * cache.block_size)
        start = cache.seq_lens[seq_id]
        self._log = self._append_and_explain(seq_id, start, n)
        self._selected, self._lookup = seq_id, (seq_id, start + n - 1)

    @_action
    def free(self, seq_id: int | None = None) -> None:
        """Free ``seq_id`` (default: the selected sequence): each of its blocks loses a ref; those nobody
        holds any more go back on the free stack or, holding cached content, to the cached free blocks."""
        seq_id, cache = self._target(seq_id), self.cache
        blocks = list(cache.tables[seq_id])
        freed = cache.free_sequence(seq_id)
        if self._lookup is not None and self._lookup[0] == seq_id:
            self._lookup = None
        self._selected = next(reversed(cache.tables), None)
        queue = cache.prefix_cache.free_queue if cache.prefix_cache is not None else {}
        plain, cached = [b for b in freed if b not in queue], [b for b in freed if b in queue]
        kept = [b for b in blocks if b not in freed]
        top = f"; block {cache.free[-1]} is now on top" if cache.free and plain else ""
        said = [f"{_ids(plain)} went back on the free stack{top}"] if plain else []
        said += [f"{_ids(cached)} keep{' their' if len(cached) > 1 else 's its'} K/V as cached free "
                 f"block{_s(cached)}"] if cached else []
        said += [f"{_ids(kept)} stay{'' if len(kept) > 1 else 's'}: other sequences still hold "
                 f"{'them' if len(kept) > 1 else 'it'} (one ref fewer)"] if kept else []
        self._log = (f"Freed seq {seq_id}: {'; '.join(said) or 'it held no block'}, "
                     f"{cache.num_free_blocks} blocks free.")

    @_action
    def lookup(self, seq_id: int | None, pos: int) -> tuple[int, int, int]:
        """Highlight where token ``pos`` of ``seq_id`` lives; returns ``(logical_block, physical_block,
        offset)``, i.e. ``(pos // block_size, table[pos // block_size], pos % block_size)``."""
        seq_id, pos = self._target(seq_id), as_int("pos", pos)
        block, offset = self.cache.slot(seq_id, pos)  # the cache's IndexError if pos is out of range
        bs = self.cache.block_size
        self._selected, self._lookup = seq_id, (seq_id, pos)
        self._log = (f"Lookup of position {pos} in seq {seq_id}: {pos} // {bs} = {pos // bs} is the "
                     f"logical block, table[{pos // bs}] = {block} is the physical block, "
                     f"{pos} % {bs} = {offset} is the offset.")
        return pos // bs, block, offset

    @_action
    def reset(self) -> None:
        """Start again from an empty pool with the same geometry and free order."""
        self.cache = self._new_cache()
        self._next_id, self._selected, self._lookup = 0, None, None
        self._log = f"Reset: {self.cache.num_blocks} free blocks, no sequences."

    def play_to(self, step: int) -> None:
        """Show the scenario after its first ``step`` steps: a fresh pool, then ``SCENARIO[:step]`` replayed
        as ordinary actions. One that fails stops the replay there (showing and raising its error)."""
        step = as_int("step", step, minimum=0, maximum=len(SCENARIO))
        self.reset()
        for op, seq_id, n, _ in SCENARIO[:step]:
            if op == "add":
                self.add_sequence()
            elif op == "append":
                self.append(seq_id, n)
            else:
                self.free(seq_id)
        self._log = (f"Scenario step {step}/{len(SCENARIO)}: {SCENARIO[step - 1][3]}. {self._log}" if step
                     else f"Scenario ready: press play to run its {len(SCENARIO)} steps.")
        self._render()

    def html(self) -> str:
        """The current view as an HTML string (what the widget shows)."""
        return self.view.value

    # ---------------------------------------------------------------------------------------------
    # internals

    def _new_cache(self) -> PagedKVCache:
        num_blocks, block_size = self._geometry
        return PagedKVCache(num_blocks, num_layers=1, block_size=block_size, kv_heads=1, head_dim=2,
                            free_order=self._free_order, enable_prefix_caching=self._prefix_caching)

    def _target(self, seq_id: int | None) -> int:
        """The sequence an action applies to: ``seq_id`` or, if ``None``, the selected one."""
        if seq_id is None:
            if self._selected is None:
                raise ValueError("no sequence selected: press Add sequence first, or pass seq_id")
            return self._selected
        seq_id = as_int("seq_id", seq_id)
        if seq_id not in self.cache.tables:
            raise UnknownSequenceError(seq_id, self.cache.tables)
        return seq_id

    def _check_room(self) -> None:
        if len(self.cache.tables) >= MAX_SEQUENCES:
            raise ValueError(f"the tracer shows at most {MAX_SEQUENCES} sequences: free one first")

    def _check_prompt_fits(self, seq_id: int, n: int) -> list[int]:
        """The cached blocks a prompt of ``n`` tokens would attach (looked up on a copy of the prefix cache,
        whose lookup counts queries); ``OutOfBlocksError`` if the rest of the prompt needs more blocks than
        are free once those are attached (a cached block waiting in the free queue stops being free)."""
        cache = self.cache
        pc = cache.prefix_cache
        found = pc.peek(range(n)) if pc is not None and n else []
        need = ceil_div(n, cache.block_size) - len(found)
        free = cache.num_free_blocks - sum(b in pc.free_queue for b in found) if pc is not None else \
            cache.num_free_blocks
        if need > free:
            hit = len(found) * cache.block_size
            what = (f"the last {n - hit} tokens of a {n}-token prompt of sequence {seq_id} (the first {hit} "
                    f"are cached)" if found else f"a {n}-token prompt of sequence {seq_id}")
            raise OutOfBlocksError(need, free, what)
        return found

    def _append_and_explain(self, seq_id: int, start: int, n: int) -> str:
        """Write tokens ``start .. start+n-1`` of ``seq_id`` (token id = K = V = position), note the
        copy-on-write it made, if any, in ``_copied``, and return the log line explaining it."""
        cache = self.cache
        old, copies = list(cache.tables[seq_id]), cache.cow_copies
        queued = set(cache.prefix_cache.free_queue) if cache.prefix_cache is not None else set()
        refs = cache.ref_count(old[-1]) if old else 0
        # [num_layers=1, n, kv_heads=1, head_dim=2]: token p is written as k = v = p
        values = torch.arange(start, start + n, dtype=cache.dtype).view(1, n, 1, 1).repeat(1, 1, 1, 2)
        ids = list(range(start, start + n)) if cache.prefix_cache is not None else None
        if n == 1:
            cache.append_token(seq_id, values[:, 0], values[:, 0], None if ids is None else ids[0])
        else:
            cache.append_tokens(seq_id, values, values, ids)
        table = cache.tables[seq_id]
        if cache.cow_copies > copies:
            self._copied = (old[-1], table[len(old) - 1])
        taken = table[len(old) - 1:] if self._copied else table[len(old):]
        evicted = [b for b in taken if b in queued]
        return self._explain_append(seq_id, start, n, table[len(old):], refs, evicted)

    def _explain_append(self, seq_id: int, start: int, n: int, new: list[int], refs: int,
                        evicted: list[int]) -> str:
        """The log line of an append: the arithmetic, the blocks taken (popped, or evicted from the cached
        free blocks), the copy-on-write if one was made (``refs``: the copied block's count before)."""
        bs, table = self.cache.block_size, self.cache.tables[seq_id]
        r = start % bs
        cow = ""
        if self._copied is not None:
            src, dst = self._copied
            cow = (f"block {src} was shared ({refs} refs), so copy-on-write first copied its {r} "
                   f"token{'s' if r > 1 else ''} (K and V, every layer) to block {dst}{_taken(dst, evicted)} "
                   f"and the table now names {dst}; block {src} keeps {refs - 1} "
                   f"ref{'s' if refs > 2 else ''}")
        if n == 1:
            if new:
                why = f"{start} % {bs} == 0, so {_taken(new[0], evicted, verb=True)}"
            elif cow:
                why = f"{start} % {bs} == {r}, but {cow}; the token goes to offset {r} of block {table[-1]}"
            else:
                why = (f"{start} % {bs} == {r}, so it goes to offset {r} of block {table[start // bs]}, "
                       f"no new block needed")
            return f"Position {start}: {why}; table of seq {seq_id} is now {table}, length {start + 1}."
        if new:
            took = f"{len(new)} block{_s(new)} popped from the free stack ({new})"
            gone = [b for b in new if b in evicted]
            took += f", block{_s(gone)} {gone} evicted from the cached free blocks" if gone else ""
        else:
            took = f"no new block (block {table[-1]} had room)"
        cow = f"{cow}; " if cow else ""
        return (f"Positions {start}..{start + n - 1} ({n} tokens) written at once: {cow}{took}; table of seq "
                f"{seq_id} is now {table}, length {start + n}.")

    def _render(self) -> None:
        """Redraw the view and bring the controls in line with the state (without triggering them)."""
        self.view.value = render_html(self.cache, selected=self._selected, lookup=self._lookup,
                                      copied=self._copied, log=self._log, error=self._error)
        self._syncing = True
        try:
            options = [(f"seq {s}", s) for s in self.cache.tables]
            if list(self.seq_picker.options) != options:
                self.seq_picker.options = options
            self.seq_picker.value = self._selected
            if self._lookup is not None:
                self.position.value = self._lookup[1]
        finally:
            self._syncing = False

    # ---------------------------------------------------------------------------------------------
    # controls

    def _build_widgets(self) -> None:
        self.view = widgets.HTML()
        self.view.add_class("pt-view")
        self.seq_picker = _styled(widgets.Dropdown(description="sequence", options=[], value=None), "pt-seq")
        self.add_button = _button("Add sequence", "pt-add", "plus", "register a new, empty sequence")
        self.append_button = _button("Append token", "pt-append", "step-forward",
                                     "append one token to the selected sequence (a decode step)")
        self.n_tokens = _styled(widgets.IntText(value=5, description="N"),  # not clamped: append checks N
                                "pt-n", "90px", "18px")
        self.append_n_button = _button("Append N", "pt-append-n", "fast-forward",
                                       "append N tokens at once (a prompt)")
        self.add_prompt_button = _button("Add with prompt N", "pt-add-prompt", "plus-square",
                                         "register a new sequence with an N-token prompt (prefix caching "
                                         "looks it up)")
        self.fork_button = _button("Fork", "pt-fork", "code-fork",
                                   "fork the selected sequence: a new sequence sharing all its blocks")
        self.free_button = _button("Free", "pt-free", "trash", "free the selected sequence")
        self.reset_button = _button("Reset", "pt-reset", "refresh", "start again from an empty pool")
        self.position = _styled(widgets.IntText(value=0, description="position"), "pt-pos")
        self.lookup_button = _button("Look up", "pt-lookup", "search",
                                     "highlight where this position of the selected sequence lives")
        self.play = widgets.Play(value=0, min=0, max=len(SCENARIO), step=1, interval=900,
                                 description="Play scenario", tooltip="play the scripted scenario")
        self.play.add_class("pt-play")
        play_label = widgets.Label("scenario: two sequences interleave, one is freed, its blocks are reused")
        self.widget = widgets.VBox([
            widgets.HBox([self.seq_picker, self.add_button, self.append_button, self.fork_button,
                          self.free_button, self.reset_button]),
            widgets.HBox([self.n_tokens, self.append_n_button, self.add_prompt_button, self.position,
                          self.lookup_button]),
            widgets.HBox([self.play, play_label]),
            self.view,
        ])
        self.widget.add_class("pt-widget")
        self._wire_widgets()

    def _wire_widgets(self) -> None:
        self.add_button.on_click(lambda _: self._from_ui(self.add_sequence))
        self.append_button.on_click(lambda _: self._from_ui(self.append, None, 1))
        self.append_n_button.on_click(lambda _: self._from_ui(self.append, None, self.n_tokens.value))
        self.add_prompt_button.on_click(lambda _: self._from_ui(self.add_sequence, self.n_tokens.value))
        self.fork_button.on_click(lambda _: self._from_ui(self.fork))
        self.free_button.on_click(lambda _: self._from_ui(self.free))
        self.reset_button.on_click(lambda _: self._from_ui(self.reset))
        self.lookup_button.on_click(lambda _: self._from_ui(self.lookup, None, self.position.value))
        self.seq_picker.observe(self._on_pick, names="value")
        self.position.observe(self._on_position, names="value")
        self.play.observe(self._on_play, names="value")

    def _from_ui(self, action: Callable[..., Any], *args: Any) -> bool:
        """Run an action for a control; its error is already shown in the view, so swallow it."""
        try:
            action(*args)
        except _USER_ERRORS:
            return False
        return True

    def _on_pick(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] != self._selected:
            self._from_ui(self.select, change["new"])

    def _on_position(self, change: dict[str, Any]) -> None:
        if not self._syncing:
            self._from_ui(self.lookup, None, change["new"])

    def _on_play(self, change: dict[str, Any]) -> None:
        """One tick of Play: show the step it now points at. A step that fails (a pool too small for the
        script) shows its message and stops the animation."""
        if not self._from_ui(self.play_to, change["new"]):
            self.play.playing = False

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = (f"BlockTableTracer({self.cache.num_blocks} blocks, "
                                f"block_size {self.cache.block_size})")
        return bundle


def _button(description: str, css: str, icon: str, tooltip: str) -> widgets.Button:
    b = widgets.Button(description=description, icon=icon, tooltip=tooltip,
                       layout=widgets.Layout(width="auto"))
    b.add_class(css)
    return b


def _styled(w: widgets.DOMWidget, css: str, width: str = "180px", label_width: str = "66px") -> Any:
    """``w`` with a CSS class (for tests), a fixed width and a fixed label width."""
    w.layout = widgets.Layout(width=width)
    w.style.description_width = label_width
    w.add_class(css)
    return w


def _s(items: Sequence[object]) -> str:
    """The plural ``s`` for a list of ``items``."""
    return "s" if len(items) > 1 else ""


def _ids(blocks: Sequence[int]) -> str:
    """``block 3`` or ``blocks 3, 5``."""
    return f"block{_s(blocks)} {', '.join(map(str, blocks))}"


def _taken(block: int, evicted: Sequence[int], verb: bool = False) -> str:
    """How ``block`` was taken: popped from the free stack, or evicted from the cached free blocks."""
    if verb:
        return (f"cached block {block} was evicted (the free stack is empty)" if block in evicted else
                f"block {block} was popped from the free stack")
    return " (evicted from the cached free blocks)" if block in evicted else ""
