"""Task ``allocator`` (notebook 02): the block allocator's bookkeeping, call for call the same as pagedlib's.

Every check replays a generated program of ``add_sequence`` / ``append`` / ``free_sequence`` calls on the
reader's ``BlockAllocator`` and on pagedlib's own ``PagedKVCache`` (one number per slot: only its
bookkeeping matters here) side by side. A call pagedlib refuses reaches the reader only in the two checks
about refused calls. Hypothesis shrinks a failing program to the shortest one, which the report shows as
the calls made, the failing one last.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlib.core.blocks import BlockManager
from pagedlib.core.cache import OutOfBlocksError, PagedKVCache, UnknownSequenceError
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal
from pagedlib.testing import InvariantError, check_invariants, holders
from pagedlib.util import ceil_div

PROGRAMS = st.binary(max_size=24)          # one byte per call (``decode``): hypothesis shrinks it cheaply
POOLS = dict(num_blocks=st.integers(4, 12), block_size=st.integers(1, 4))
SMALL_POOLS = dict(num_blocks=st.integers(1, 4), block_size=st.integers(1, 4))


def programs(n: int) -> settings:
    """``n`` programs, and only the shortest failure reported (a wrong allocator often fails two ways)."""
    return settings(cases(n), report_multiple_bugs=False)


def started(impl: Any) -> None:
    """A short program run once before the property: ``NotImplementedError`` goes up at once (hypothesis
    would spend seconds shrinking it); any other error is left to the property, which shrinks it to its
    shortest program."""
    try:
        allocator = impl.BlockAllocator(2, 1)
        for call in (lambda: allocator.add_sequence(0), lambda: allocator.append(0, 2),
                     lambda: allocator.num_free_blocks, lambda: allocator.free_sequence(0)):
            call()
    except NotImplementedError:
        raise
    except Exception:
        pass


@dataclass
class Step:
    """One call made on both allocators: ``got`` what the reader's returned (or the exception it raised),
    ``want`` pagedlib's, ``before`` the reader's state before it; ``case`` the calls so far."""

    mine: Any
    ref: PagedKVCache
    call: tuple[str, int, int]
    got: Any
    want: Any
    before: tuple
    case: str


@cache
def zeros(n: int) -> torch.Tensor:
    return torch.zeros(1, n, 1, 1)          # K or V of n tokens: [num_layers, n, kv_heads, head_dim]


def do(allocator: Any, kind: str, seq_id: int, n: int, pagedlib: bool = False) -> Any:
    """One call, its return value or the exception it raised (a reader's ``NotImplementedError`` and
    ``MemoryError`` go on up: the grader reports them as such)."""
    try:
        if kind == "add":
            return allocator.add_sequence(seq_id)
        if kind == "free":
            return allocator.free_sequence(seq_id)
        if pagedlib:
            return allocator.append_tokens(seq_id, zeros(n), zeros(n))
        return allocator.append(seq_id, n)
    except (NotImplementedError, MemoryError):
        raise
    except Exception as error:
        return error


def decode(byte: int, live: list, frees: bool = True, exact: bool = False) -> tuple[str, int, int]:
    """The call a program's byte stands for, ``(kind, seq_id, num_tokens)``; smaller bytes make simpler calls
    (byte 0 is ``add_sequence(0)``), and ``append`` comes twice as often as the others (``frees=False``: in
    place of ``free_sequence`` too). Unless ``exact``, a call goes to a ``live`` sequence where it can:
    adding a live id appends to it, an append or a free of another id goes to a live one (or adds it)."""
    kind = ("add", "append", "append", "free" if frees else "append")[byte % 4]
    seq_id, n = byte // 4 % 4, byte // 16 % 8 + 1
    if exact or (kind == "add") != (seq_id in live):
        return kind, seq_id, n
    if kind == "add":
        return "append", seq_id, n
    if not live:
        return "add", seq_id, n
    return kind, live[seq_id % len(live)], n


def written(call: tuple[str, int, int]) -> str:
    kind, seq_id, n = call
    return {"add": f"a.add_sequence({seq_id})", "free": f"a.free_sequence({seq_id})"}.get(
        kind, f"a.append({seq_id}, {n})")


def state(mine: Any) -> tuple:
    """The reader's free stack, block tables and lengths, copied."""
    return list(mine.free), {s: list(t) for s, t in mine.tables.items()}, dict(mine.seq_lens)


