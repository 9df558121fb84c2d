"""Hypothesis state machine: random add / append / batch / free / exhaust sequences against a plain-Python
model of the cache. After every step the four invariants hold and ``gather`` returns exactly the K/V
written for every live sequence; every call that fails leaves the whole state (pools included) unchanged.
"""

from __future__ import annotations

import torch
from helpers import assert_unchanged, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedlib.cache import OutOfBlocksError, PagedKVCache
from pagedlib.checks import ceil_div

L, H, D = 2, 1, 2  # tiny geometry: the bookkeeping is what is under test
SEQ_IDS = st.integers(min_value=0, max_value=5)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=1, max_value=10),
        block_size=st.sampled_from([1, 2, 3, 4]),
        shuffle=st.randoms(use_true_random=False),
        initial=st.integers(min_value=1, max_value=3),
    )
    def setup(self, num_blocks: int, block_size: int, shuffle, initial: int) -> None:
        order = list(range(num_blocks))
        shuffle.shuffle(order)
        self.cache = PagedKVCache(num_blocks, L, block_size, H, D, free_order=order, fill=float("nan"))
        self.model: dict[int, list[torch.Tensor]] = {}  # seq_id -> list of [2, L, H, D] (K, V) per token
        self.counter = 0
        for seq in range(initial):
            self.cache.add_sequence(seq)
            self.model[seq] = []

    # --- helpers ---------------------------------------------------------------------------------

    def tokens(self, n: int) -> torch.Tensor:
        """``n`` fresh, never-seen tokens: ``[2, L, n, H, D]`` (K and V), all values distinct."""
        base = torch.arange(self.counter, self.counter + n, dtype=torch.float32)
        self.counter += n
        t = base[None, None, :, None, None] + torch.zeros(2, L, n, H, D)
        return t + torch.arange(2 * L * H * D, dtype=torch.float32).reshape(2, L, 1, H, D) / 100

    def blocks_needed(self, seq: int, n: int) -> int:
        bs = self.cache.block_size
        have = len(self.model[seq])
        return ceil_div(have + n, bs) - ceil_div(have, bs)

    def live(self) -> list[int]:
        return sorted(self.model)

    # --- rules -----------------------------------------------------------------------------------

    @rule(seq=SEQ_IDS)
    def add(self, seq: int) -> None:
        if seq in self.model:
            snap = snapshot(self.cache)
            try:
                self.cache.add_sequence(seq)
                raise AssertionError("adding an existing id must raise")
            except ValueError:
                pass
            assert_unchanged(self.cache, snap)
        else:
            self.cache.add_sequence(seq)
            self.model[seq] = []

    @rule(seq=SEQ_IDS)
    def unknown_id(self, seq: int) -> None:
        if seq in self.model:
            return
        snap = snapshot(self.cache)
        kv = self.tokens(1)[:, :, 0]
        for call in (lambda: self.cache.append_token(seq, kv[0], kv[1]),
                     lambda: self.cache.free_sequence(seq),
                     lambda: self.cache.gather(seq)):
            try:
                call()
                raise AssertionError("an unknown id must raise KeyError")
            except KeyError as e:
                assert repr(seq) in str(e)
        assert_unchanged(self.cache, snap)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append_token(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        kv = self.tokens(1)[:, :, 0]  # [2, L, H, D]
        if self.blocks_needed(seq, 1) > self.cache.num_free_blocks:
            self.expect_out_of_blocks(lambda: self.cache.append_token(seq, kv[0], kv[1]))
        else:
            slot = self.cache.append_token(seq, kv[0], kv[1])
            assert slot == self.cache.slot(seq, len(self.model[seq]))
            self.model[seq].append(kv)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(min_value=0, max_value=9))
    def append_tokens(self, data, n: int) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        kv = self.tokens(n)  # [2, L, n, H, D]
        needed = self.blocks_needed(seq, n)
        if needed > self.cache.num_free_blocks:
            self.expect_out_of_blocks(lambda: self.cache.append_tokens(seq, kv[0], kv[1]), needed)
        else:
            new = self.cache.append_tokens(seq, kv[0], kv[1])
            assert len(new) == needed
            self.model[seq].extend(kv[:, :, i] for i in range(n))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append_batch(self, data) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.live()), unique=True), label="seqs")
        kv = self.tokens(len(seqs))  # [2, L, batch, H, D]
        needed = sum(self.blocks_needed(s, 1) for s in seqs)
        if needed > self.cache.num_free_blocks:
            self.expect_out_of_blocks(lambda: self.cache.append_batch(seqs, kv[0], kv[1]), needed)
        else:
            slots = self.cache.append_batch(seqs, kv[0], kv[1])
            for i, s in enumerate(seqs):
                assert slots[i] == self.cache.slot(s, len(self.model[s]))
                self.model[s].append(kv[:, :, i])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def duplicate_batch(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        kv = self.tokens(2)
        snap = snapshot(self.cache)
        try:
            self.cache.append_batch([seq, seq], kv[0], kv[1])
            raise AssertionError("duplicate ids in a batch must raise")
        except ValueError:
            pass
        assert_unchanged(self.cache, snap)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def exhaust(self, data) -> None:
        """Ask for one token more than the pool can still hold."""
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        bs = self.cache.block_size
        room = -len(self.model[seq]) % bs  # unwritten slots of the last block
        n = room + self.cache.num_free_blocks * bs + 1
        kv = self.tokens(n)
        self.expect_out_of_blocks(lambda: self.cache.append_tokens(seq, kv[0], kv[1]),
                                  self.cache.num_free_blocks + 1)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        before = self.cache.num_free_blocks
        blocks = list(self.cache.tables[seq])
        assert self.cache.free_sequence(seq) == blocks
        assert self.cache.num_free_blocks == before + len(blocks)
        assert self.cache.free[len(self.cache.free) - len(blocks):] == blocks[::-1]
        del self.model[seq]

    def expect_out_of_blocks(self, call, needed: int | None = None) -> None:
        snap = snapshot(self.cache)
        free = self.cache.num_free_blocks
        try:
            call()
            raise AssertionError("expected OutOfBlocksError")
        except OutOfBlocksError as e:
            assert e.free == free and e.needed > free
            if needed is not None:
                assert e.needed == needed
        assert_unchanged(self.cache, snap)

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def bookkeeping(self) -> None:
        c = self.cache
        c.check_invariants()
        assert c.seq_lens == {s: len(t) for s, t in self.model.items()}
        used = sum(ceil_div(len(t), c.block_size) for t in self.model.values())
        assert c.num_free_blocks == c.num_blocks - used

    @invariant()
    def contents(self) -> None:
        for s, toks in self.model.items():
            k, v = self.cache.gather(s)  # [L, n, H, D]
            want = torch.stack(toks, dim=2) if toks else torch.zeros(2, L, 0, H, D)
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), f"sequence {s} reads back wrong"


CacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
