"""The cache under a hostile caller (issue 19): an exception (an interrupt, say) in the middle of an append,
sizes whose Python bookkeeping alone would not fit, and ids or token ids of the wrong kind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import assert_unchanged, random_kv, snapshot

from pagedlib import testing
from pagedlib.core.blocks import BlockManager
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.kv_pool import KVPool
from pagedlib.core.prefix_cache import PrefixCache
from pagedlib.testing import check_invariants, state_diff

L, BS, H, D = 2, 4, 1, 2


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return random_kv(n, L, H, D, seed=seed)


def busy(caching: bool) -> PagedKVCache:
    """"p" holds 6 tokens (a full block and a partial one) that "c" shares (fork); "q" is another sequence."""
    c = PagedKVCache(12, L, BS, H, D, fill=float("nan"), enable_prefix_caching=caching)
    ids = list(range(6)) if caching else None
    c.add_sequence("p")
    c.append_tokens("p", *kv(6), token_ids=ids)
    c.fork("p", "c")
    c.add_sequence("q")
    c.append_tokens("q", *kv(3, seed=1), token_ids=ids[:3] if ids else None)
    return c


def raise_on_call(original, n: int, exc: type[BaseException]):
    """A stand-in for method ``original`` that raises ``exc`` on its ``n``-th call (earlier calls did their
    part, so the failure lands halfway)."""
    calls = []

    def step(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise exc("injected")
        return original(self, *args, **kwargs)
    return step


def batch(c: PagedKVCache, on: bool) -> None:  # "c" copies the partly filled block it shares with "p"
    c.append_batch(["c", "q", "p"], *kv(3, seed=2), token_ids=[7, 8, 9] if on else None)


def prompt(c: PagedKVCache, on: bool) -> None:  # fills 3 blocks of "q"
    c.append_tokens("q", *kv(9, seed=3), token_ids=list(range(3, 12)) if on else None)


def reserve(c: PagedKVCache, on: bool) -> None:  # "c" copies; "q" fills 2 blocks (a model step's path)
    with c.reserving(["c", "q"], [[0], list(range(1, 7))]) as step:
        c.pool.copy_blocks(step.copies)


# name: (call, registrations it makes with prefix caching)
APPENDS = {"batch": (batch, 1), "prompt": (prompt, 3), "reserve": (reserve, 2)}
STEPS = {"PrefixCache.register": PrefixCache, "KVPool.write": KVPool, "KVPool.copy_blocks": KVPool}
CASES = [(step, append) for step in STEPS for append in APPENDS
         if (step, append) != ("KVPool.write", "reserve")]  # reserving writes no K/V


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
@pytest.mark.parametrize("step, append", CASES)
def test_an_exception_inside_an_append_changes_nothing(monkeypatch, step, append, exc):
    """The step fails halfway (the second of three registrations, say): everything is as it was."""
    caching, (call, registrations) = step.startswith("PrefixCache"), APPENDS[append]
    c = busy(caching)
    snap, free = snapshot(c), c.num_free_blocks
    owner, name = STEPS[step], step.split(".")[1]
    n = min(2, registrations) if caching else 1
    monkeypatch.setattr(owner, name, raise_on_call(getattr(owner, name), n, exc))
    with pytest.raises(exc, match="injected"):
        call(c, caching)
    changed = set(state_diff(c, snap))
    # K/V written before the step that failed went into slots that hold no token again (a block free again,
    # the tail of a last block): such slots may hold anything; the prefix cache registers after the write
    assert changed <= ({"k", "v"} if step != "KVPool.copy_blocks" else set()), changed
    check_invariants(c)
    assert c.num_free_blocks == free
    for s in c.tables:
        assert all(torch.equal(a, b) for a, b in zip(c.gather(s), snap.gather(s)))
    monkeypatch.undo()
    call(c, caching)  # the same call then works
    check_invariants(c)


def test_an_interrupt_after_an_eviction_leaves_a_consistent_cache(monkeypatch):
    """Cached blocks evicted for a write that is then undone are plain free blocks: their content may
    have been overwritten, so they must not be found again."""
    c = PagedKVCache(3, L, BS, H, D, enable_prefix_caching=True)
    c.add_sequence("a")
    c.append_tokens("a", *kv(8), token_ids=list(range(8)))
    c.free_sequence("a")  # blocks 0 and 1 wait, cached
    c.add_sequence("b")
    monkeypatch.setattr(KVPool, "write", raise_on_call(KVPool.write, 1, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        c.append_tokens("b", *kv(9, seed=1), token_ids=[5] * 9)  # all 3 blocks: 1 plain, 2 evicted
    check_invariants(c)
    assert c.num_free_blocks == 3 and c.tables["b"] == [] and c.prefix_cache_stats()["cached_blocks"] == 0
    assert c.add_sequence("c", list(range(8))) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="resource.RLIMIT_AS and /proc are Linux's")
def test_a_pool_whose_bookkeeping_cannot_fit_is_refused_before_anything_is_allocated():
    """2**31 - 1 one-token blocks: 16 GiB of pools, but ~200 GB of Python lists. Refused by the size check,
    in a subprocess whose address space is capped 2 GiB above what it already uses."""
    code = textwrap.dedent("""
        import resource, torch
        from pagedlib.core.cache import PagedKVCache
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + 2**31, used + 2**31))
        try:
            PagedKVCache(2**31 - 1, 1, 1, 1, 1)
        except ValueError as e:
            print("refused:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("refused: num_blocks=2147483647"), out.stderr[-2000:]
    assert "bytes of bookkeeping" in out.stdout


def test_a_dict_of_prompt_tokens_is_refused_like_a_set():
    c = busy(caching=True)
    snap = snapshot(c)
    for prompt in ({1: 0, 2: 0}, {1, 2}):
        with pytest.raises(ValueError, match=f"prompt_token_ids must be a sequence of token ids, got "
                                             f"{type(prompt).__name__}"):
            c.add_sequence("new", prompt)
        assert_unchanged(c, snap)


def test_a_prefix_cache_needs_a_positive_block_size():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="block_size"):
            PrefixCache(bad).peek([1, 2, 3])
    assert PrefixCache(2).peek([1, 2, 3]) == []


