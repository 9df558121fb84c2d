"""Sliding windows on the paged cache (notebook 07): releasing the blocks a window has left behind keeps
the cache consistent, and attention over the blocks that remain equals SDPA with a sliding-window mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_unchanged, snapshot

from pagedlib.core.cache import PagedKVCache
from pagedlib.kernels.attention import paged_attention, sliding_window_attention, sliding_window_mask
from pagedlib.sim.window import (
    release_leading_blocks,
    release_outside_window,
    window_held_blocks,
    window_span_blocks,
)
from pagedlib.testing import check_invariants, fill_unused

TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}


def test_mask_matches_its_definition():
    m = sliding_window_mask(2, 6, 3)
    # queries at positions 4 and 5 see (4-3, 4] and (5-3, 5]
    assert m.tolist() == [[False, False, True, True, True, False], [False, False, False, True, True, True]]
    assert sliding_window_mask(4, 4, 100).equal(torch.ones(4, 4, dtype=torch.bool).tril())



@pytest.mark.parametrize("args,name", [((5, 3, 2), "q_len"), ((2, 6, 0), "window"), ((2, 6, -1), "window"),
                                       ((2.5, 6, 3), "q_len"), ((1, 0, 3), "kv_len")])
def test_mask_refuses_arguments_that_leave_a_query_nothing_to_see(args, name):
    # each of these once returned a mask with rows of no True (or float positions): SDPA gives NaN there
    with pytest.raises(ValueError, match=f"^{name} must be"):
        sliding_window_mask(*args)


def test_release_leading_blocks():
    cache = PagedKVCache(8, 1, 4, 1, 2, free_order=[3, 6, 1, 0])
    cache.add_sequence("s")
    cache.append_tokens("s", torch.arange(13.0).view(1, 13, 1, 1).expand(1, 13, 1, 2).contiguous(),
                        torch.zeros(1, 13, 1, 2))
    assert cache.tables["s"] == [3, 6, 1, 0]
    assert release_leading_blocks(cache, "s", 2) == [3, 6]
    assert cache.tables["s"] == [1, 0] and cache.seq_lens["s"] == 5 and cache.free[-1] == 6
    check_invariants(cache)
    k, _ = cache.gather("s")
    assert k[0, :, 0, 0].tolist() == [8, 9, 10, 11, 12]          # the tokens kept, in order
    snap = snapshot(cache)
    for bad in (2, -1, 1.0, True):                                # only 1 full block is left
        with pytest.raises(ValueError, match="n must be"):
            release_leading_blocks(cache, "s", bad)
        assert_unchanged(cache, snap)
    with pytest.raises(KeyError):
        release_leading_blocks(cache, "t", 0)
    assert_unchanged(cache, snap)
    assert release_leading_blocks(cache, "s", 0) == []
    assert_unchanged(cache, snap)


def test_release_outside_window_keeps_what_the_newest_token_sees():
    cache = PagedKVCache(16, 1, 4, 1, 1)
    cache.add_sequence(0)
    held_total = 0
    for n in range(1, 40):
        cache.append_token(0, torch.full((1, 1, 1), float(n - 1)), torch.zeros(1, 1, 1))
        held_total += release_outside_window(cache, 0, 6)
        held = cache.seq_lens[0]
        assert held_total + held == n                             # positions released + held
        assert held_total % 4 == 0 and min(n, 6) <= held < 6 + 4   # the window, plus less than a block
        assert len(cache.tables[0]) <= math.ceil(6 / 4) + 1
        check_invariants(cache)
    with pytest.raises(ValueError, match="window"):
        release_outside_window(cache, 0, 0)
    with pytest.raises(KeyError):
        release_outside_window(cache, 1, 4)


@pytest.mark.parametrize("window,block_size", [(1, 1), (1, 4), (5, 4), (6, 4), (8, 4), (9, 4), (16, 16),
                                               (17, 16), (4096, 16)])
def test_window_bounds_are_the_most_blocks_a_window_touches_and_a_request_holds(window, block_size):
    # the blocks that positions start .. start + window - 1 touch, over every offset in a block
    touched = [(start + window - 1) // block_size - start // block_size + 1 for start in range(block_size)]
    assert window_span_blocks(window, block_size) == max(touched)
    # grow one sequence token by token, releasing before each write as WindowScheduler.schedule does
    cache = PagedKVCache(window // block_size + 4, 1, block_size, 1, 1)
    cache.add_sequence(0)
    most = 0
    for _ in range(window + 3 * block_size):
        release_outside_window(cache, 0, window)
        cache.append_token(0, torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
        most = max(most, len(cache.tables[0]))
    assert window_held_blocks(window, block_size) == most == math.ceil(window / block_size) + 1


def sdpa_window(q, k, v, window):
    """SDPA of one query (the newest position) over contiguous K/V ``[kv_heads, n, D]`` with the mask."""
    n = k.shape[1]
    mask = sliding_window_mask(1, n, window)
    out = F.scaled_dot_product_attention(q[None, :, None].float(), k[None].float(), v[None].float(),
                                         attn_mask=mask, enable_gqa=True)
    return out[0, :, 0]                                           # [q_heads, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,window", [(1, 1), (4, 3), (4, 4), (4, 9), (8, 5), (16, 40)])
def test_sliding_window_attention_equals_sdpa(dtype, block_size, window):
    gen = torch.Generator().manual_seed(block_size * 100 + window)
    batch, kv_heads, q_heads, dim, steps = 3, 2, 4, 16, 20
    cache = PagedKVCache(64, 1, block_size, kv_heads, dim, dtype=dtype,
                         free_order=torch.randperm(64, generator=gen).tolist())
    history = {s: ([], []) for s in range(batch)}                 # every K/V ever written
    for s in range(batch):
        cache.add_sequence(s)
    for step in range(steps):
        live = [s for s in range(batch) if step >= 4 * s]         # sequences start at different steps
        k = torch.randn(1, len(live), kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(1, len(live), kv_heads, dim, generator=gen).to(dtype)
        cache.append_batch(live, k, v)
        for i, s in enumerate(live):
            history[s][0].append(k[0, i])
            history[s][1].append(v[0, i])
            release_outside_window(cache, s, window)
        fill_unused(cache, float("nan"))                           # freed and unwritten slots hold NaN
        q = torch.randn(len(live), q_heads, dim, generator=gen).to(dtype)
        tables, lens = cache.block_table(live), cache.seq_lens_tensor(live)
        out = sliding_window_attention(q, *cache.layer(0), tables, lens, window)
        assert out.dtype == dtype and not out.isnan().any()
        for i, s in enumerate(live):
            keys = torch.stack(history[s][0], 1)                  # [kv_heads, n, D]
            vals = torch.stack(history[s][1], 1)
            want = sdpa_window(q[i], keys, vals, window)
            torch.testing.assert_close(out[i].float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    check_invariants(cache)


def test_a_window_wider_than_the_sequence_is_plain_paged_attention():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(20, 1, 4, 2, 8)
    for s, n in enumerate([5, 11, 16]):
        cache.add_sequence(s)
        cache.append_tokens(s, torch.randn(1, n, 2, 8, generator=gen), torch.randn(1, n, 2, 8, generator=gen))
    q = torch.randn(3, 4, 8, generator=gen)
    args = (q, *cache.layer(0), cache.block_table([0, 1, 2]), cache.seq_lens_tensor([0, 1, 2]))
    torch.testing.assert_close(sliding_window_attention(*args, window=16), paged_attention(*args))
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(*args, window=0)
    with pytest.raises(ValueError, match="seq_lens"):
        sliding_window_attention(q, *cache.layer(0), cache.block_table([0, 1, 2]),
                                 torch.tensor([5, 11, 16]), window=4)


def test_release_leading_blocks_refuses_shared_blocks():
    cache = PagedKVCache(8, 1, 4, 1, 2)
    cache.add_sequence("p")
    cache.append_tokens("p", torch.ones(1, 9, 1, 2), torch.ones(1, 9, 1, 2))
    cache.fork("p", "c")
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="shared"):
        release_leading_blocks(cache, "c", 2)
    assert_unchanged(cache, snap)


def test_release_leading_blocks_refuses_a_prefix_cache():
    cache = PagedKVCache(8, 1, 4, 1, 2, enable_prefix_caching=True)
    cache.add_sequence("s")
    cache.append_tokens("s", torch.ones(1, 9, 1, 2), torch.ones(1, 9, 1, 2), token_ids=list(range(9)))
    snap = snapshot(cache)
    with pytest.raises(ValueError, match="prefix caching"):
        release_leading_blocks(cache, "s", 1)
    assert_unchanged(cache, snap)
