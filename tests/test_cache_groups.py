"""One pool, a block table per KV-cache group (notebook 15): a sliding-window group gives back the blocks
wholly before its window at the step vLLM 0.32.0 does (``allocate_slots`` calls ``remove_skipped_blocks``
before it allocates), a reservation undone restores them, and the invariants hold per group. A hypothesis
state machine drives random adds, appends, batches, forks, frees, exhaustions, undone reservations and
interrupted appends against a plain-Python model of each sequence's tokens and of what each group still
holds; unit tests pin the layout, vLLM's numbers and the argument checks."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from helpers import assert_unchanged, snapshot
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.core.groups import FULL, NULL_BLOCK, SLIDING, KVGroup, kv_groups
from pagedlib.core.kv_pool import KVPool
from pagedlib.kernels.attention import reference_paged_attention
from pagedlib.testing import InvariantError, check_invariants, fill_unused, state_diff
from pagedlib.util import ceil_div

L, H, D = 4, 1, 2
SEQ_IDS = st.integers(min_value=0, max_value=4)
TOKENS = st.integers(min_value=0, max_value=11)
# layer kinds: two groups of two; one sliding layer and three full (four groups of one); all sliding
LAYER_TYPES = [[SLIDING, FULL, SLIDING, FULL], [FULL, SLIDING, FULL, SLIDING], [SLIDING, FULL, FULL, FULL],
               [SLIDING] * 4]
WINDOWS = [1, 3, 4, 6, 8, 1000]  # 1000: longer than every sequence, never gives a block back


def kv_of(seq_tag: int, start: int, n: int) -> torch.Tensor:
    """``[2, L, n, H, D]`` K and V of positions ``start .. start + n - 1`` of a sequence tagged ``seq_tag``:
    every (K or V, layer, position, head, dim) a different value."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    base = torch.arange(2 * L, dtype=torch.float32).view(2, L, 1, 1, 1) * 1000 + seq_tag * 100_000
    return base + pos.view(1, 1, n, 1, 1) + torch.arange(H * D, dtype=torch.float32).view(1, 1, 1, H, D) / 8


class GroupsMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=1, max_value=16),
        block_size=st.sampled_from([1, 2, 4]),
        layer_types=st.sampled_from(LAYER_TYPES),
        window=st.sampled_from(WINDOWS),
        shuffle=st.randoms(use_true_random=False),
    )
    def setup(self, num_blocks: int, block_size: int, layer_types: list[str], window: int, shuffle) -> None:
        order = list(range(num_blocks))
        shuffle.shuffle(order)
        self.groups = kv_groups(layer_types, window, L)
        self.cache = PagedKVCache(num_blocks, L, block_size, H, D, free_order=order, fill=float("nan"),
                                  groups=self.groups)
        # seq_id -> (tag of the K/V it holds per position, computed when its last reservation began)
        self.tags: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        # seq_id -> (group, position) whose K/V an interrupted append may have overwritten: given back, then
        # reused by that append, then restored by its undo; no later token's window reaches them
        self.stale: dict[int, set[tuple[int, int]]] = {}
        self.next_tag = 1

    def live(self) -> list[int]:
        return sorted(self.tags)

    # --- the model's arithmetic ------------------------------------------------------------------

    def gone(self, g: int, computed: int, length: int) -> int:
        """Blocks group ``g`` has given back of a sequence: vLLM's ``skipped // block_size``."""
        window = self.groups[g].window
        if window is None:
            return 0
        bs = self.cache.block_size
        return min(max(0, computed - window + 1) // bs, ceil_div(length, bs))

    def plan(self, appends: list[tuple[int, int]]) -> tuple[int, int]:
        """(blocks needed, blocks free) for appending ``n`` tokens to each ``seq``: free after each growing
        sequence's window groups give their blocks back (a block shared by forks is free once all its
        holders gave it back)."""
        c, bs = self.cache, self.cache.block_size
        given: dict[int, int] = {}
        for s, n in appends:
            if n == 0:
                continue
            length = len(self.tags[s])
            for g, tables in enumerate(c.group_tables):
                table = tables[s]
                for index in range(self.gone(g, self.computed[s], length), self.gone(g, length, length)):
                    given[table[index]] = given.get(table[index], 0) + 1
        free = c.num_free_blocks + sum(c.ref_count(b) == k for b, k in given.items())
        needed = 0
        for tables in c.group_tables:
            moved: dict[int, int] = {}
            for s, n in appends:
                have = len(self.tags[s])
                last = tables[s][-1] if n and have % bs else None
                copy = last is not None and c.ref_count(last) - moved.get(last, 0) > 1
                moved[last] = moved.get(last, 0) + copy
                needed += copy + ceil_div(have + n, bs) - ceil_div(have, bs)
        return needed, free

    def append(self, appends: list[tuple[int, int]], call) -> bool:
        """Run ``call``, which appends ``n`` tokens to each ``seq``, or check it fails cleanly (the model's
        block count says which). Whether it ran."""
        needed, free = self.plan(appends)
        if needed > free:
            snap = snapshot(self.cache)
            with pytest.raises(OutOfBlocksError) as error:
                call()
            assert (error.value.needed, error.value.free) == (needed, free)
            assert_unchanged(self.cache, snap)
            event("out of blocks")
            return False
        before = self.cache.num_free_blocks
        call()
        for s, n in appends:
            if n:
                self.computed[s] = len(self.tags[s])
        event(f"blocks given back: {min(max(0, self.cache.num_free_blocks - before + needed), 2)}")
        return True

    def kv_for(self, s: int, n: int) -> tuple[torch.Tensor, int]:
        tag, self.next_tag = self.next_tag, self.next_tag + 1
        return kv_of(tag, len(self.tags[s]), n), tag

    # --- rules -----------------------------------------------------------------------------------

    @rule(seq=SEQ_IDS)
    def add(self, seq: int) -> None:
        if seq in self.tags:
            return
        assert self.cache.add_sequence(seq) == 0
        assert [tables[seq] for tables in self.cache.group_tables] == [[]] * len(self.groups)
        self.tags[seq], self.computed[seq], self.stale[seq] = [], 0, set()

    @precondition(lambda self: self.tags)
    @rule(data=st.data(), n=TOKENS)
    def append_tokens(self, data, n: int) -> None:
        s = data.draw(st.sampled_from(self.live()), label="seq")
        kv, tag = self.kv_for(s, n)
        if self.append([(s, n)], lambda: self.cache.append_tokens(s, kv[0], kv[1])):
            self.tags[s] += [tag] * n

    @precondition(lambda self: self.tags)
    @rule(data=st.data())
    def append_batch(self, data) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.live()), unique=True, min_size=1), label="seqs")
        tags = []
        for _ in seqs:
            tags.append(self.next_tag)
            self.next_tag += 1
        k = torch.stack([kv_of(t, len(self.tags[s]), 1)[0, :, 0] for s, t in zip(seqs, tags)], dim=1)
        v = torch.stack([kv_of(t, len(self.tags[s]), 1)[1, :, 0] for s, t in zip(seqs, tags)], dim=1)
        if self.append([(s, 1) for s in seqs], lambda: self.cache.append_batch(seqs, k, v)):
            for s, t in zip(seqs, tags):
                self.tags[s].append(t)

    @precondition(lambda self: self.tags)
    @rule(data=st.data(), child=SEQ_IDS)
    def fork(self, data, child: int) -> None:
        parent = data.draw(st.sampled_from(self.live()), label="parent")
        if child in self.tags:
            return
        self.cache.fork(parent, child)
        self.tags[child], self.computed[child] = list(self.tags[parent]), self.computed[parent]
        self.stale[child] = set(self.stale[parent])

    @precondition(lambda self: self.tags)
    @rule(data=st.data())
    def free(self, data) -> None:
        c = self.cache
        s = data.draw(st.sampled_from(self.live()), label="seq")
        alone = [b for tables in c.group_tables for b in tables[s] if b != NULL_BLOCK and c.ref_count(b) == 1]
        before = c.num_free_blocks
        assert c.free_sequence(s) == alone
        assert c.num_free_blocks == before + len(alone)
        del self.tags[s], self.computed[s], self.stale[s]

    @precondition(lambda self: self.tags)
    @rule(data=st.data(), n=TOKENS)
    def undone_reservation(self, data, n: int) -> None:
        """``reserving`` whose ``with`` block raises (a forward pass that failed): the window groups' blocks
        given back are held again in their places, and nothing at all differs from before."""
        s = data.draw(st.sampled_from(self.live()), label="seq")
        needed, free = self.plan([(s, n)])
        if needed > free:
            return
        snap = snapshot(self.cache)
        with pytest.raises(RuntimeError, match="forward pass"):
            with self.cache.reserving([s], [[0] * n]) as batch:
                assert batch.seq_lens == [len(self.tags[s]) + n]
                if len(self.groups) > 1:
                    assert batch.group_tables[0] == batch.block_tables
                    assert batch.group_slots[0] == batch.slots
                    assert [t[0] for t in batch.group_tables] == [t[s] for t in self.cache.group_tables]
                else:
                    assert batch.group_tables is batch.group_slots is None
                nulls = [sum(t[s].count(NULL_BLOCK) for t in c.group_tables) for c in (self.cache, snap)]
                event(f"undone with blocks given back: {nulls[0] > nulls[1]}")
                raise RuntimeError("the forward pass failed")
        assert_unchanged(self.cache, snap)

    @precondition(lambda self: self.tags)
    @rule(data=st.data(), n=TOKENS, step=st.sampled_from(["write", "copy_blocks"]), nth=st.integers(1, 3))
    def interrupted_append(self, data, n: int, step: str, nth: int) -> None:
        """``append_tokens`` stopped by a ``KeyboardInterrupt`` in the pool's ``nth`` write (one per group)
        or copy: only the K/V of free blocks, and of blocks its window groups gave back and took again before
        the undo restored them (beyond the window of every later token), may differ."""
        s = data.draw(st.sampled_from(self.live()), label="seq")
        needed, free = self.plan([(s, n)])
        if needed > free:
            return
        kv, tag = self.kv_for(s, n)
        original, calls = getattr(KVPool, step), []

        def interrupting(pool, *args):
            calls.append(args)
            if len(calls) == nth:
                raise KeyboardInterrupt
            return original(pool, *args)

        snap = snapshot(self.cache)
        setattr(KVPool, step, interrupting)
        try:
            self.cache.append_tokens(s, kv[0], kv[1])
        except KeyboardInterrupt:
            assert set(state_diff(self.cache, snap)) <= {"k", "v"}, state_diff(self.cache, snap)
            length, bs = len(self.tags[s]), self.cache.block_size
            for g in range(len(self.groups)):
                first, last = self.gone(g, self.computed[s], length), self.gone(g, length, length)
                self.stale[s] |= {(g, p) for p in range(first * bs, last * bs)}
            event(f"interrupted in {step}")
            return
        finally:
            setattr(KVPool, step, original)
        if n:
            self.computed[s] = len(self.tags[s])
        self.tags[s] += [tag] * n

    @precondition(lambda self: self.tags)
    @rule(data=st.data())
    def exhaust(self, data) -> None:
        """Ask for more blocks than the pool can give, whatever the windows give back."""
        s = data.draw(st.sampled_from(self.live()), label="seq")
        n = (self.cache.num_blocks + 1) * self.cache.block_size
        kv = kv_of(0, len(self.tags[s]), n)
        assert not self.append([(s, n)], lambda: self.cache.append_tokens(s, kv[0], kv[1]))

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def bookkeeping(self) -> None:
        c = self.cache
        check_invariants(c)
        assert c.seq_lens == {s: len(t) for s, t in self.tags.items()}
        assert c.manager.computed == self.computed
        for g, tables in enumerate(c.group_tables):
            for s, table in tables.items():
                gone = self.gone(g, self.computed[s], len(self.tags[s]))
                assert table[:gone] == [NULL_BLOCK] * gone and NULL_BLOCK not in table[gone:]
        held = {b for tables in c.group_tables for t in tables.values() for b in t if b != NULL_BLOCK}
        assert c.num_used_blocks == len(held)

    @invariant()
    def figures(self) -> None:
        """The cache's figures count every group's table and no block a window gave back: each sequence
        fills, in each group, its positions past those given back, in its blocks past those."""
        c, bs = self.cache, self.cache.block_size
        filled = allocated = 0
        for s, tags in self.tags.items():
            mine = [0, 0]
            for g in range(len(self.groups)):
                gone = self.gone(g, self.computed[s], len(tags))
                mine[0] += len(tags) - gone * bs
                mine[1] += (ceil_div(len(tags), bs) - gone) * bs
            assert c.sequence_utilization(s) == (mine[0] / mine[1] if mine[1] else 1.0)
            filled, allocated = filled + mine[0], allocated + mine[1]
        assert (c.num_tokens, c.num_filled_slots, c.num_allocated_slots) == \
            (sum(map(len, self.tags.values())), filled, allocated)
        assert c.utilization == (filled / allocated if allocated else 1.0)
        assert f"filling {filled} of {allocated} allocated slots" in repr(c) or filled == c.num_tokens

    @invariant()
    def contents(self) -> None:
        """Each sequence reads back its own K/V in every layer, NaN where its layer's group gave the block
        back (no block given back, reused or copied ever touched a block still held)."""
        bs = self.cache.block_size
        for s, tags in self.tags.items():
            k, v = self.cache.gather(s)  # [L, n, H, D]
            want = torch.stack([kv_of(t, p, 1)[:, :, 0] for p, t in enumerate(tags)], dim=2) if tags else \
                torch.zeros(2, L, 0, H, D)
            for g, group in enumerate(self.groups):
                gone = self.gone(g, self.computed[s], len(tags)) * bs
                kept = [p for p in range(gone, len(tags)) if (g, p) not in self.stale[s]]
                for layer in group.layers:
                    assert k[layer, :gone].isnan().all() and v[layer, :gone].isnan().all()
                    assert torch.equal(k[layer, kept], want[0, layer, kept]), f"sequence {s}, layer {layer}"
                    assert torch.equal(v[layer, kept], want[1, layer, kept]), f"sequence {s}, layer {layer}"


GroupsMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow],
                                           phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
TestGroupsMachine = GroupsMachine.TestCase


# --- unit tests ------------------------------------------------------------------------------------

HYBRID = kv_groups([SLIDING, FULL, SLIDING, FULL], 6, L)  # (sliding 6: layers 0, 2), (full: layers 1, 3)


def test_vllm_numbers_a_300_token_prompt_then_one_decode_step():
    """Issue 54's figures from vLLM 0.32.0's own KVCacheManager (block 16, window 64): a 300-token prompt
    holds 19 blocks in each group; after one decode step the window group holds 5 (its first 14 entries
    given back: skipped = 300 - 64 + 1 = 237 tokens, 237 // 16 = 14 blocks), the full group 19."""
    groups = (KVGroup(FULL, None, (0, 1)), KVGroup(SLIDING, 64, (2, 3)))
    c = PagedKVCache(64, L, 16, H, D, groups=groups)
    c.add_sequence("r")
    k = kv_of(1, 0, 300)
    c.append_tokens("r", k[0], k[1])
    assert [len(t["r"]) for t in c.group_tables] == [19, 19]  # the prompt's step gives nothing back
    assert c.num_free_blocks == 64 - 38
    k = kv_of(1, 300, 1)
    c.append_tokens("r", k[0], k[1])
    full, window = c.group_tables[0]["r"], c.group_tables[1]["r"]
    assert len(full) == 19 and NULL_BLOCK not in full
    assert window[:14] == [NULL_BLOCK] * 14 and NULL_BLOCK not in window[14:] and len(window) == 19
    assert c.num_free_blocks == 64 - 19 - 5
    check_invariants(c)
    # the figures count both tables and no given-back entry: 301 + (301 - 14 * 16) of (19 + 5) * 16 slots
    assert (c.num_tokens, c.num_filled_slots, c.num_allocated_slots) == (301, 378, 384)
    assert "tokens: 301, filling 378 of 384 allocated slots across the KV-cache groups (utilization 98%)" \
        in repr(c)
    assert f"seq 'r': len 301, table {full} | {window}" in repr(c)