def test_tensor_sequence_ids_are_refused():
    """A tensor hashes by identity: ``torch.tensor(3)`` could never be found again by an equal tensor."""
    c = busy(caching=False)
    c.add_sequence(3)
    snap = snapshot(c)
    one = [t[:, 0] for t in kv(1)]
    for call in (lambda: c.add_sequence(torch.tensor(4)), lambda: c.fork("p", torch.tensor(5)),
                 lambda: c.append_token(torch.tensor(3), *one), lambda: c.gather(torch.tensor(3)),
                 lambda: c.append_batch([torch.tensor(3)], *kv(1))):
        with pytest.raises(ValueError, match="must not be a torch.Tensor"):
            call()
        assert_unchanged(c, snap)
    c.append_batch(torch.tensor([3]), *kv(1))  # a 1-d tensor of ids gives its values
    assert c.seq_lens[3] == 1


# ------------------------------------------------------------------------------------------------------
# issue 30, hardening round 3: the defects of the block manager and the radix tree, each tested


def cached_then_freed(design: str, num_blocks: int, tokens: int) -> PagedKVCache:
    """A cache whose sequence "a" wrote ``tokens`` tokens and was freed: its full blocks wait, cached."""
    c = PagedKVCache(num_blocks, L, BS, H, D, enable_prefix_caching=True, prefix_cache=design)
    c.add_sequence("a")
    c.append_tokens("a", *kv(tokens), token_ids=list(range(tokens)))
    c.free_sequence("a")
    return c


