"""``pagedlib.testing``: the invariant checks find what notebook 06's invariants 5 and 6 forbid, each prefix
cache's own way, including the corruptions that would make a lookup return wrong K/V (issue 37, defects 11
and 12)."""

from __future__ import annotations

import pytest
import torch

from pagedlib import testing
from pagedlib.core.blocks import InvariantError as BlocksInvariantError
from pagedlib.core.cache import InvariantError, PagedKVCache
from pagedlib.testing import block_holders, block_owners, check_invariants


def cache_with(prefix_cache: str | None, tokens: int = 9) -> PagedKVCache:
    """A cache of block size 4 holding sequence "a" of ``tokens`` tokens (token ids 0, 1, ...)."""
    cache = PagedKVCache(8, 1, 4, 1, 2, enable_prefix_caching=prefix_cache is not None,
                         prefix_cache=prefix_cache or "hash")
    token_ids = list(range(tokens))
    cache.add_sequence("a", token_ids)
    k = torch.zeros(1, tokens, 1, 2)  # [num_layers, n, kv_heads, head_dim]
    cache.append_tokens("a", k, k, token_ids=token_ids)
    check_invariants(cache)
    return cache


def test_the_error_is_one_class_wherever_it_is_imported_from():
    assert InvariantError is BlocksInvariantError is testing.InvariantError
    assert issubclass(InvariantError, AssertionError)


def test_a_shared_block_filled_differently_breaks_invariant_5():
    cache = cache_with(None, tokens=6)
    cache.fork("a", "b")
    cache.seq_lens["b"] = 5  # still 2 blocks (invariant 4 holds), but block 2 holds 2 tokens for a, 1 for b
    with pytest.raises(InvariantError, match="^5: shared block"):
        check_invariants(cache)


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_token_ids_that_do_not_match_the_length_break_invariant_6(prefix_cache):
    cache = cache_with(prefix_cache)
    cache.token_ids["a"].pop()
    with pytest.raises(InvariantError, match="^6: sequence 'a' has 8 token ids for 9 tokens"):
        check_invariants(cache)


@pytest.mark.parametrize("prefix_cache, forget, message", [
    ("hash", lambda tree: tree.keys.clear(), r"names blocks \[0\], whose own keys differ"),
    ("radix", lambda tree: tree.node_of.clear(), "0 blocks are registered, 2 reachable from the root"),
])
def test_each_prefix_cache_is_checked_by_its_own_check(prefix_cache, forget, message):
    cache = cache_with(prefix_cache)
    forget(cache.prefix_cache)
    with pytest.raises(InvariantError, match=f"^6: .*{message}"):
        check_invariants(cache)


def test_the_looks_inside_read_the_cache_they_are_given():
    cache = cache_with("radix")
    assert block_owners(cache) == ["a", "a", "a"] + [None] * 5
    assert block_holders(cache)[:3] == [["a"]] * 3
    assert testing.holders(cache.manager)[:3] == [[("a", 0)], [("a", 1)], [("a", 2)]]
    assert testing.check_radix_cache(cache.prefix_cache, cache.manager) is None
    assert "3 used, 5 free" in repr(cache)


def _free_cached_block_onto_the_stack(cache):
    """Free "a" (its 2 full blocks wait, findable, in the queue), then move one onto the plain free stack."""
    cache.free_sequence("a")
    block = next(iter(cache.prefix_cache.free_queue))
    del cache.prefix_cache.free_queue[block]
    cache.free.append(block)
    return block


@pytest.mark.parametrize("prefix_cache", ["hash", "radix"])
def test_a_findable_block_on_the_plain_free_stack_is_caught(prefix_cache):
    """Defects 11, 12: the next allocation would overwrite a block a lookup still finds."""
    cache = cache_with(prefix_cache)
    block = _free_cached_block_onto_the_stack(cache)
    with pytest.raises(InvariantError, match=rf"^6: cached blocks \[{block}\] are on the plain free stack"):
        check_invariants(cache)


def test_a_registered_partly_filled_block_is_caught():
    """Defect 11: a key on the partly filled third block of "a" (tokens 8 only) would be found by a prompt
    that shares just that token."""
    cache = cache_with("hash")
    third = cache.tables["a"][2]
    cache.prefix_cache.register(third, cache.tables["a"][1], [8, 9, 10, 11])
    with pytest.raises(InvariantError, match=f"^6: block {third}, partly filled in sequence 'a', has a key"):
        check_invariants(cache)


def test_block_and_key_maps_that_disagree_are_caught():
    """Defect 11: a block whose key names another block."""
    cache = cache_with("hash")
    first, second = cache.tables["a"][:2]
    cache.prefix_cache.keys[second] = cache.prefix_cache.keys[first]
    with pytest.raises(InvariantError, match="^6: key .* whose own keys differ"):
        check_invariants(cache)
