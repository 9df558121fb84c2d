"""The radix prefix cache (notebook 11): SGLang's tree on the same ``BlockManager`` and pool as the block-hash
cache. A hypothesis state machine (the one of ``test_cache_stateful.py``, on the tree) checks the tree's
invariants after every step; fixed cases check where the two designs must agree and where they differ; the
engine with the tree generates what transformers generates, multi-turn and branching, under preemption."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may download

from unittest import mock

import test_cache_stateful as stateful
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

import pagedlib  # noqa: F401  (before transformers, which imports triton: pagedlib picks its mode first)
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.radix_cache import RadixCache


class RadixMachine(stateful.CacheMachine):
    """Every rule of the block-hash machine (adds that look up, forks, appends that insert and evict, frees,
    interrupted appends), on the radix tree, plus an interrupt inside ``insert`` and eviction refused while
    every cached block is held."""

    @initialize(num_blocks=st.integers(min_value=1, max_value=12), block_size=st.sampled_from([1, 2, 3, 4]),
                shuffle=st.randoms(use_true_random=False))
    def setup(self, num_blocks: int, block_size: int, shuffle) -> None:
        order = list(range(num_blocks))
        shuffle.shuffle(order)
        self.cache = PagedKVCache(num_blocks, stateful.L, block_size, stateful.H, stateful.D,
                                  free_order=order, fill=float("nan"), enable_prefix_caching=True,
                                  prefix_cache="radix")
        self.model, self.copies = {}, 0

    @rule(seq=stateful.SEQ_IDS, prompt=st.sampled_from([None, *stateful.PROMPTS]))
    def add(self, seq: int, prompt: list[int] | None) -> None:
        """The block-hash machine's ``add``, but the tree may find part of a block (a copy of it): any number
        of tokens but the prompt's last; K/V read back (``contents``) proves the copy right."""
        c = self.cache
        if seq in self.model:
            self.expect_error(lambda: c.add_sequence(seq, prompt), ValueError)
            return
        hit = c.add_sequence(seq, prompt)
        event(f"partial block found: {hit % c.block_size > 0}")
        assert hit <= max(0, len(prompt or []) - 1) and len(c.tables[seq]) == -(-hit // c.block_size)
        self.model[seq] = list(prompt or [])[:hit]
        rest = list(prompt or [])[hit:]
        kv = stateful.kv_of(self.model[seq] + rest, hit)
        self.append([(seq, rest)], lambda: c.append_tokens(seq, kv[0], kv[1], token_ids=rest))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=stateful.TOKENS, nth=st.integers(1, 3))
    def interrupted_insert(self, data, tokens: list[int], nth: int) -> None:
        with mock.patch.dict(stateful.STEPS, {"register": RadixCache}):
            stateful.CacheMachine.interrupted_append(self, data, tokens, "register", nth)

    @precondition(lambda self: not self.cache.prefix_cache.free_queue)
    @rule()
    def evict_refused_while_held(self) -> None:
        self.expect_error(self.cache.prefix_cache.evict, RuntimeError)


RadixMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestRadixMachine = RadixMachine.TestCase