def replay(impl: Any, num_blocks: int, block_size: int, program: bytes, refused: tuple = (),
           free_all: bool = False, frees: bool = True, exact: bool = False) -> Iterator[Step]:
    """Each call of ``program`` (``decode``) made on the reader's allocator and pagedlib's (the constructor
    first, as a step with no call), skipping the calls pagedlib refuses unless their error is in
    ``refused``; with ``free_all``, every live sequence is freed at the end."""
    calls = [f"a = BlockAllocator(num_blocks={num_blocks}, block_size={block_size})"]
    mine = impl.BlockAllocator(num_blocks, block_size)
    ref = PagedKVCache(num_blocks, 1, block_size, 1, 1)
    yield Step(mine, ref, ("new", 0, 0), None, None, (), calls[0])

    def program_calls() -> Iterator[tuple[str, int, int]]:     # decoded as they come: the live ids change
        for byte in program:
            yield decode(byte, sorted(ref.tables), frees, exact)
        if free_all:
            yield from [("free", seq_id, 0) for seq_id in list(ref.tables)]

    for kind, seq_id, n in program_calls():
        want = do(ref, kind, seq_id, n, pagedlib=True)
        if isinstance(want, Exception) and not isinstance(want, refused):
            continue
        before = state(mine)
        got = do(mine, kind, seq_id, n)
        calls.append(written((kind, seq_id, n)))
        if isinstance(got, Exception) and not isinstance(want, Exception):
            raise Failed(f"{calls[-1]} raised {type(got).__name__}: {got}; pagedlib's allocator accepts "
                         "this call", case="; ".join(calls))
        yield Step(mine, ref, (kind, seq_id, n), got, want, before, "; ".join(calls))


INVARIANTS = {1: "one owner", 2: "free means free", 3: "valid ids", 4: "right size"}


def broken(mine: Any, num_blocks: int, block_size: int) -> tuple[int, str] | None:
    """The first invariant of notebook 02 that the reader's allocator breaks, ``(number, what)``, as
    ``pagedlib.testing.check_invariants`` finds it in a ``BlockManager`` given the reader's state (0: its
    tables and lengths name different sequences); ``None`` when all hold."""
    manager = BlockManager(num_blocks, block_size)
    manager.free[:] = list(mine.free)
    manager.tables.update((s, list(t)) for s, t in mine.tables.items())
    manager.seq_lens.update(mine.seq_lens)
    manager.token_ids.update((s, []) for s in mine.seq_lens)
    try:
        for block, held in enumerate(holders(manager)):
            owners = sorted({s for s, _ in held}, key=repr)
            if len(owners) > 1:
                return 1, f"block {block} belongs to sequences {owners}"
            manager.ref_counts[block] = len(held)       # the reader keeps no counts: one per holder
        check_invariants(manager)
    except InvariantError as error:
        number, _, what = str(error).partition(": ")
        return (int(number), what) if number.isdigit() else (0, str(error))
    return None


def invariant(step: Step, number: int, num_blocks: int, block_size: int) -> None:
    found = broken(step.mine, num_blocks, block_size)
    if found is not None and found[0] == number:
        raise Failed(f"after {written(step.call) if step.before else 'the constructor'}, invariant {number} "
                     f"of notebook 02 ({INVARIANTS[number]}) breaks: {found[1]}", case=step.case)


def same_as_pagedlib(step: Step) -> None:
    """The reader's allocator agrees with pagedlib's after ``step``: what the call returned, the free stack
    in order, the tables, the lengths and the count of free blocks."""
    mine, ref, case = step.mine, step.ref, step.case
    if step.call[0] in ("append", "free"):
        which = "taken, in order" if step.call[0] == "append" else "given back, in table order"
        expect_equal(f"what {written(step.call)} returns: the blocks {which}", step.want, step.got, case)
    expect_equal("the free stack (its top is the last element)", ref.free, list(mine.free), case)
    expect_equal("the block tables", ref.tables, {s: list(t) for s, t in mine.tables.items()}, case)
    expect_equal("the sequence lengths", ref.seq_lens, dict(mine.seq_lens), case)
    expect_equal("num_free_blocks", ref.num_free_blocks, mine.num_free_blocks, case)


def fresh_pool(impl: Any) -> None:
    started(impl)
    @programs(100)
    @given(program=PROGRAMS, **POOLS)
    def prop(num_blocks, block_size, program):
        for step in replay(impl, num_blocks, block_size, program, frees=False):
            same_as_pagedlib(step)
    prop()


def same_ids(impl: Any) -> None:
    started(impl)
    @programs(100)
    @given(program=PROGRAMS, **POOLS)
    def prop(num_blocks, block_size, program):
        for step in replay(impl, num_blocks, block_size, program, free_all=True):
            same_as_pagedlib(step)
    prop()


def right_size(impl: Any) -> None:
    started(impl)
    @programs(100)
    @given(program=PROGRAMS, **POOLS)
    def prop(num_blocks, block_size, program):
        for step in replay(impl, num_blocks, block_size, program):
            for seq_id, length in step.ref.seq_lens.items():
                expect_equal(f"seq_lens[{seq_id}]", length, step.mine.seq_lens.get(seq_id), step.case)
                held = list(step.mine.tables.get(seq_id, []))
                want = ceil_div(length, block_size)
                if len(held) != want:
                    raise Failed(f"blocks held by sequence {seq_id}, of length {length}: ceil({length} / "
                                 f"{block_size}) (its table is {held})", expected=want, got=len(held),
                                 case=step.case)
    prop()


def holds(number: int):
    """A check that invariant ``number`` holds after every call (and after freeing every sequence)."""
    def run(impl: Any) -> None:
        started(impl)
        @programs(100)
        @given(program=PROGRAMS, **POOLS)
        def prop(num_blocks, block_size, program):
            for step in replay(impl, num_blocks, block_size, program, free_all=True):
                invariant(step, number, num_blocks, block_size)
        prop()
    return run


