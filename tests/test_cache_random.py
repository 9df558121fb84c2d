"""Long random runs (issue 30's acceptance): prompts that share prefixes (diverging at and inside block
boundaries) are added, prefilled in chunks, batched like a model step (``cache.reserving``),
decoded, forked and freed, on four caches at once: the hash cache and the radix tree each in a roomy pool
and in a tight one. In the tight pools calls run out of blocks and are interrupted (an exception injected
into a K/V write, a block copy, a registration or an eviction, at a random call). After every operation
every cache holds its invariants and reads back exactly the K/V of its sequences' tokens; a refused or
interrupted call changes nothing a sequence holds; and the roomy pools, where no eviction ever happens,
find the same full blocks with either design."""

from __future__ import annotations

import test_cache_stateful as stateful
import torch
from helpers import snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlib.core.cache import OutOfBlocksError, PagedKVCache
from pagedlib.core.kv_pool import KVPool
from pagedlib.testing import check_invariants, state_diff

BS = 4
STEM = [1, 2, 3, 4, 5, 6, 7, 8, 9]
PROMPTS = [STEM + [10, 11, 12, 13, 14, 15, 16], STEM + [10, 11, 20, 21, 22], STEM[:4] + [30, 31, 32, 33, 34],
           STEM + [10, 11, 12, 13, 14, 15, 16], STEM[:6], [40, 41, 42, 43, 44, 45, 46, 47, 48],
           STEM + [10, 11, 20, 21, 22, 23, 24, 25, 26, 27], STEM[:8] + [50]]
MAX_LENGTH = 28  # a sequence decodes until it holds this many tokens
SEQ_IDS = st.integers(0, 5)
TARGETS = ["write", "copy_blocks", "register", "evict"]  # the steps an interrupt can stop

WORK = st.one_of(
    st.tuples(st.just("add"), SEQ_IDS, st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("advance"), SEQ_IDS, st.integers(1, 3)),              # a chunk: up to k blocks more
    st.tuples(st.just("step"), st.lists(SEQ_IDS, max_size=4, unique=True), st.integers(1, 2)),
    st.tuples(st.just("decode"), SEQ_IDS, st.integers(0, 3)),
)
OPERATIONS = st.one_of(
    WORK,
    st.tuples(st.just("fork"), SEQ_IDS, SEQ_IDS),
    st.tuples(st.just("free"), SEQ_IDS),
    st.tuples(st.just("lookup"), st.integers(0, len(PROMPTS) - 1)),
    st.tuples(st.just("interrupt"), st.sampled_from(TARGETS), st.integers(1, 3), WORK),
)


