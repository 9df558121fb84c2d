"""Task ``sharing`` (notebook 06): blocks shared by reference counts, copy-on-write before a write into a
shared block, and block keys chained through the previous block's key.

The reader's ``SharedBlocks`` and pagedlib's ``BlockManager`` run the same calls side by side (``Run``):
each call's result, the four attributes after it and pagedlib's invariants (``pagedlib.testing``) are
compared after every call. The failing case a reader sees is the pool and the list of calls so far."""

from __future__ import annotations

import copy
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from pagedlib.core.blocks import BlockManager, OutOfBlocksError
from pagedlib.core.prefix_cache import chained_keys
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal
from pagedlib.testing import InvariantError, check_invariants

REFUSED = "RuntimeError"  # what an append the pool cannot hold gives, in a report
APPENDED = "append's result: the copy made (old block, new block), None, or RuntimeError"
FREED = "free_sequence's result: the blocks nobody holds any more, in table order"
FIELDS = ("tables", "seq_lens", "ref_counts", "free")


class Run:
    """The reader's ``SharedBlocks`` (``mine``) and pagedlib's ``BlockManager`` (``ref``), same calls."""

    def __init__(self, impl, num_blocks: int, block_size: int) -> None:
        self.case = {"num_blocks": num_blocks, "block_size": block_size, "calls": []}
        self.mine = impl.SharedBlocks(num_blocks, block_size)
        self.ref = BlockManager(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size

    def add(self, seq_id) -> None:
        self.case["calls"].append(f"add_sequence({seq_id})")
        self.mine.add_sequence(seq_id)
        self.ref.add_sequence(seq_id)

    def fork(self, parent_id, child_id) -> None:
        self.case["calls"].append(f"fork({parent_id}, {child_id})")
        self.mine.fork(parent_id, child_id)
        self.ref.fork(parent_id, child_id)

    def append(self, seq_id, n: int) -> tuple:
        """Both append. Returns pagedlib's result and the reader's: the copy, ``None`` or ``REFUSED``."""
        self.case["calls"].append(f"append({seq_id}, {n})")
        try:
            expected = self.ref.reserve([seq_id], [n]).copies
            expected = expected[0] if expected else None
        except OutOfBlocksError:
            expected = REFUSED
        try:
            got = self.mine.append(seq_id, n)
        except RuntimeError:
            got = REFUSED
        if isinstance(got, list):
            got = tuple(got)
        return expected, got

    def free(self, seq_id) -> tuple:
        """Both free ``seq_id``. Returns pagedlib's result and the reader's."""
        self.case["calls"].append(f"free_sequence({seq_id})")
        return self.ref.free_sequence(seq_id), self.mine.free_sequence(seq_id)

    def agree(self, what: str, expected, got) -> None:
        expect_equal(what, expected, got, self.case)

    def state(self) -> dict:
        """The reader's four attributes, copied."""
        return {name: copy.deepcopy(getattr(self.mine, name)) for name in FIELDS}

    def compare(self) -> None:
        """pagedlib's invariants on the reader's state, then each attribute against pagedlib's."""
        mine = self.state()
        shim = SimpleNamespace(num_blocks=self.num_blocks, block_size=self.block_size, prefix_cache=None,
                               token_ids={s: [0] * n for s, n in mine["seq_lens"].items()}, **mine)
        try:
            check_invariants(shim)
        except (InvariantError, TypeError, KeyError, IndexError) as error:
            raise Failed(f"after the last call an invariant of notebook 02/06 is broken: {error}",
                         case=self.case) from None
        for name in FIELDS:
            expect_equal(f"{name} after the last call", getattr(self.ref, name), mine[name], self.case)


CALLS = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free"]), st.integers(0, 9),
                           st.integers(1, 9)), max_size=16)