@pytest.mark.parametrize("design", ["hash", "radix"])
def test_an_interrupt_inside_evict_during_an_append_leaks_nothing(monkeypatch, design):
    """Defect 7: the blocks were taken before the undo scope began, so an interrupt in the second eviction
    lost the plain free block and the first evicted one."""
    c = cached_then_freed(design, 4, 12)                       # 1 plain free block, 3 cached
    c.add_sequence("b")
    snap, free = snapshot(c), c.num_free_blocks
    owner = type(c.prefix_cache)
    monkeypatch.setattr(owner, "evict", raise_on_call(owner.evict, 2, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt, match="injected"):
        c.append_tokens("b", *kv(16, seed=1), token_ids=[50] * 16)  # 4 blocks: 1 plain, 3 evicted
    monkeypatch.undo()
    check_invariants(c)
    assert c.num_free_blocks == free and c.tables["b"] == [] and c.seq_lens["b"] == 0
    assert set(state_diff(c, snap)) <= {"free", "prefix_cache"}   # the evicted block is plain free now
    c.append_tokens("b", *kv(16, seed=1), token_ids=[50] * 16)
    check_invariants(c)


def test_an_interrupt_inside_the_radix_partial_block_copy_adds_nothing(monkeypatch):
    """Defect 8: the copy raised after the source block was shared and the copy's block taken: the sequence
    stayed half added, the source held twice by one table, the copy's block leaked."""
    c = PagedKVCache(6, L, BS, H, D, enable_prefix_caching=True, prefix_cache="radix")
    c.add_sequence("a")
    c.append_tokens("a", *kv(8), token_ids=list(range(8)))
    free, counts = c.num_free_blocks, list(c.ref_counts)
    prompt = [0, 1, 2, 3, 4, 5, 9, 9]                          # block 0 found, then 2 tokens of block 1
    monkeypatch.setattr(KVPool, "copy_blocks", raise_on_call(KVPool.copy_blocks, 1, KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt, match="injected"):
        c.add_sequence("b", prompt)
    monkeypatch.undo()
    check_invariants(c)
    assert "b" not in c.tables and c.num_free_blocks == free and c.ref_counts == counts
    assert c.add_sequence("b", prompt) == 6
    assert torch.equal(c.gather("b")[0], c.gather("a")[0][:, :6])
    check_invariants(c)


def test_gather_on_an_fp8_cache_gives_the_values_the_bytes_stand_for():
    """Defect 11: ``gather`` returned the stored ``k / k_scale`` of an fp8 cache without saying so."""
    from pagedlib.core.fp8 import dequantize, quantize

    fp8 = torch.float8_e4m3fn
    c = PagedKVCache(4, L, BS, H, D, dtype=fp8, k_scale=0.5, v_scale=4.0)
    k, v = kv(5)
    c.add_sequence(0)
    c.append_tokens(0, k, v)
    got_k, got_v = c.gather(0)
    assert got_k.dtype == torch.float32 and got_k.shape == (L, 5, H, D)
    assert torch.equal(got_k, dequantize(quantize(k, 0.5, fp8), 0.5))
    assert torch.equal(got_v, dequantize(quantize(v, 4.0, fp8), 4.0))
    torch.testing.assert_close(got_k, k, rtol=0.07, atol=0.01)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("tokens", [[1, 2, 3], [1, 2, 3, 4, 5], []])
def test_a_block_registered_with_the_wrong_number_of_tokens_is_refused(tokens):
    """Defect 12: ``RadixCache(4).insert(0, None, [1, 2, 3])`` was accepted and broke ``check()``."""
    from pagedlib.core.radix_cache import RadixCache

    for cache in (RadixCache(4), PrefixCache(4)):
        with pytest.raises(ValueError, match=f"tokens must hold block_size=4 token ids, got {len(tokens)}"):
            cache.register(0, None, tokens)
        assert cache.stats()["cached_blocks"] == 0
    tree = RadixCache(4)
    with pytest.raises(ValueError, match="block_size=4"):
        tree.insert(0, None, tokens)
    assert testing.check_radix_cache(tree, BlockManager(4, 4)) is None and tree.node_of == {}


@pytest.mark.parametrize("together", [True, False])
def test_the_tree_finds_the_blocks_after_a_duplicate_computed_at_the_same_time(together):
    """Defect 6: two prompts sharing their first block are prefilled at the same time; the second's copy
    of that block stayed out of the tree, and so did every block after it. A third prompt equal to the
    second found 4 tokens where the hash cache finds 8. The tree now gives the second sequence its own
    block and frees the duplicate, as SGLang's insert does."""
    first = [1, 2, 3, 4, 10, 11, 12, 13, 20]
    second = [1, 2, 3, 4, 30, 31, 32, 33, 40]
    found = {}
    for design in ("hash", "radix"):
        c = PagedKVCache(8, L, BS, H, D, enable_prefix_caching=True, prefix_cache=design)
        c.add_sequence(0, first)
        c.add_sequence(1, second)
        if together:
            with c.reserving([0, 1], [first, second]):
                pass  # both prefilled in one step
        else:
            c.append_tokens(0, *kv(9), token_ids=first)
            c.append_tokens(1, *kv(9, seed=1), token_ids=second)
        check_invariants(c)
        running = c.add_sequence(2, second)
        c.free_sequence(2)
        c.free_sequence(0)
        c.free_sequence(1)
        found[design] = (running, c.add_sequence(3, second))
        check_invariants(c)
    assert found == {"hash": (8, 8), "radix": (8, 8)}
