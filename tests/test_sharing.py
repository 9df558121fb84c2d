"""Sharing blocks (notebook 06): reference counts, fork, copy-on-write, prefix caching with LRU eviction, and
attention over shared tables equal to attention over each sequence's own contiguous K/V."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from helpers import assert_unchanged, snapshot

import pagedlib  # noqa: F401  (sets TRITON_INTERPRET=1 before triton's first import when there is no CUDA)
from pagedlib.core.cache import OutOfBlocksError, PagedKVCache, UnknownSequenceError
from pagedlib.core.prefix_cache import BlockKey
from pagedlib.core.request import Request
from pagedlib.kernels.attention import contiguous_attention, paged_attention
from pagedlib.kv_transfer.store import block_hashes
from pagedlib.testing import block_holders, check_invariants, fill_unused

L, BS, H, D = 2, 4, 2, 8


def make(num_blocks: int = 16, **kw) -> PagedKVCache:
    return PagedKVCache(num_blocks, L, BS, H, D, **kw)


def kv_of(tokens: list[int], start: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """K/V a model would compute for ``tokens`` at positions ``start...``: a function of the whole prefix
    (``[L, n, H, D]`` each, values in [0, 2)), so blocks found by content must hold exactly these values."""
    out, h = [], 0
    for p, t in enumerate(tokens):
        h = (h * 31 + t + 7 * (start + p) + 1) % 1_000_003
        out.append(torch.full((L, H, D), h / 1_000_003) + torch.arange(L * H * D).view(L, H, D) / (L * H * D))
    k = torch.stack(out, dim=1) if out else torch.zeros(L, 0, H, D)
    return k.to(dtype), (-k).to(dtype)


def prefill(c: PagedKVCache, seq, prompt: list[int]) -> int:
    """Add ``seq`` with its prompt, computing K/V only for the tokens the prefix cache did not have (the
    prefix-dependent K/V are computed from the start, then sliced)."""
    hit = c.add_sequence(seq, prompt)
    k, v = kv_of(prompt, dtype=c.dtype)
    c.append_tokens(seq, k[:, hit:], v[:, hit:], token_ids=prompt[hit:])
    return hit


def extend(c: PagedKVCache, seq, before: list[int], new: list[int]) -> None:
    """Append ``new`` tokens to ``seq``, which holds ``before``: their K/V depend on the whole prefix."""
    k, v = kv_of(before + new, dtype=c.dtype)
    c.append_tokens(seq, k[:, len(before):], v[:, len(before):], token_ids=new)


def assert_holds(c: PagedKVCache, seq, tokens: list[int]) -> None:
    k, v = kv_of(tokens)
    gk, gv = c.gather(seq)
    assert torch.equal(gk, k) and torch.equal(gv, v), f"sequence {seq!r} reads back wrong"


# --- reference counts, fork, copy-on-write ---------------------------------------------------------


def test_fork_shares_every_block_and_copies_nothing():
    c = make()
    c.add_sequence("p")
    c.append_tokens("p", *kv_of(list(range(6))))  # blocks [0, 1]: 4 + 2 tokens
    pools = c.k.clone(), c.v.clone()
    c.fork("p", "c")
    assert c.tables["c"] == c.tables["p"] == [0, 1] and c.seq_lens["c"] == 6
    assert [c.ref_count(b) for b in (0, 1, 2)] == [2, 2, 0]
    assert block_holders(c)[:2] == [["p", "c"], ["p", "c"]] and c.num_used_blocks == 2
    assert torch.equal(c.k, pools[0]) and torch.equal(c.v, pools[1]) and c.cow_copies == 0
    check_invariants(c)


def test_append_to_a_shared_partial_block_copies_it_once():
    c = make()
    c.add_sequence("p")
    c.append_tokens("p", *kv_of(list(range(6))))
    c.fork("p", "c")
    parent_k = c.gather("p")[0].clone()
    slot = c.append_token("c", *[t[:, 0] for t in kv_of([99], start=6)])
    assert c.cow_copies == 1 and c.tables["c"] == [0, 2] and c.tables["p"] == [0, 1]
    assert slot == (2, 2) and [c.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert torch.equal(c.gather("p")[0], parent_k)  # the other sequence's K/V never change
    assert torch.equal(c.gather("c")[0][:, :6], parent_k)  # the copy carried the first 6 tokens
    c.append_token("p", *[t[:, 0] for t in kv_of([5], start=6)])  # p now holds block 1 alone: no copy
    assert c.cow_copies == 1 and c.tables["p"] == [0, 1]
    check_invariants(c)


def test_appends_that_start_a_new_block_copy_nothing():
    c = make()
    c.add_sequence("p")
    c.append_tokens("p", *kv_of(list(range(8))))  # two full blocks
    c.fork("p", "c")
    assert c.append_tokens("c", *kv_of([1, 2])) == [2]
    assert c.cow_copies == 0 and c.tables["c"] == [0, 1, 2] and c.ref_count(1) == 2


def test_a_batch_of_four_siblings_makes_three_copies():
    c = make()
    c.add_sequence(0)
    c.append_tokens(0, *kv_of([1, 2, 3]))
    for child in (1, 2, 3):
        c.fork(0, child)
    assert c.ref_count(0) == 4
    k, v = kv_of([10, 11, 12, 13])
    slots = c.append_batch([0, 1, 2, 3], k, v)
    assert c.cow_copies == 3 and c.ref_count(0) == 1  # the last sibling writes in place
    assert [s.offset for s in slots] == [3, 3, 3, 3] and len({s.block for s in slots}) == 4
    for i in range(4):
        gk = c.gather(i)[0]
        assert torch.equal(gk[:, 3], k[:, i]) and torch.equal(gk[:, :3], kv_of([1, 2, 3])[0])
    check_invariants(c)


def test_free_returns_a_block_only_when_its_last_holder_goes():
    c = make(free_order=[5, 6, 7])
    c.add_sequence("p")
    c.append_tokens("p", *kv_of(list(range(6))))  # [5, 6]
    c.fork("p", "c")
    assert c.free_sequence("p") == [] and c.ref_count(5) == 1 and c.num_free_blocks == 14
    assert c.free_sequence("c") == [5, 6] and c.free[-1] == 6 and c.num_free_blocks == 16
    check_invariants(c)


def test_fork_errors_change_nothing():
    c = make()
    c.add_sequence("p")
    c.append_tokens("p", *kv_of([1, 2]))
    c.add_sequence("other")
    snap = snapshot(c)
    for call, exc, text in [(lambda: c.fork("nope", "x"), UnknownSequenceError, "'nope'"),
                            (lambda: c.fork("p", "other"), ValueError, "child_id 'other' already exists"),
                            (lambda: c.fork("p", None), ValueError, "child_id must not be None"),
                            (lambda: c.fork("p", ["x"]), TypeError, "unhashable")]:
        with pytest.raises(exc, match=text):
            call()
        assert_unchanged(c, snap)


def test_out_of_blocks_during_copy_on_write_changes_nothing():
    c = make(3)
    c.add_sequence("p")
    c.append_tokens("p", *kv_of(list(range(6))))  # 2 blocks, 1 free
    c.fork("p", "c")
    c.add_sequence("x")
    c.append_tokens("x", *kv_of([1]))  # the last free block
    snap = snapshot(c)
    with pytest.raises(OutOfBlocksError, match="1 needed, 0 free"):
        c.append_token("c", *[t[:, 0] for t in kv_of([9], start=6)])  # needs a block for the copy
    with pytest.raises(OutOfBlocksError, match="1 needed, 0 free"):
        c.append_batch(["p", "c"], *kv_of([9, 9]))  # p copies; then c holds block 1 alone and writes in place
    assert_unchanged(c, snap)
    assert c.cow_copies == 0


def test_ref_count_and_is_cached_name_a_bad_block_id():
    c = make(4)
    for bad in (4, -1, 1.0, True):
        with pytest.raises(ValueError, match="block_id"):
            c.ref_count(bad)
        with pytest.raises(ValueError, match="block_id"):
            c.is_cached(bad)


# --- prefix caching --------------------------------------------------------------------------------


SYSTEM = list(range(100, 110))  # a 10-token system prompt: 2 full blocks of 4 and 2 tokens


def test_a_repeated_prompt_finds_its_full_blocks():
    c = make(enable_prefix_caching=True)
    assert prefill(c, "a", SYSTEM + [1, 2, 3]) == 0
    assert prefill(c, "b", SYSTEM + [7, 8]) == 8  # the 2 full blocks of the system prompt
    assert c.tables["b"][:2] == c.tables["a"][:2] and c.ref_count(c.tables["a"][0]) == 2
    assert_holds(c, "a", SYSTEM + [1, 2, 3])
    assert_holds(c, "b", SYSTEM + [7, 8])
    stats = c.prefix_cache_stats()
    assert (stats["queried_tokens"], stats["hit_tokens"]) == (25, 8)
    assert stats["hit_rate"] == pytest.approx(8 / 25)
    check_invariants(c)


def test_peek_finds_what_lookup_finds_and_counts_nothing():
    c = make(enable_prefix_caching=True)
    prefill(c, "a", SYSTEM + [1, 2, 3])
    before = c.prefix_cache_stats()
    assert c.prefix_cache.peek(SYSTEM + [7, 8]) == c.tables["a"][:2]
    assert c.prefix_cache_stats() == before
    assert c.prefix_cache.lookup(SYSTEM + [7, 8]) == c.tables["a"][:2]
    assert c.prefix_cache_stats()["hit_tokens"] == before["hit_tokens"] + 8


def test_a_hit_never_covers_the_last_prompt_token():
    c = make(enable_prefix_caching=True)
    prefill(c, "a", list(range(12)))  # 3 full blocks cached
    assert c.add_sequence("b", list(range(12))) == 8  # 12 - 1 tokens at most: 2 whole blocks
    assert c.add_sequence("c", list(range(9))) == 8
    assert c.add_sequence("d", list(range(8))) == 4
    assert c.add_sequence("e", [0]) == 0 and c.tables["e"] == []


def test_blocks_are_found_by_the_whole_prefix_not_one_block():
    c = make(enable_prefix_caching=True)
    prefill(c, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert c.add_sequence("b", [0, 0, 0, 0, 5, 6, 7, 8, 9]) == 0  # same second block, other prefix


def test_a_key_is_its_whole_prefix_digested_once():
    a, b = BlockKey(None, (1, 2)), BlockKey(None, (3, 4))
    child_a, child_b = BlockKey(a, (5, 6)), BlockKey(b, (5, 6))
    assert child_a != child_b and BlockKey(a, (5, 6)) == child_a  # same tokens, other prefix: another key
    assert block_hashes([1, 2, 5, 6, 7], 2) == [a.digest, child_a.digest]  # the store's entry names too
    head = hashlib.sha256(struct.pack("<2q", 1, 2)).digest()
    assert child_a.digest == hashlib.sha256(head + struct.pack("<2q", 5, 6)).hexdigest()
    twin = BlockKey(BlockKey(None, (1, 2)), (5, 6))  # equal content, other objects all the way down
    a.parent = twin.parent.parent = object()  # a walk of the prefixes would now fail: equality never walks
    assert twin == child_a and hash(twin) == hash(child_a)


def test_a_lookup_probes_each_block_once(monkeypatch):
    """Linear in the prompt's blocks: one key comparison per block found (a comparison that walked the
    prefix, or a key rebuilt from the first block at each probe, would make it quadratic)."""
    made, compared = [], []
    real_init, real_eq = BlockKey.__init__, BlockKey.__eq__
    monkeypatch.setattr(BlockKey, "__init__", lambda self, *a: (made.append(1), real_init(self, *a))[1])
    monkeypatch.setattr(BlockKey, "__eq__", lambda self, other: (compared.append(1), real_eq(self, other))[1])
    for blocks in (50, 400):
        c = PagedKVCache(blocks + 2, L, 1, H, D, enable_prefix_caching=True)
        prompt = [t % 7 for t in range(blocks + 1)]
        c.add_sequence("a", prompt)
        c.append_tokens("a", torch.zeros(L, len(prompt), H, D), torch.zeros(L, len(prompt), H, D),
                        token_ids=prompt)
        made.clear(), compared.clear()
        assert c.manager.prefix_cache.peek(prompt) == c.tables["a"][:blocks]
        assert len(made) == blocks and len(compared) == blocks
    request, expected = Request(0, 0, 9, 4, tuple(range(9))), block_hashes(range(9), 2)
    made.clear()
    for _ in range(3):  # a waiting request is looked up at every step: its keys are made once
        assert [k.digest for k in request.block_keys(2, 4)] == expected
    request.output_tokens += [9, 10]
    assert len(request.block_keys(2, 9)) == 5 and len(made) == 5
    assert len(request.block_keys(4, 9)) == 2 and len(made) == 7  # another block size: its own keys


def test_freed_cached_blocks_stay_findable_until_the_pool_needs_them():
    c = make(4, enable_prefix_caching=True)
    prefill(c, "a", list(range(9)))  # blocks 0, 1 full (cached), 2 partial
    assert c.free_sequence("a") == [0, 1, 2]
    assert c.free == [3, 2] and list(c.prefix_cache.free_queue) == [1, 0]  # last block evicted first
    assert c.num_free_blocks == 4 and c.is_cached(0) and not c.is_cached(2)
    assert prefill(c, "b", list(range(9))) == 8 and c.tables["b"][:2] == [0, 1]
    assert c.prefix_cache_stats()["evicted_blocks"] == 0
    check_invariants(c)


def test_eviction_takes_plain_blocks_first_then_the_least_recently_used():
    c = make(6, enable_prefix_caching=True)
    prefill(c, "old", [1] * 8 + [0])   # blocks 0, 1 cached, 2 partial
    prefill(c, "new", [2] * 8 + [0])   # blocks 3, 4 cached, 5 partial
    c.free_sequence("old")             # queue: 1, 0   (block 2 back on the stack)
    c.free_sequence("new")             # queue: 1, 0, 4, 3   (block 5 on the stack)
    assert list(c.prefix_cache.free_queue) == [1, 0, 4, 3] and c.free == [2, 5]
    c.add_sequence("x")
    assert c.append_tokens("x", *kv_of([3] * 12), token_ids=[3] * 12) == [5, 2, 1]  # stack, then LRU
    assert c.prefix_cache_stats()["evicted_blocks"] == 1 and c.prefix_cache.keys[1].tokens == (3, 3, 3, 3)
    assert c.add_sequence("y", [1] * 8 + [0]) == 4  # block 0 is still cached; its successor 1 was evicted
    assert c.add_sequence("z", [2] * 8 + [0]) == 8  # the more recently used prompt survived
    check_invariants(c)


def test_eviction_never_touches_a_block_in_use():
    c = make(3, enable_prefix_caching=True)
    prefill(c, "a", list(range(8)))  # two cached blocks, both held
    c.add_sequence("b")
    with pytest.raises(OutOfBlocksError, match="2 needed, 1 free"):
        c.append_tokens("b", *kv_of([5] * 5), token_ids=[5] * 5)
    assert_holds(c, "a", list(range(8)))


def test_token_ids_are_required_with_caching_and_checked_always():
    c = make(enable_prefix_caching=True)
    c.add_sequence("a")
    snap = snapshot(c)
    k, v = kv_of([1, 2])
    one = k[:, 0], v[:, 0]
    for call, text in [(lambda: c.append_tokens("a", k, v), "token_ids is required"),
                       (lambda: c.append_tokens("a", k, v, token_ids=[1]), "token_ids must hold 2 token ids"),
                       (lambda: c.append_tokens("a", k, v, token_ids="ab"), "token_ids must be a sequence"),
                       (lambda: c.append_tokens("a", k, v, token_ids=[1, -2]), r"token_ids\[1\] must be >="),
                       (lambda: c.append_token("a", *one), "token_id is required"),
                       (lambda: c.append_token("a", *one, token_id=1.5), "token_id must be an int"),
                       (lambda: c.append_batch(["a"], k[:, :1], v[:, :1]), "token_ids is required"),
                       (lambda: c.add_sequence("b", [1, None]), r"prompt_token_ids\[1\]"),
                       (lambda: c.add_sequence("a", [1]), "already exists")]:
        with pytest.raises(ValueError, match=text):
            call()
        assert_unchanged(c, snap)
    off = make()
    off.add_sequence("a")
    with pytest.raises(ValueError, match="token_ids must hold 2"):
        off.append_tokens("a", k, v, token_ids=[1])
    assert off.add_sequence("b", [1, 2, 3, 4, 5]) == 0 and off.prefix_cache_stats()["queried_tokens"] == 0


def test_fill_unused_keeps_cached_free_blocks():
    c = make(4, enable_prefix_caching=True)
    prefill(c, "a", list(range(5)))
    c.free_sequence("a")
    fill_unused(c)
    assert prefill(c, "b", list(range(5))) == 4
    assert_holds(c, "b", list(range(5)))


def test_fork_and_prefix_caching_together():
    c = make(enable_prefix_caching=True)
    prefill(c, "p", SYSTEM)
    c.fork("p", "q")
    extend(c, "p", SYSTEM, [1, 1])
    extend(c, "q", SYSTEM, [2, 2])
    assert c.cow_copies == 1
    assert_holds(c, "p", SYSTEM + [1, 1])
    assert_holds(c, "q", SYSTEM + [2, 2])
    assert prefill(c, "r", SYSTEM + [2, 2, 5]) == 12  # q's third block, filled after the copy, is cached
    check_invariants(c)


# --- attention over shared tables -------------------------------------------------------------------


def shared_cache(dtype: torch.dtype) -> tuple[PagedKVCache, list]:
    """Forks (two siblings diverged after a copy-on-write) and prefix-cache hits, tables scattered."""
    c = PagedKVCache(32, L, BS, H, D, dtype=dtype, enable_prefix_caching=True,
                     free_order=torch.randperm(32, generator=torch.Generator().manual_seed(0)).tolist())
    prefill(c, "root", SYSTEM + [1, 2, 3])
    c.fork("root", "sib")
    extend(c, "sib", SYSTEM + [1, 2, 3], [4, 5, 6])
    extend(c, "root", SYSTEM + [1, 2, 3], [9])
    prefill(c, "hit", SYSTEM + [8] * 7)
    fill_unused(c)
    assert c.cow_copies == 1 and c.prefix_cache_stats()["hit_tokens"] == 8
    ids = ["root", "sib", "hit"]
    return c, ids


def contiguous_reference(c: PagedKVCache, ids: list, layer: int, q: torch.Tensor) -> torch.Tensor:
    """SDPA over each sequence's own contiguous K/V (``gather``), one sequence at a time."""
    out = []
    for i, s in enumerate(ids):
        k, v = c.gather(s)                                                  # [L, n, H, D]
        k, v = k[layer].transpose(0, 1)[None], v[layer].transpose(0, 1)[None]  # [1, H, n, D]
        out.append(contiguous_attention(q[i : i + 1, :, None], k, v)[:, :, 0])  # [1, q_heads, D]
    return torch.cat(out)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
