"""Hypothesis state machine: random add / prefix-cached add / fork / append (token, prompt, batch, into
shared blocks) / free / exhaust / interrupted-append programs against a plain-Python model (the token ids of
each live sequence). After every step the invariants hold and ``gather`` returns exactly the K/V of every
live sequence's tokens (so no eviction and no copy-on-write ever touched a block in use); every call that
fails leaves the whole state (pools included) unchanged, and one that a ``KeyboardInterrupt`` stops halfway
changes nothing a sequence holds.
"""

from __future__ import annotations

import torch
from helpers import assert_unchanged, snapshot
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.core.kv_pool import KVPool
from pagedlib.core.prefix_cache import PrefixCache
from pagedlib.testing import check_invariants, state_diff
from pagedlib.util import ceil_div

L, H, D = 2, 1, 2  # tiny geometry: the bookkeeping is what is under test
SEQ_IDS = st.integers(min_value=0, max_value=5)
TOKENS = st.lists(st.integers(min_value=0, max_value=2), max_size=9)  # 3 token ids: prefixes repeat
PROMPTS = [[0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 2, 2, 1], [1, 1, 1, 1, 1], [0, 1, 2, 0]]
STEPS = {"register": PrefixCache, "write": KVPool, "copy_blocks": KVPool}  # steps an interrupt can stop