def same_as_pagedlib(impl) -> None:
    @cases(150)
    @given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 4), calls=CALLS)
    def prop(num_blocks, block_size, calls):
        run = Run(impl, num_blocks, block_size)
        live, fresh = [], 0
        for name, pick, n in calls:
            seq_id = live[pick % len(live)] if live else None
            if seq_id is None or name == "add":
                run.add(fresh)
                live.append(fresh)
                fresh += 1
            elif name == "append":
                run.agree(APPENDED, *run.append(seq_id, n))
            elif name == "fork":
                run.fork(seq_id, fresh)
                live.append(fresh)
                fresh += 1
            else:
                run.agree(FREED, *run.free(seq_id))
                live.remove(seq_id)
            run.compare()
    prop()


def copy_before_write(impl) -> None:
    @cases(150)
    @given(block_size=st.integers(1, 6), length=st.integers(1, 20), forks=st.integers(1, 3),
           writers=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8)), min_size=1, max_size=4))
    def prop(block_size, length, forks, writers):
        run = Run(impl, 64, block_size)
        run.add(0)
        run.agree(APPENDED, *run.append(0, length))
        for child in range(1, forks + 1):
            run.fork(0, child)
        for pick, n in writers:
            seq_id = pick % (forks + 1)
            start = run.mine.seq_lens[seq_id]
            copied = run.append(seq_id, n)
            table, counts = run.mine.tables[seq_id], run.mine.ref_counts
            for block in table[start // block_size:]:          # the blocks its new tokens went into
                if counts[block] != 1:
                    raise Failed(f"sequence {seq_id} wrote its tokens from position {start} on into block "
                                 f"{block}, which {counts[block]} tables hold: a sequence writes only into "
                                 f"blocks it holds alone", expected=1, got=counts[block], case=run.case)
            run.agree(APPENDED, *copied)
            run.compare()
    prop()


def freed_only_when_unheld(impl) -> None:
    @cases(150)
    @given(block_size=st.integers(1, 4), length=st.integers(1, 12),
           forks=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 6)), min_size=1, max_size=5),
           order=st.lists(st.integers(0, 9), min_size=6, max_size=6))
    def prop(block_size, length, forks, order):
        run = Run(impl, 64, block_size)
        run.add(0)
        run.agree(APPENDED, *run.append(0, length))
        for child, (pick, n) in enumerate(forks, start=1):
            run.fork(pick % child, child)
            if n:
                run.agree(APPENDED, *run.append(child, n))
        live = list(range(len(forks) + 1))
        for pick in order[:len(live)]:
            expected, freed = run.free(live.pop(pick % len(live)))
            held = {block: s for s in live for block in run.mine.tables[s]}
            for block in [*freed, *run.mine.free]:
                if block in held:
                    raise Failed(f"block {block} is free while sequence {held[block]} still holds it",
                                 case=run.case)
            run.agree(FREED, expected, freed)
            run.compare()
    prop()