def test_a_given_back_position_has_no_slot_and_the_reference_refuses_groups():
    """``slot`` names the group it reads and refuses a position its window gave back (block -1 would index
    the pool's last block); notebook 04's reference reads one full-attention group and says so, the cache
    unchanged by both."""
    c = PagedKVCache(16, L, 4, H, D, groups=HYBRID)
    c.add_sequence("a")
    k = kv_of(1, 0, 15)
    c.append_tokens("a", k[0, :, :14], k[1, :, :14])
    c.append_tokens("a", k[0, :, 14:], k[1, :, 14:])  # the window group gives positions 0-7 back (14 - 6 + 1)
    window, full = c.group_tables[0]["a"], c.group_tables[1]["a"]
    assert window[:2] == [NULL_BLOCK] * 2 and c.slot("a", 8) == (window[2], 0)
    assert c.slot("a", 0, group=1) == (full[0], 0)
    snap = snapshot(c)
    with pytest.raises(IndexError, match=r"pos 7 of sequence 'a' is before the window of group 0 .*NULL"):
        c.slot("a", 7)
    with pytest.raises(IndexError, match=r"group must be in \[0, 2\), got 2"):
        c.slot("a", 3, group=2)
    with pytest.raises(ValueError, match="reads a cache of one full-attention group, not sliding window 6"):
        reference_paged_attention(c, "a", torch.zeros(2, 1, H, D))
    assert_unchanged(c, snap)