def every_block_back(impl: Any) -> None:
    started(impl)
    @programs(100)
    @given(program=PROGRAMS, **POOLS)
    def prop(num_blocks, block_size, program):
        for step in replay(impl, num_blocks, block_size, program, free_all=True):
            kind, seq_id, _ = step.call
            if kind == "free":
                held = step.before[1].get(seq_id, [])
                expect_equal(f"what {written(step.call)} returns: every block it held, in table order", held,
                             step.got, step.case)
                expect_equal(f"num_free_blocks after {written(step.call)}: {len(step.before[0])} + "
                             f"{len(held)} blocks", len(step.before[0]) + len(held),
                             step.mine.num_free_blocks, step.case)
            invariant(step, 2, num_blocks, block_size)
        expect_equal("the free stack, sorted, once every sequence is freed: every block once",
                     list(range(num_blocks)), sorted(step.mine.free), step.case)
    prop()


def new_lists(impl: Any) -> None:
    started(impl)
    @programs(100)
    @given(program=PROGRAMS, **POOLS)
    def prop(num_blocks, block_size, program):
        for step in replay(impl, num_blocks, block_size, program, free_all=True):
            if isinstance(step.got, list):
                now = state(step.mine)
                step.got.append(num_blocks)                 # a caller adds to the list it was given
                after = state(step.mine)
                step.got.pop()
                if after != now:
                    raise Failed(f"the list {written(step.call)} returned is one your allocator keeps: "
                                 "adding to it changed your free stack, tables or lengths",
                                 expected=now, got=after, case=step.case)
    prop()


def unchanged(step: Step, error: type) -> None:
    """``step``'s call raised ``error`` and left the reader's state exactly as it was."""
    call = written(step.call)
    if not isinstance(step.got, error):
        got = f"{type(step.got).__name__}: {step.got}" if isinstance(step.got, Exception) else step.got
        raise Failed(f"{call} must raise {error.__name__} (pagedlib raises {type(step.want).__name__}: "
                     f"{step.want})", expected=error.__name__, got=got, case=step.case)
    for what, before, after in zip(("free stack", "block tables", "sequence lengths"), step.before,
                                   state(step.mine)):
        expect_equal(f"the {what} after the refused {call}: as before it", before, after, step.case)
    expect_equal(f"num_free_blocks after the refused {call}: as before it", len(step.before[0]),
                 step.mine.num_free_blocks, step.case)


def refused(error: type, pagedlib_error: type, pools: dict, exact: bool = False):
    """A check that every call pagedlib refuses with ``pagedlib_error`` raises ``error`` and changes
    nothing (``exact``: calls name any id, live or not)."""
    def run(impl: Any) -> None:
        started(impl)
        @programs(100)
        @given(program=PROGRAMS, **pools)
        def prop(num_blocks, block_size, program):
            for step in replay(impl, num_blocks, block_size, program, (pagedlib_error,), exact=exact):
                if isinstance(step.want, pagedlib_error):
                    unchanged(step, error)
        prop()
    return run


CHECKS = (
    Check("a fresh pool's stack is [num_blocks - 1, ..., 1, 0]: appends take blocks 0, 1, 2, ... off its top",
          fresh_pool,
          "notebook 02, section 2 (Build a cache): the free stack starts as [num_blocks-1, ..., 1, 0]"),
    Check("a sequence of n tokens holds ceil(n / block_size) blocks: a new one when a token starts a block",
          right_size,
          "notebook 02, section 4 (Four invariants): 4, right size; section 2 says when a block is popped"),
    Check("a freed sequence's blocks go back on the stack, its last on top: the same block ids as pagedlib",
          same_ids,
          "notebook 02, section 1 (Fixed blocks and a stack): release pushes the last block back last"),
    Check("append and free_sequence return new lists: changing one changes nothing in the allocator",
          new_lists, "notebook 02, section 2 (Build a cache)"),
    Check("no block belongs to two sequences, or twice to one", holds(1),
          "notebook 02, section 4 (Four invariants): 1, one owner"),
    Check("a freed sequence returns every block: each block is free or held, never both, none lost",
          every_block_back, "notebook 02, section 4 (Four invariants): 2, free means free"),
    Check("every block id is real: 0 <= id < num_blocks", holds(3),
          "notebook 02, section 4 (Four invariants): 3, valid ids"),
    Check("an append that does not fit raises RuntimeError and changes nothing",
          refused(RuntimeError, OutOfBlocksError, SMALL_POOLS),
          "notebook 02, section 7 (Lifecycle: interleaving, frees, exhaustion): count the blocks, then "
          "take them"),
    Check("an append or free of an unknown or freed sequence raises KeyError and changes nothing",
          refused(KeyError, UnknownSequenceError, POOLS, exact=True),
          "notebook 02, section 7 (Lifecycle: interleaving, frees, exhaustion): unknown ids"),
)
TASK = Task("allocator", "02", "allocator.py", "A block allocator: a free stack, a block table per sequence",
            CHECKS)