def refused_changes_nothing(impl) -> None:
    @cases(150)
    @given(block_size=st.integers(1, 4), length=st.integers(1, 12), fork=st.booleans(),
           spare=st.integers(0, 2), n=st.integers(1, 12))
    def prop(block_size, length, fork, spare, n):
        run = Run(impl, -(-length // block_size) + spare, block_size)
        run.add(0)
        run.agree(APPENDED, *run.append(0, length))
        if fork:
            run.fork(0, 1)
        before = run.state()
        expected, got = run.append(int(fork), n)
        run.agree(APPENDED, expected, got)
        if expected == REFUSED and run.state() != before:
            changed = [name for name in FIELDS if run.state()[name] != before[name]]
            raise Failed(f"the append that raised RuntimeError changed {', '.join(changed)}",
                         expected={name: before[name] for name in changed},
                         got={name: run.state()[name] for name in changed}, case=run.case)
        run.compare()
    prop()


TOKEN_IDS = st.lists(st.one_of(st.integers(0, 1000), st.integers(0, 2**63 - 1)), max_size=40)


def keys_of(impl, token_ids: list[int], block_size: int) -> list:
    keys = impl.block_keys(list(token_ids), block_size)
    return list(keys) if isinstance(keys, (list, tuple)) else keys


def keys_equal(impl) -> None:
    @cases(150)
    @given(token_ids=TOKEN_IDS, block_size=st.integers(1, 8))
    def prop(token_ids, block_size):
        got = keys_of(impl, token_ids, block_size)
        expected = [key.digest for key in chained_keys(token_ids, block_size)]
        expect_equal("the block keys (hex digests)", expected, got,
                     dict(token_ids=token_ids, block_size=block_size))
    prop()


def keys_chained(impl) -> None:
    @cases(150)
    @given(block_size=st.integers(1, 5), full=st.integers(2, 6), tail=st.integers(0, 4),
           pool=st.lists(st.integers(0, 50), min_size=34, max_size=34), at=st.integers(0, 99))
    def prop(block_size, full, tail, pool, at):
        first = pool[:full * block_size + tail % block_size]
        at %= (full - 1) * block_size                       # a token before the last full block
        second = first[:at] + [first[at] + 51] + first[at + 1:]
        case = dict(first=first, second=second, block_size=block_size)
        a, b = keys_of(impl, first, block_size), keys_of(impl, second, block_size)
        expect_equal("how many keys (one per full block)", full, len(a), case)
        for index in range(full):
            if index < at // block_size and a[index] != b[index]:
                raise Failed(f"block {index} holds the same tokens after the same tokens in both, but its "
                             f"keys differ", expected=a[index], got=b[index], case=case)
            if index >= at // block_size and a[index] == b[index]:
                raise Failed(f"the two differ at token {at} (block {at // block_size}), yet block {index} "
                             f"has the same key in both: a key must depend on every token before it",
                             expected="two different keys", got=a[index], case=case)
    prop()


def no_partial_key(impl) -> None:
    @cases(150)
    @given(token_ids=TOKEN_IDS, block_size=st.integers(1, 8), extra=st.lists(st.integers(0, 9), max_size=7))
    def prop(token_ids, block_size, extra):
        whole = token_ids[:len(token_ids) // block_size * block_size]
        tail = extra[:block_size - 1]                        # never a whole block
        case = dict(token_ids=whole + tail, block_size=block_size)
        got = keys_of(impl, whole + tail, block_size)
        expect_equal("how many keys (one per full block)", len(whole) // block_size, len(got), case)
        expect_equal("the keys with a partly filled block after the full ones, against the keys without it",
                     keys_of(impl, whole, block_size), got, case)
    prop()


TASK = Task("sharing", "06", "sharing.py",
            "Fork, copy-on-write and free by reference counts; block keys chained through the parent", (
    Check("fork, append and free take pagedlib's blocks and counts, and every invariant holds after each "
          "call", same_as_pagedlib,
          "notebook 06, section 1 (Reference counts)"),
    Check("a block shared by two sequences is copied before one of them writes to it", copy_before_write,
          "notebook 06, section 2 (Copy-on-write)"),
    Check("a block returns to the pool only when no sequence holds it", freed_only_when_unheld,
          "notebook 06, section 1 (Reference counts): release"),
    Check("an append the pool cannot hold raises RuntimeError and changes nothing (the copy's block counts)",
          refused_changes_nothing,
          "notebook 06, section 2 (Copy-on-write): copy_on_write is asked before any block is taken"),
    Check("each key is pagedlib's: SHA-256 of the parent key's digest and the tokens as little-endian int64",
          keys_equal,
          "notebook 06, section 5 (Prefix caching: finding blocks by content): BlockKey"),
    Check("two prompts that differ only in an earlier block get different keys for a later block",
          keys_chained,
          "notebook 06, section 5 (Prefix caching: finding blocks by content): the chain"),
    Check("a partly filled last block gets no key", no_partial_key,
          "notebook 06, section 5 (Prefix caching: finding blocks by content): only full blocks"),
))