def test_blocks_leave_when_the_next_step_begins_not_when_the_last_one_ends():
    """vLLM gives blocks back in ``allocate_slots``, before it allocates the step's new blocks: after a
    12-token prompt (block 4, window 6) the window group still holds block 0 (tokens 0-3), although token
    11's window starts at 6; the next step (token 12, window from 7) gives it back first, and the step's two
    new blocks (one per group) fit in a pool that has one free block before it."""
    c = PagedKVCache(7, L, 4, H, D, groups=HYBRID)
    c.add_sequence(0)
    k = kv_of(1, 0, 12)
    c.append_tokens(0, k[0], k[1])
    window = c.group_tables[0][0]
    assert NULL_BLOCK not in window and c.num_free_blocks == 1
    first = window[0]
    k = kv_of(1, 12, 1)
    c.append_tokens(0, k[0], k[1])
    assert window[0] == NULL_BLOCK and c.num_free_blocks == 0
    assert window[3] == first  # given back, then taken again at once (the top of the free stack)
    assert c.manager.computed[0] == 12
    check_invariants(c)
    # tokens 13-16: block 1 goes first (13 - 6 + 1 = 8 tokens skipped), then 2 blocks are needed, 1 free:
    # refused, and block 1 is held again
    snap = snapshot(c)
    k = kv_of(1, 13, 4)
    with pytest.raises(OutOfBlocksError) as error:
        c.append_tokens(0, k[0], k[1])
    assert (error.value.needed, error.value.free) == (2, 1)
    assert_unchanged(c, snap)


def test_one_group_is_notebook_02s_layout():
    """``groups=None`` and one full group of every layer: the pool ``[num_blocks, num_layers, block_size, H,
    D]``, one table per sequence, the same state after the same calls."""
    plain = PagedKVCache(6, L, 2, H, D)
    one = PagedKVCache(6, L, 2, H, D, groups=kv_groups(None, None, L))
    for c in (plain, one):
        assert tuple(c.k.shape) == (6, L, 2, H, D) and c.group_tables == [c.tables]
        c.add_sequence(0)
        k = kv_of(1, 0, 5)
        c.append_tokens(0, k[0], k[1])
        c.fork(0, 1)
    assert state_diff(one, plain) == []