def test_paged_attention_over_shared_tables_equals_contiguous(dtype, atol):
    c, ids = shared_cache(dtype)
    q = torch.randn(len(ids), 2 * H, D, generator=torch.Generator().manual_seed(1)).to(dtype) / 8
    for layer in range(L):
        out = paged_attention(q, *c.layer(layer), c.block_table(ids), c.seq_lens_tensor(ids))
        torch.testing.assert_close(out, contiguous_reference(c, ids, layer, q), atol=atol, rtol=atol)


def test_triton_kernel_over_shared_tables_equals_contiguous():
    triton_decode = pytest.importorskip("pagedlib.kernels.triton_decode", reason="triton: Linux wheels only")
    c, ids = shared_cache(torch.float32)
    q = torch.randn(len(ids), 2 * H, D, generator=torch.Generator().manual_seed(1)) / 8
    for layer in range(L):
        out = triton_decode.paged_attention_triton(q, *c.layer(layer), c.block_table(ids),
                                                      c.seq_lens_tensor(ids))
        torch.testing.assert_close(out, contiguous_reference(c, ids, layer, q), atol=1e-5, rtol=1e-5)


def test_a_waiting_request_is_hashed_once_however_long_it_waits(monkeypatch):
    """The scheduler looks a waiting request up at every step; its keys are made once (Request.block_keys):
    the keys made in a whole run are at most those of each request's blocks, once for its lookups and
    once when the blocks it fills are registered (making them at every lookup would be many times more)."""
    from pagedlib.sim import workloads
    from pagedlib.sim.simulate import new_scheduler, serve

    made = []
    real_init = BlockKey.__init__
    monkeypatch.setattr(BlockKey, "__init__", lambda self, *a: (made.append(1), real_init(self, *a))[1])
    requests = workloads.shared_prompt_like(24, 0, system_len=64, num_system_prompts=2)
    scheduler = new_scheduler(requests, "paged", 40, 16, enable_prefix_caching=True)
    result = serve(scheduler, list(requests))
    assert result.mean_running < len(requests)  # the pool is tight: requests waited for steps
    bound = sum(2 * (r.prompt_len + r.output_len) // 16 for r in requests)
    assert 0 < len(made) <= bound