def kv_of(tokens: list[int], start: int) -> torch.Tensor:
    """``[2, L, n, H, D]`` K and V of ``tokens[start:]``: each a function of the whole prefix up to it."""
    out, h = [], 0
    for p, t in enumerate(tokens):
        h = (h * 7 + t + 1) % 10_007
        if p >= start:
            out.append(torch.full((2, L, H, D), float(h)) + torch.arange(2 * L * H * D).view(2, L, H, D) / 16)
    return torch.stack(out, dim=2) if out else torch.zeros(2, L, 0, H, D)


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(min_value=1, max_value=12),
        block_size=st.sampled_from([1, 2, 3, 4]),
        shuffle=st.randoms(use_true_random=False),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, shuffle, caching: bool) -> None:
        order = list(range(num_blocks))
        shuffle.shuffle(order)
        self.cache = PagedKVCache(num_blocks, L, block_size, H, D, free_order=order, fill=float("nan"),
                                  enable_prefix_caching=caching)
        self.model: dict[int, list[int]] = {}  # seq_id -> token ids whose K/V the cache holds
        self.copies = 0

    # --- helpers ---------------------------------------------------------------------------------

    def live(self) -> list[int]:
        return sorted(self.model)

    def needed(self, appends: list[tuple[int, int]]) -> tuple[int, int]:
        """(blocks needed, copies made) for appending ``n`` tokens to each ``seq``, in order."""
        c, bs, moved, blocks, copies = self.cache, self.cache.block_size, {}, 0, 0
        for s, n in appends:
            have = len(self.model[s])
            last = c.tables[s][-1] if n and have % bs else None
            copy = last is not None and c.ref_count(last) - moved.get(last, 0) > 1
            moved[last] = moved.get(last, 0) + copy
            blocks += copy + ceil_div(have + n, bs) - ceil_div(have, bs)
            copies += copy
        return blocks, copies

    def expect_out_of_blocks(self, call, needed: int) -> None:
        snap, free = snapshot(self.cache), self.cache.num_free_blocks
        try:
            call()
            raise AssertionError("expected OutOfBlocksError")
        except OutOfBlocksError as e:
            assert (e.needed, e.free) == (needed, free)
        assert_unchanged(self.cache, snap)

    def expect_error(self, call, exc: type[BaseException]) -> None:
        snap = snapshot(self.cache)
        try:
            call()
            raise AssertionError(f"expected {exc.__name__}")
        except exc:
            pass
        assert_unchanged(self.cache, snap)

    def append(self, appends: list[tuple[int, list[int]]], call) -> None:
        """Run ``call`` (which appends ``tokens`` to each ``seq``), or check it fails cleanly if too big."""
        needed, copies = self.needed([(s, len(t)) for s, t in appends])
        if needed > self.cache.num_free_blocks:
            self.expect_out_of_blocks(call, needed)
            return
        evicted = self.cache.prefix_cache_stats()["evicted_blocks"]
        call()
        self.copies += copies
        for s, t in appends:
            self.model[s] += t
        event(f"copies on write: {min(copies, 2)}")  # reported by --hypothesis-show-statistics
        event(f"evictions: {min(self.cache.prefix_cache_stats()['evicted_blocks'] - evicted, 2)}")

    # --- rules -----------------------------------------------------------------------------------

    @rule(seq=SEQ_IDS, prompt=st.sampled_from([None, *PROMPTS]))
    def add(self, seq: int, prompt: list[int] | None) -> None:
        c = self.cache
        if seq in self.model:
            self.expect_error(lambda: c.add_sequence(seq, prompt), ValueError)
            return
        hit = c.add_sequence(seq, prompt)
        event(f"prefix-cache hit: {hit > 0}")
        if not c.prefix_cache or not prompt:
            assert hit == 0 and c.tables[seq] == []
        assert hit % c.block_size == 0 and hit <= max(0, len(prompt or []) - 1)
        self.model[seq] = list(prompt or [])[:hit]
        rest = list(prompt or [])[hit:]
        kv = kv_of(self.model[seq] + rest, hit)
        self.append([(seq, rest)], lambda: c.append_tokens(seq, kv[0], kv[1], token_ids=rest))

    @rule(parent=SEQ_IDS, child=SEQ_IDS)
    def fork(self, parent: int, child: int) -> None:
        if parent not in self.model:
            self.expect_error(lambda: self.cache.fork(parent, child), KeyError)
        elif child in self.model:
            self.expect_error(lambda: self.cache.fork(parent, child), ValueError)
        else:
            self.cache.fork(parent, child)
            self.model[child] = list(self.model[parent])

    @rule(seq=SEQ_IDS)
    def unknown_id(self, seq: int) -> None:
        if seq in self.model:
            return
        kv = kv_of([0], 0)[:, :, 0]
        for call in (lambda: self.cache.append_token(seq, kv[0], kv[1], token_id=0),
                     lambda: self.cache.free_sequence(seq),
                     lambda: self.cache.gather(seq)):
            self.expect_error(call, KeyError)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), token=st.integers(min_value=0, max_value=2))
    def append_token(self, data, token: int) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        kv = kv_of(self.model[seq] + [token], len(self.model[seq]))[:, :, 0]  # [2, L, H, D]
        self.append([(seq, [token])], lambda: self.cache.append_token(seq, kv[0], kv[1], token_id=token))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=TOKENS)
    def append_tokens(self, data, tokens: list[int]) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        kv = kv_of(self.model[seq] + tokens, len(self.model[seq]))  # [2, L, n, H, D]
        self.append([(seq, tokens)], lambda: self.cache.append_tokens(seq, kv[0], kv[1], token_ids=tokens))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def append_batch(self, data) -> None:
        seqs = data.draw(st.lists(st.sampled_from(self.live()), unique=True), label="seqs")
        new = data.draw(st.lists(st.integers(0, 2), min_size=len(seqs), max_size=len(seqs)), label="tokens")
        self.append_batch_of(seqs, new)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), children=st.lists(SEQ_IDS, min_size=1, max_size=3, unique=True))
    def sample(self, data, children: list[int]) -> None:
        """Parallel sampling: fork a sequence into siblings, then one decode step for all of them (the
        siblings share the partly filled last block: all but the last writer copy it)."""
        parent = data.draw(st.sampled_from(self.live()), label="parent")
        children = [c for c in children if c not in self.model]
        for child in children:
            self.fork(parent, child)
        new = data.draw(st.lists(st.integers(0, 2), min_size=len(children) + 1, max_size=len(children) + 1))
        self.append_batch_of([parent, *children], new)

    def append_batch_of(self, seqs: list[int], new: list[int]) -> None:
        kv = [kv_of(self.model[s] + [t], len(self.model[s]))[:, :, 0] for s, t in zip(seqs, new)]
        k = torch.stack([x[0] for x in kv], dim=1) if kv else torch.zeros(L, 0, H, D)  # [L, batch, H, D]
        v = torch.stack([x[1] for x in kv], dim=1) if kv else torch.zeros(L, 0, H, D)
        self.append([(s, [t]) for s, t in zip(seqs, new)],
                    lambda: self.cache.append_batch(seqs, k, v, token_ids=new))

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def duplicate_batch(self, data) -> None:
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        kv = kv_of([0, 0], 0)
        self.expect_error(lambda: self.cache.append_batch([seq, seq], kv[0], kv[1], token_ids=[0, 0]),
                          ValueError)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def exhaust(self, data) -> None:
        """Ask for one block more than the pool can still give."""
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        bs, have = self.cache.block_size, len(self.model[seq])
        n = -have % bs + self.cache.num_free_blocks * bs + 1
        tokens = [0] * n
        kv = kv_of(self.model[seq] + tokens, have)
        needed, _ = self.needed([(seq, n)])
        assert needed > self.cache.num_free_blocks
        call = lambda: self.cache.append_tokens(seq, kv[0], kv[1], token_ids=tokens)
        self.expect_out_of_blocks(call, needed)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=TOKENS, step=st.sampled_from(sorted(STEPS)), nth=st.integers(1, 3))
    def interrupted_append(self, data, tokens: list[int], step: str, nth: int) -> None:
        """``append_tokens`` with a ``KeyboardInterrupt`` raised by the ``nth`` call of one of its steps. If
        it fires, nothing changes but free blocks' K/V and, where cached blocks were evicted for the call, the
        prefix cache (the evicted blocks come back as plain free blocks)."""
        seq, c = data.draw(st.sampled_from(self.live()), label="seq"), self.cache
        needed, copies = self.needed([(seq, len(tokens))])
        if needed > c.num_free_blocks:
            return
        kv = kv_of(self.model[seq] + tokens, len(self.model[seq]))
        owner, original, calls = STEPS[step], getattr(STEPS[step], step), []

        def interrupting(obj, *args):
            calls.append(args)
            if len(calls) == nth:
                raise KeyboardInterrupt
            return original(obj, *args)

        snap, evicted = snapshot(c), c.prefix_cache_stats()["evicted_blocks"]
        setattr(owner, step, interrupting)
        try:
            c.append_tokens(seq, kv[0], kv[1], token_ids=tokens)
        except KeyboardInterrupt:
            event(f"interrupted in {step}")
            evictions = c.prefix_cache_stats()["evicted_blocks"] > evicted
            allowed = {"k", "v"} | ({"free", "prefix_cache"} if evictions else set())
            assert set(state_diff(c, snap)) <= allowed, state_diff(c, snap)
            return
        finally:
            setattr(owner, step, original)
        self.copies += copies
        self.model[seq] += tokens

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        c = self.cache
        seq = data.draw(st.sampled_from(self.live()), label="seq")
        alone = [b for b in c.tables[seq] if c.ref_count(b) == 1]
        before = c.num_free_blocks
        assert c.free_sequence(seq) == alone
        assert c.num_free_blocks == before + len(alone)
        del self.model[seq]

    # --- invariants ------------------------------------------------------------------------------

    @invariant()
    def bookkeeping(self) -> None:
        c = self.cache
        check_invariants(c)
        assert c.seq_lens == {s: len(t) for s, t in self.model.items()}
        assert c.num_used_blocks == len({b for t in c.tables.values() for b in t})
        assert c.cow_copies == self.copies
        if c.prefix_cache:
            assert c.token_ids == self.model

    @invariant()
    def contents(self) -> None:
        for s, tokens in self.model.items():
            k, v = self.cache.gather(s)  # [L, n, H, D]
            want = kv_of(tokens, 0)
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), f"sequence {s} reads back wrong"


#: 300 programs of up to 40 steps each (``python -m pytest tests/test_cache_stateful.py`` runs all of them)
CacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheMachine = CacheMachine.TestCase