def test_a_layer_lives_at_its_index_in_its_group():
    """Layer ``l`` of the hybrid pool ``[num_blocks, 2, block_size, H, D]`` is index ``i`` of its group's
    blocks: ``layer(l)`` read through ``group_tables[group_of(l)]`` gives back what was appended for it."""
    c = PagedKVCache(8, L, 2, H, D, groups=HYBRID)
    assert tuple(c.k.shape) == (8, 2, 2, H, D)
    assert [c.group_of(layer) for layer in range(L)] == [0, 1, 0, 1]
    c.add_sequence(0)
    k = kv_of(1, 0, 5)
    c.append_tokens(0, k[0], k[1])
    for layer in range(L):
        table = c.group_tables[c.group_of(layer)][0]
        k_l, v_l = c.layer(layer)  # [num_blocks, block_size, H, D]
        for p in range(5):
            assert torch.equal(k_l[table[p // 2], p % 2], k[0, layer, p])
            assert torch.equal(v_l[table[p // 2], p % 2], k[1, layer, p])
    assert c.layer(-1)[0].data_ptr() == c.layer(3)[0].data_ptr()


def test_padded_group_leaves_its_last_index_unused():
    """Groups of unequal size (a 3-layer full group beside 1 sliding layer cut as vLLM cuts it: 4 groups of
    one) and a hand-made uneven pair: the pool has the largest group's layers; the smaller writes only its
    own."""
    uneven = (KVGroup(SLIDING, 3, (0,)), KVGroup(FULL, None, (1, 2, 3)))
    c = PagedKVCache(4, L, 2, H, D, groups=uneven, fill=float("nan"))
    assert tuple(c.k.shape) == (4, 3, 2, H, D)
    c.add_sequence(0)
    k = kv_of(1, 0, 2)
    c.append_tokens(0, k[0], k[1])
    block = c.group_tables[0][0][0]
    assert torch.equal(c.k[block, 0], k[0, 0]) and c.k[block, 1:].isnan().all()
    assert len(kv_groups([SLIDING, FULL, FULL, FULL], 3, L)) == 4


@pytest.mark.parametrize("groups, message", [
    ("full", "groups must be None or a non-empty sequence of KVGroup"),
    ([], "groups must be None or a non-empty sequence of KVGroup"),
    ([(FULL, None, (0, 1, 2, 3))], r"groups\[0\] must be a KVGroup"),
    ([KVGroup(SLIDING, 0, (0, 1, 2, 3))], r"groups\[0\].window"),
    ([KVGroup(FULL, 4, (0, 1, 2, 3))], r"groups\[0\] is full attention and must have window None"),
    ([KVGroup("mamba", None, (0, 1, 2, 3))], r"groups\[0\].kind"),
    ([KVGroup(FULL, None, ())], r"groups\[0\] must hold at least one layer"),
    ([KVGroup(FULL, None, (0, 1, 2))], "groups must hold every layer of num_layers=4 exactly once"),
    ([KVGroup(FULL, None, (0, 1, 2, 3)), KVGroup(SLIDING, 2, (3,))], "exactly once"),
    ([KVGroup(FULL, None, (0, 1, 2, 4))], r"groups\[0\].layers\[3\]"),
])
def test_bad_groups_name_the_argument(groups, message):
    with pytest.raises(ValueError, match=message):
        PagedKVCache(4, L, 2, H, D, groups=groups)


@pytest.mark.parametrize("args, message", [
    (([SLIDING, "linear_attention"], 4, 2), r"layer_types holds \['linear_attention'\]: the kinds"),
    (([SLIDING, FULL], None, 2), "sliding_window must be an int, got None"),
    (([SLIDING, FULL], 0, 2), "sliding_window must be >= 1, got 0"),
    (([FULL, FULL], None, 3), "layer_types must name num_layers=3 kinds, got 2"),
    ((FULL, None, 1), "layer_types must be None or a sequence of kinds, got str"),
    (([[1]], None, 1), r"layer_types holds \[\[1\]\]"),
    ((None, None, 0), "num_layers must be >= 1, got 0"),
    ((None, None, 2.0), "num_layers must be an int"),
])
def test_kv_groups_names_a_bad_argument(args, message):
    """``kv_groups`` is public (notebook 15 calls it on released models' layer kinds): a bad argument is a
    ValueError that names it, not a group of an unknown kind, a window of None or an empty max()."""
    with pytest.raises(ValueError, match=message):
        kv_groups(*args)


def test_invariant_7_catches_a_window_table_out_of_step():
    """``check_invariants`` names invariant 7 when a window group holds a block its window no longer reads,
    or has given back one it still reads; and invariant 1 when a block sits in two groups."""
    c = PagedKVCache(12, L, 2, H, D, groups=HYBRID)
    c.add_sequence(0)
    k = kv_of(1, 0, 9)
    c.append_tokens(0, k[0], k[1])
    k = kv_of(1, 9, 1)
    c.append_tokens(0, k[0], k[1])  # computed 9: skipped 4 tokens, 2 blocks
    check_invariants(c)
    table = c.group_tables[0][0]
    assert table[:2] == [NULL_BLOCK] * 2
    c.manager.computed[0] = 11  # as if given back at 11: 6 tokens skipped, 3 blocks
    with pytest.raises(InvariantError, match="^7: "):
        check_invariants(c)
    c.manager.computed[0] = 7  # at 7: 2 tokens, 1 block
    with pytest.raises(InvariantError, match="^7: "):
        check_invariants(c)
    c.manager.computed[0] = 9
    full = c.group_tables[1][0]
    full[0] = table[2]  # one block in both groups
    with pytest.raises(InvariantError, match="^1: .*groups"):
        check_invariants(c)


def test_fill_unused_and_block_table_per_group():
    """``fill_unused`` writes NaN into every slot no group's table holds (the blocks a window gave back
    included) and leaves every held slot alone; ``block_table(group=g)`` pads, and shows a given-back entry,
    with -1."""
    c = PagedKVCache(12, L, 2, H, D, groups=HYBRID)
    c.add_sequence(0)
    k = kv_of(1, 0, 9)
    c.append_tokens(0, k[0], k[1])
    k = kv_of(1, 9, 1)
    c.append_tokens(0, k[0], k[1])  # the window group gave back 2 blocks
    before = c.gather(0)
    fill_unused(c)
    after = c.gather(0)
    assert all(torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0)) for a, b in zip(after, before))
    held = {b for t in c.group_tables for b in t[0] if b != NULL_BLOCK}
    for block in range(12):
        assert c.k[block].isnan().all() != (block in held)
    assert c.block_table([0], group=0).tolist() == [[-1, -1, *c.group_tables[0][0][2:]]]
    assert c.block_table([0], width=6, group=1).tolist() == [[*c.group_tables[1][0], -1]]
    with pytest.raises(IndexError, match="group must be in"):
        c.block_table([0], group=2)


# vLLM 0.32.0's own KVCacheManager (no prefix caching) over a window group and a full group, run in a child
# (vLLM's import changes process-wide settings): for each scenario (block size, window, steps), the table
# length and null entries of each group after each ``allocate_slots`` (None where the request is freed)
VLLM_TABLES = """
import json, sys, torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request
out = []
for block_size, window, steps in json.loads(sys.argv[1]):
    kw = dict(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["s"], SlidingWindowSpec(sliding_window=window, **kw)),
              KVCacheGroupSpec(["f"], FullAttentionSpec(**kw))]
    manager = KVCacheManager(KVCacheConfig(num_blocks=2000, kv_cache_tensors=[], kv_cache_groups=groups),
                             max_model_len=4096, scheduler_block_size=block_size,
                             hash_block_size=block_size, enable_caching=False)
    requests, rows = {}, []
    for name, n in steps:
        if n == 0:
            manager.free(requests.pop(name))
            rows.append(None)
            continue
        if name not in requests:
            requests[name] = Request(name, prompt_token_ids=[0] * 4000, pooling_params=None,
                                     sampling_params=SamplingParams(max_tokens=1))
        request = requests[name]
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        rows.append([[len(g), sum(b.is_null for b in g)] for g in manager.coordinator.get_blocks(name)])
    out.append(rows)
print(json.dumps(out))
"""


def test_tables_step_for_step_with_vllms_kv_cache_manager():
    """Seeded random steps (prompts in chunks of 1-40 tokens, decodes, frees; several requests interleaved)
    over a window group and a full group: after every step each group's table has the length and the null
    entries that vLLM 0.32.0's ``KVCacheManager.allocate_slots`` leaves (windows 1 to 64, multiples of the
    block size and not, block sizes 1 to 16)."""
    rng = random.Random(54)
    scenarios = []
    for block_size, window in [(1, 1), (2, 3), (4, 6), (4, 8), (16, 64), (16, 5), (4, 1), (8, 100)]:
        steps, live, lengths = [], [], {}
        for _ in range(40):
            if not live or (len(live) < 3 and rng.random() < 0.2):
                live.append(f"r{len(lengths)}")
                lengths[live[-1]] = 0
            name = rng.choice(live)
            if lengths[name] > 60 and rng.random() < 0.3:
                steps.append((name, 0))
                live.remove(name)
                continue
            n = rng.choice([1, 1, 1, rng.randint(1, 40)])
            steps.append((name, n))
            lengths[name] += n
        scenarios.append((block_size, window, steps))
    done = subprocess.run([sys.executable, "-c", VLLM_TABLES, json.dumps(scenarios)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    want = json.loads(done.stdout.strip().splitlines()[-1])
    for (block_size, window, steps), rows in zip(scenarios, want):
        groups = (KVGroup(SLIDING, window, (0,)), KVGroup(FULL, None, (1,)))
        c = PagedKVCache(2000, 2, block_size, 1, 1, groups=groups)
        got = []
        for name, n in steps:
            if n == 0:
                c.free_sequence(name)
                got.append(None)
                continue
            if name not in c.seq_lens:
                c.add_sequence(name)
            with c.reserving([name], [[0] * n]):
                pass
            got.append([[len(t[name]), t[name].count(NULL_BLOCK)] for t in c.group_tables])
            check_invariants(c)
        assert got == rows, (block_size, window)