class Runner:
    """One cache and what its sequences should hold: ``tokens[s]`` (K/V written) and ``goal[s]`` (the
    prompt, then the decoded tokens: what ``tokens[s]`` grows towards)."""

    def __init__(self, design: str, num_blocks: int) -> None:
        self.cache = PagedKVCache(num_blocks, stateful.L, BS, stateful.H, stateful.D, fill=float("nan"),
                                  enable_prefix_caching=True, prefix_cache=design)
        self.tight = num_blocks < 100
        self.tokens: dict[int, list[int]] = {}
        self.goal: dict[int, list[int]] = {}

    def run(self, operation: tuple) -> object:
        """Apply one operation; a tight pool may refuse it (nothing changes). Returns what to compare."""
        kind = operation[0]
        if kind == "interrupt":
            if self.tight:
                self.interrupted(*operation[1:])
            return None
        if not self.tight:
            return getattr(self, kind)(*operation[1:])
        snap = snapshot(self.cache)
        try:
            return getattr(self, kind)(*operation[1:])
        except OutOfBlocksError:
            assert state_diff(self.cache, snap) == []
        return None

    def add(self, seq: int, prompt: int) -> int | None:
        if seq in self.tokens:
            return None
        found = self.cache.add_sequence(seq, PROMPTS[prompt])
        self.tokens[seq] = PROMPTS[prompt][:found]
        self.goal[seq] = list(PROMPTS[prompt])
        return found

    def targets(self, seqs: list[int], blocks: int) -> list[tuple[int, int]]:
        """(sequence, length to reach) for each live one: ``blocks`` block boundaries further (the same
        boundary whatever part of a block the radix tree found), one decoded token if caught up."""
        out = []
        for seq in seqs:
            if seq not in self.tokens:
                continue
            have = len(self.tokens[seq])
            if have == len(self.goal[seq]) and have < MAX_LENGTH:
                self.goal[seq].append(seq % 4)
            target = min(len(self.goal[seq]), (have // BS + blocks) * BS)
            if target > have:
                out.append((seq, target))
        return out

    def step(self, seqs: list[int], blocks: int) -> None:
        """Several sequences at once, as the model's step does: slots reserved, copies made, K/V written."""
        todo = self.targets(seqs, blocks)
        if not todo:
            return
        ids = [seq for seq, _ in todo]
        new = [self.goal[seq][len(self.tokens[seq]):target] for seq, target in todo]
        kv = torch.cat([stateful.kv_of(self.goal[seq][:target], len(self.tokens[seq]))
                        for seq, target in todo], dim=2)                     # [2, L, n, H, D]

        with self.cache.reserving(ids, new) as batch:                            # what a model's step does
            self.cache.pool.copy_blocks(batch.copies)
            self.cache.pool.write([slot for row in batch.slots for slot in row], kv[0], kv[1])
        for seq, tokens in zip(ids, new):
            self.tokens[seq] += tokens

    def advance(self, seq: int, blocks: int) -> None:
        """One sequence's next chunk (prefill in chunks), through ``append_tokens``."""
        for chunk_of, target in self.targets([seq], blocks):
            new = self.goal[chunk_of][len(self.tokens[chunk_of]):target]
            kv = stateful.kv_of(self.goal[chunk_of][:target], len(self.tokens[chunk_of]))
            self.cache.append_tokens(chunk_of, kv[0], kv[1], token_ids=new)
            self.tokens[chunk_of] += new

    def decode(self, seq: int, token: int) -> None:
        if seq not in self.tokens or len(self.tokens[seq]) != len(self.goal[seq]):
            return
        if len(self.goal[seq]) >= MAX_LENGTH:
            return
        kv = stateful.kv_of(self.goal[seq] + [token], len(self.goal[seq]))[:, :, 0]   # [2, L, H, D]
        self.cache.append_token(seq, kv[0], kv[1], token_id=token)
        self.goal[seq].append(token)
        self.tokens[seq].append(token)

    def fork(self, parent: int, child: int) -> None:
        if parent not in self.tokens or child in self.tokens:
            return
        self.cache.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.goal[child] = list(self.tokens[parent])

    def free(self, seq: int) -> None:
        if seq in self.tokens:
            self.cache.free_sequence(seq)
            del self.tokens[seq]
            del self.goal[seq]

    def lookup(self, prompt: int) -> int:
        return len(self.cache.prefix_cache.peek(PROMPTS[prompt]))

    def interrupted(self, target: str, nth: int, work: tuple) -> None:
        """``work`` with a ``KeyboardInterrupt`` raised by the ``nth`` call of ``target``: if it fires,
        nothing a sequence holds changes (evicted blocks may come back as plain free blocks)."""
        owner = KVPool
        if target in ("register", "evict"):
            owner = type(self.cache.prefix_cache)
        original = getattr(owner, target)
        calls = []

        def interrupting(obj, *args, **kwargs):
            calls.append(args)
            if len(calls) == nth:
                raise KeyboardInterrupt
            return original(obj, *args, **kwargs)

        snap = snapshot(self.cache)
        tokens = {seq: list(held) for seq, held in self.tokens.items()}
        goal = {seq: list(wanted) for seq, wanted in self.goal.items()}
        evicted = self.cache.prefix_cache_stats()["evicted_blocks"]
        setattr(owner, target, interrupting)
        try:
            self.run(work)
        except KeyboardInterrupt:
            allowed = {"k", "v"}
            if self.cache.prefix_cache_stats()["evicted_blocks"] > evicted:
                allowed |= {"free", "prefix_cache"}
            assert set(state_diff(self.cache, snap)) <= allowed, state_diff(self.cache, snap)
            self.tokens = tokens
            self.goal = goal
        finally:
            setattr(owner, target, original)

    def check(self) -> None:
        check_invariants(self.cache)
        assert self.cache.token_ids == self.tokens
        for seq, tokens in self.tokens.items():
            k, v = self.cache.gather(seq)                                       # [L, n, H, D]
            want = stateful.kv_of(tokens, 0)
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), f"sequence {seq} reads back wrong"


PERFORMED = []


@settings(max_examples=45, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=st.lists(OPERATIONS, min_size=40, max_size=70), tight=st.integers(4, 10))
def run_program(program: list[tuple], tight: int) -> None:
    roomy = [Runner("hash", 512), Runner("radix", 512)]
    runners = roomy + [Runner("hash", tight), Runner("radix", tight)]
    for operation in program:
        results = [runner.run(operation) for runner in runners]
        for runner in runners:
            runner.check()
        hash_result, radix_result = results[0], results[1]
        if operation[0] == "add" and hash_result is not None:
            assert hash_result == radix_result // BS * BS, operation  # the tree may find part of a block more
        if operation[0] == "lookup":
            assert hash_result == radix_result, operation
        assert roomy[0].tokens.keys() == roomy[1].tokens.keys()
        PERFORMED.append(operation[0])


def test_long_random_runs_hold_the_invariants_and_agree_with_the_hash_cache():
    PERFORMED.clear()
    run_program()
    assert len(PERFORMED) >= 2000, len(PERFORMED)
    for kind in ("add", "advance", "step", "decode", "fork", "free", "lookup", "interrupt"):
        assert PERFORMED.count(kind) >= 50, (kind, PERFORMED.count(kind))
