"""Task ``slots`` (notebook 03): where a token lives, through its block table, and back.

The oracle is pagedlib's cache holding one sequence whose block table is the generated one: its free stack
is arranged with ``free_order`` (notebook 02, section 3) so that appending ``len(table) * block_size``
tokens takes exactly those blocks. ``BlockManager.slots`` then gives every token's flat slot id and
``PagedKVCache.slot`` a token's ``(block, offset)``, or its ``IndexError`` for a position it does not hold.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlib.core.cache import PagedKVCache
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal


def examples(n: int) -> settings:
    """``n`` generated cases, and only the smallest failure reported (a wrong answer can fail two ways)."""
    return settings(cases(n), report_multiple_bugs=False)


def started(impl: Any) -> None:
    """Each function called once on a small case before the properties run: ``NotImplementedError`` goes up
    at once (hypothesis would spend seconds shrinking it); any other error is left to the property, which
    shrinks it to its smallest case."""
    for call in (lambda: impl.slot_of([0], 1, 0), lambda: impl.slot_mapping([0], 1, 0, 1),
                 lambda: impl.block_and_offset(0, 1)):
        try:
            call()
        except NotImplementedError:
            raise
        except Exception:
            pass


TABLES = st.lists(st.integers(0, 63), unique=True, min_size=1, max_size=8)
BLOCK_SIZES = st.integers(1, 16)


@lru_cache(maxsize=64)
def pagedlib_cache(table: tuple[int, ...], block_size: int) -> PagedKVCache:
    """pagedlib's cache holding sequence 0, whose block table is ``table``, every slot of it written."""
    cache = PagedKVCache(max(table, default=0) + 1, 1, block_size, 1, 1, free_order=table)
    cache.add_sequence(0)
    kv = torch.zeros(1, len(table) * block_size, 1, 1)        # [num_layers, tokens, kv_heads, head_dim]
    cache.append_tokens(0, kv, kv)
    assert cache.tables[0] == list(table)
    return cache


def slots(table: list[int], block_size: int) -> list[int]:
    """pagedlib's flat slot id of every token the table holds, in position order."""
    return pagedlib_cache(tuple(table), block_size).manager.slots(0)


@st.composite
def tables_and_positions(draw: Any) -> tuple[list[int], int, int]:
    table, block_size = draw(TABLES), draw(BLOCK_SIZES)
    return table, block_size, draw(st.integers(0, len(table) * block_size - 1))


def slot_of(impl: Any) -> None:
    started(impl)
    @examples(100)
    @given(case=tables_and_positions())
    def prop(case):
        table, block_size, position = case
        shown = dict(block_table=table, block_size=block_size, position=position)
        expect_equal(f"slot id of position {position}", slots(table, block_size)[position],
                     impl.slot_of(table, block_size, position), shown)
    prop()


def boundaries(impl: Any) -> None:
    started(impl)
    @examples(100)
    @given(table=TABLES, block_size=BLOCK_SIZES)
    def prop(table, block_size):
        want = slots(table, block_size)
        edges = sorted({0, len(want) - 1} | {p for k in range(1, len(table)) for p in (k * block_size - 1,
                                                                                         k * block_size)})
        for position in edges:
            shown = dict(block_table=table, block_size=block_size, position=position)
            expect_equal(f"slot id of position {position}: offset {position % block_size} of block "
                         f"table[{position // block_size}]", want[position],
                         impl.slot_of(table, block_size, position), shown)
    prop()


@st.composite
def ranges(draw: Any) -> tuple[list[int], int, int, int]:
    table, block_size = draw(TABLES), draw(BLOCK_SIZES)
    start = draw(st.integers(0, len(table) * block_size))
    return table, block_size, start, draw(st.integers(start, len(table) * block_size))


def mapping(impl: Any) -> None:
    started(impl)
    @examples(100)
    @given(case=ranges())
    def prop(case):
        table, block_size, start, stop = case
        shown = dict(block_table=table, block_size=block_size, start=start, stop=stop)
        expect_equal("slot ids of positions start .. stop - 1", slots(table, block_size)[start:stop],
                     impl.slot_mapping(table, block_size, start, stop), shown)
    prop()


def must_raise(call: Any, what: str, shown: dict) -> None:
    """``call()`` raises ``IndexError`` (a reader's ``NotImplementedError`` goes on up)."""
    try:
        got = call()
    except IndexError:
        return
    except NotImplementedError:
        raise
    except Exception as error:
        got = f"{type(error).__name__}: {error}"
        raise Failed(what, expected="IndexError", got=got, case=shown) from error
    raise Failed(what, expected="IndexError", got=f"it returned {got!r}", case=shown)


def outside(impl: Any) -> None:
    started(impl)
    @examples(100)
    @given(table=st.lists(st.integers(0, 63), unique=True, max_size=8), block_size=BLOCK_SIZES,
           past=st.integers(0, 40), before=st.booleans())
    def prop(table, block_size, past, before):
        capacity = len(table) * block_size
        position = -1 - past if before else capacity + past
        try:                                            # pagedlib holds no such position either
            pagedlib_cache(tuple(table), block_size).slot(0, position)
            raise AssertionError(f"pagedlib's cache holds position {position}")
        except IndexError:
            pass
        holds = f"holds positions 0 to {capacity - 1}" if capacity else "holds no position"
        shown = dict(block_table=table, block_size=block_size, position=position)
        must_raise(lambda: impl.slot_of(table, block_size, position),
                   f"slot_of at position {position}: the table {holds}", shown)
        start, stop = (position, capacity) if before else (0, position + 1)
        shown = dict(block_table=table, block_size=block_size, start=start, stop=stop)
        must_raise(lambda: impl.slot_mapping(table, block_size, start, stop),
                   f"slot_mapping from {start} to {stop}: the table {holds}", shown)
    prop()


def inverse(impl: Any) -> None:
    started(impl)
    @examples(100)
    @given(case=tables_and_positions())
    def prop(case):
        table, block_size, position = case
        slot = slots(table, block_size)[position]
        want = tuple(pagedlib_cache(tuple(table), block_size).slot(0, position))
        expect_equal(f"(block, offset) of slot {slot}, where position {position} lives", want,
                     impl.block_and_offset(slot, block_size), dict(slot=slot, block_size=block_size))
    prop()


TASK = Task("slots", "03", "slots.py", "A token's slot through the block table, and back", (
    Check("token p lives in slot table[p // block_size] * block_size + p % block_size", slot_of,
          "notebook 03, section 3 (The trace of the article, one step at a time): step 1, where token 6 "
          "lives"),
    Check("the last token of a block and the first of the next land in their own blocks (no off-by-one)",
          boundaries,
          "notebook 02, section 2 (Build a cache): position p lives in logical block p // block_size, at "
          "offset p % block_size"),
    Check("slot_mapping lists the slots of positions start to stop - 1, in order", mapping,
          "notebook 02, section 6 (A whole decode step at once: `append_batch`): flat slot ids, vLLM's "
          "slot_mapping"),
    Check("a position outside the table (negative, or len(table) * block_size and past) raises IndexError",
          outside, "notebook 03, section 3 (The trace of the article, one step at a time): a table of n "
          "blocks holds positions 0 to n * block_size - 1"),
    Check("a slot splits back into its block and offset", inverse,
          "notebook 02, section 6 (A whole decode step at once: `append_batch`): the kernel splits each slot "
          "id into block and offset"),
))
