"""Unit tests of ``PagedKVCache``: write/read roundtrips, lifecycle, and every error path leaving the whole
state (tables, lengths, free stack, both pools) exactly as it was."""

from __future__ import annotations

import pickle
import weakref

import numpy as np
import pytest
import torch
from helpers import assert_unchanged, random_kv, snapshot

from pagedlib.core.cache import InvariantError, OutOfBlocksError, PagedKVCache, Slot, UnknownSequenceError
from pagedlib.testing import block_owners, check_invariants, fill_unused, state_diff
from pagedlib.util import ceil_div

L, BS, H, D = 2, 4, 2, 3


def make(num_blocks: int = 12, **kw) -> PagedKVCache:
    return PagedKVCache(num_blocks, L, BS, H, D, **kw)


def kv(n: int | None = None, seed: int = 0, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K, V: ``[L, H, D]`` (one token) or ``[L, n, H, D]``."""
    return random_kv(n, L, H, D, seed=seed, dtype=dtype)


# --- construction ---------------------------------------------------------------------------------


def test_new_cache_shapes_and_stack():
    c = make(6)
    assert c.k.shape == c.v.shape == (6, L, BS, H, D)
    assert c.free == [5, 4, 3, 2, 1, 0]  # block 0 on top: handed out first
    assert c.tables == {} and c.seq_lens == {}
    assert c.num_free_blocks == 6 and c.num_used_blocks == 0
    assert c.utilization == 1.0
    check_invariants(c)


def test_free_order_prefix_then_ascending():
    c = make(12, free_order=[5, 2, 9])
    assert c.free[-3:] == [9, 2, 5]
    assert c.free[:-3] == [11, 10, 8, 7, 6, 4, 3, 1, 0]
    assert make(4, free_order=[3, 1, 0, 2]).free == [2, 0, 1, 3]


@pytest.mark.parametrize("order", [[12], [-1], [1, 1], [True], ["3"]])
def test_free_order_rejected(order):
    with pytest.raises(ValueError, match="free_order"):
        make(12, free_order=order)


@pytest.mark.parametrize("name", ["num_blocks", "num_layers", "block_size", "kv_heads", "head_dim"])
@pytest.mark.parametrize("bad", [0, -1, 2.0])
def test_geometry_rejected(name, bad):
    args = dict(num_blocks=4, num_layers=L, block_size=BS, kv_heads=H, head_dim=D)
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        PagedKVCache(**args)


# --- write/read roundtrips (the article's first test category) ------------------------------------


def test_roundtrip_inside_one_block():
    c = make()
    c.add_sequence(0)
    k, v = kv(3)
    for i in range(3):
        assert c.append_token(0, k[:, i], v[:, i]) == Slot(0, i)
    assert c.tables[0] == [0]
    gk, gv = c.gather(0)
    assert gk.shape == (L, 3, H, D) and gk.is_contiguous()
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_roundtrip_across_a_block_boundary():
    c = make()
    c.add_sequence(0)
    k, v = kv(BS + 2)
    slots = [c.append_token(0, k[:, i], v[:, i]) for i in range(BS + 2)]
    assert [s.offset for s in slots] == [0, 1, 2, 3, 0, 1]
    assert c.tables[0] == [0, 1] and c.seq_lens[0] == BS + 2
    assert c.slot(0, BS - 1) == Slot(0, BS - 1) and c.slot(0, BS) == Slot(1, 0)
    gk, gv = c.gather(0)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_roundtrip_across_noncontiguous_blocks():
    c = make(12, free_order=[7, 3, 10, 0])
    c.add_sequence("a")
    k, v = kv(3 * BS + 1)
    assert c.append_tokens("a", k, v) == [7, 3, 10, 0]
    assert c.tables["a"] == [7, 3, 10, 0]
    gk, gv = c.gather("a")
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # each token sits exactly where the table says, in every layer
    for p in range(3 * BS + 1):
        b, off = c.slot("a", p)
        assert torch.equal(c.k[b, :, off], k[:, p]) and torch.equal(c.v[b, :, off], v[:, p])
        for layer in range(L):
            lk, lv = c.layer(layer)
            assert torch.equal(lk[b, off], k[layer, p]) and torch.equal(lv[b, off], v[layer, p])


def test_article_decode_trace():
    """block_size 4, table [5, 2]; token 6 -> (block 2, offset 2); token 7 fills it; token 8 takes 9."""
    c = make(12, free_order=[5, 2, 9])
    c.add_sequence(0)
    k, v = kv(9)
    assert c.append_tokens(0, k[:, :6], v[:, :6]) == [5, 2]
    assert c.append_token(0, k[:, 6], v[:, 6]) == Slot(2, 2)
    assert c.tables[0] == [5, 2] and c.seq_lens[0] == 7
    assert c.append_token(0, k[:, 7], v[:, 7]) == Slot(2, 3)
    assert c.tables[0] == [5, 2]
    assert c.append_token(0, k[:, 8], v[:, 8]) == Slot(9, 0)
    assert c.tables[0] == [5, 2, 9] and c.seq_lens[0] == 9
    check_invariants(c)
    assert torch.equal(c.gather(0)[0], k)


def test_append_tokens_continues_a_partial_block():
    c = make()
    c.add_sequence(0)
    k, v = kv(11)
    assert c.append_tokens(0, k[:, :3], v[:, :3]) == [0]
    assert c.append_tokens(0, k[:, 3:4], v[:, 3:4]) == []  # fills block 0 exactly
    assert c.append_tokens(0, k[:, 4:4], v[:, 4:4]) == []  # n = 0 is a no-op
    assert c.append_tokens(0, k[:, 4:11], v[:, 4:11]) == [1, 2]
    assert torch.equal(c.gather(0)[1], v)
    check_invariants(c)


def test_append_batch_matches_per_token_appends():
    ref, c = make(), make()
    lens = {"a": 3, "b": 4, "c": 0, "d": 5}
    for i, (s, n) in enumerate(lens.items()):
        for cache in (ref, c):
            cache.add_sequence(s)
            cache.append_tokens(s, *kv(n, seed=i))
    order = ["d", "a", "c", "b"]
    for step in range(6):
        k, v = kv(len(order), seed=100 + step)
        slots = c.append_batch(order, k, v)
        want = [ref.append_token(s, k[:, i], v[:, i]) for i, s in enumerate(order)]
        assert slots == want
        assert c.tables == ref.tables and c.seq_lens == ref.seq_lens and c.free == ref.free
        assert torch.equal(c.k, ref.k) and torch.equal(c.v, ref.v)
        check_invariants(c)


def test_append_batch_accepts_tensor_ids_and_empty_batch():
    c = make()
    for s in range(3):
        c.add_sequence(s)
    k, v = kv(3)
    c.append_batch(torch.tensor([2, 0, 1]), k, v)
    assert torch.equal(c.gather(2)[0][:, 0], k[:, 0])
    assert c.append_batch([], torch.zeros(L, 0, H, D), torch.zeros(L, 0, H, D)) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_roundtrip_other_dtypes(dtype):
    c = make(dtype=dtype)
    c.add_sequence(0)
    c.add_sequence(1)
    k, v = kv(6, dtype=dtype)
    c.append_tokens(0, k, v)
    k1, v1 = kv(2, seed=1, dtype=dtype)
    c.append_batch([1, 0], k1, v1)
    gk, gv = c.gather(0)
    assert gk.dtype == dtype
    assert torch.equal(gk[:, :6], k) and torch.equal(gv[:, 6], v1[:, 1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_roundtrip_cuda():
    c = make(device="cuda")
    assert c.device.type == "cuda" and c.device.index is not None
    c.add_sequence(0)
    c.add_sequence(1)
    k, v = (t.cuda() for t in kv(7))
    c.append_tokens(0, k, v)
    k1, v1 = (t.cuda() for t in kv(2, seed=1))
    c.append_batch([1, 0], k1, v1)
    c.append_token(1, k[:, 0], v[:, 0])
    gk, gv = c.gather(0)
    assert torch.equal(gk[:, :7], k) and torch.equal(gv[:, 7], v1[:, 1])
    assert c.block_table([0, 1]).device == c.device
    with pytest.raises(ValueError, match="device"):
        c.append_token(0, k[:, 0].cpu(), v[:, 0].cpu())


# --- read side ------------------------------------------------------------------------------------


def test_block_table_and_seq_lens_tensor():
    c = make(12, free_order=[5, 2, 9, 4])
    for s, n in [("x", 7), ("y", 0), ("z", 2)]:
        c.add_sequence(s)
        c.append_tokens(s, *kv(n))
    bt = c.block_table(["x", "y", "z"])
    assert bt.dtype == torch.int32 and bt.tolist() == [[5, 2], [-1, -1], [9, -1]]
    assert c.block_table(["z"], width=3).tolist() == [[9, -1, -1]]
    assert c.block_table(["y"]).shape == (1, 0)
    with pytest.raises(ValueError, match="width"):
        c.block_table(["x"], width=1)
    lens = c.seq_lens_tensor(["z", "x", "y"])
    assert lens.dtype == torch.int32 and lens.tolist() == [2, 7, 0]


def test_layer_views_share_storage():
    c = make()
    lk, lv = c.layer(1)
    assert lk.shape == lv.shape == (12, BS, H, D)
    assert lk.data_ptr() == c.k[:, 1].data_ptr() and not lk.is_contiguous()
    with pytest.raises(IndexError):
        c.layer(L)


def test_gather_empty_sequence():
    c = make()
    c.add_sequence(0)
    gk, gv = c.gather(0)
    assert gk.shape == gv.shape == (L, 0, H, D)


def test_slot_out_of_range():
    c = make()
    c.add_sequence(0)
    c.append_tokens(0, *kv(3))
    for pos in (3, -1):
        with pytest.raises(IndexError, match="pos must be in"):
            c.slot(0, pos)


def test_utilization_figures():
    c = make()
    c.add_sequence(0)
    c.add_sequence(1)
    c.append_tokens(0, *kv(5))  # 2 blocks, 8 slots
    c.append_tokens(1, *kv(4))  # 1 block, 4 slots
    assert c.num_tokens == 9 and c.num_allocated_slots == 12
    assert c.utilization == pytest.approx(9 / 12)
    assert c.sequence_utilization(0) == pytest.approx(5 / 8)
    assert c.sequence_utilization(1) == 1.0
    assert block_owners(c) == [0, 0, 1] + [None] * 9


def test_fill_unused_poisons_only_empty_slots():
    c = make(6)
    c.add_sequence(0)
    k, v = kv(5)
    c.append_tokens(0, k, v)
    fill_unused(c)
    assert torch.equal(c.gather(0)[0], k) and torch.equal(c.gather(0)[1], v)
    assert torch.isnan(c.k[1, :, 1:]).all() and torch.isnan(c.v[2:]).all()  # tail of block 1, free blocks
    assert not torch.isnan(c.k[0]).any() and not torch.isnan(c.k[1, :, 0]).any()


def test_repr_is_readable():
    c = make(12, free_order=[5, 2])
    c.add_sequence(0)
    c.append_tokens(0, *kv(7))
    text = repr(c)
    assert text.startswith("PagedKVCache(num_blocks=12, num_layers=2, block_size=4")
    assert "2 used, 10 free" in text and "seq 0: len 7, table [5, 2]" in text
    assert "utilization 88%" in text


# --- lifecycle (the article's third test category) ------------------------------------------------


def test_free_returns_every_block():
    c = make(12)
    c.add_sequence(0)
    c.append_tokens(0, *kv(10))
    blocks = list(c.tables[0])
    assert c.free_sequence(0) == blocks
    assert c.free[-3:] == blocks  # its last block is back on top (reused first, as in vLLM 0.32.0)
    assert sorted(c.free) == list(range(12)) and c.tables == {} and c.seq_lens == {}
    check_invariants(c)
    c.add_sequence(0)  # the id can be reused after freeing
    assert c.append_tokens(0, *kv(1)) == [blocks[-1]]


def test_exhaustion_raises_and_leaks_nothing():
    c = make(3)
    c.add_sequence(0)
    k, v = kv(3 * BS + 1)
    c.append_tokens(0, k[:, : 3 * BS], v[:, : 3 * BS])
    assert c.num_free_blocks == 0
    snap = snapshot(c)
    with pytest.raises(OutOfBlocksError) as info:
        c.append_token(0, k[:, -1], v[:, -1])
    assert isinstance(info.value, RuntimeError)
    assert (info.value.needed, info.value.free) == (1, 0)
    assert "1 needed" in str(info.value) and "0 free" in str(info.value)
    assert_unchanged(c, snap)
    c.free_sequence(0)
    assert c.num_free_blocks == 3


def test_interleaved_sequences_leak_nothing():
    c = make(16, free_order=torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist())
    written: dict[int, list[torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(1)
    for step in range(60):
        s = int(torch.randint(0, 4, (1,), generator=gen))
        if s not in c.seq_lens:
            c.add_sequence(s)
            written[s] = []
        k, v = kv(seed=step)
        try:
            c.append_token(s, k, v)
            written[s].append(k)
        except OutOfBlocksError:
            victim = max(c.seq_lens, key=c.seq_lens.get)
            c.free_sequence(victim)
            del written[victim]
        check_invariants(c)
        used = sum(ceil_div(n, BS) for n in c.seq_lens.values())
        assert c.num_free_blocks == 16 - used
        for t, toks in written.items():
            if toks:
                assert torch.equal(c.gather(t)[0], torch.stack(toks, dim=1))
    for s in list(c.seq_lens):
        c.free_sequence(s)
    assert sorted(c.free) == list(range(16))


# --- error paths: clear exception, nothing changed --------------------------------------------------


@pytest.fixture
def busy() -> PagedKVCache:
    """Three sequences; "full" ends exactly on a block boundary; one block left free; pools NaN-poisoned
    where unused so an accidental write shows."""
    c = make(6, free_order=[4, 0, 5, 1, 3, 2])
    for s, n in [("a", 5), ("full", 8), ("e", 0)]:
        c.add_sequence(s)
        c.append_tokens(s, *kv(n, seed=len(s)))
    fill_unused(c)
    assert c.num_free_blocks == 2
    c.append_tokens("a", *kv(4, seed=9))  # a: 9 tokens, 3 blocks; 1 block free
    assert c.num_free_blocks == 1
    return c


tok = kv()
bad_shape = torch.zeros(L, H, D + 1)
ERRORS = {
    # name: (call, exception, fragments the message must contain)
    "token unknown id": (lambda c: c.append_token("nope", *tok), KeyError, ["'nope'"]),
    "token k shape": (lambda c: c.append_token("a", bad_shape, tok[1]), ValueError,
                      ["k_vec", f"[{L}, {H}, {D}]", f"[{L}, {H}, {D + 1}]"]),
    "token v shape": (lambda c: c.append_token("a", tok[0], tok[1][0]), ValueError,
                      ["v_vec", f"[{L}, {H}, {D}]"]),
    "token dtype": (lambda c: c.append_token("a", tok[0].double(), tok[1]), ValueError,
                    ["k_vec", "torch.float32", "torch.float64"]),
    "token device": (lambda c: c.append_token("a", tok[0], tok[1].to("meta")), ValueError,
                     ["v_vec", "cpu", "meta"]),
    "token not a tensor": (lambda c: c.append_token("a", tok[0].tolist(), tok[1]), ValueError,
                           ["k_vec", "list"]),
    "tokens unknown id": (lambda c: c.append_tokens(7, *kv(2)), KeyError, ["7"]),
    "tokens layers": (lambda c: c.append_tokens("a", *torch.zeros(2, L + 1, 2, H, D)),
                      ValueError, ["k", f"[{L}, n, {H}, {D}]"]),
    "tokens n mismatch": (lambda c: c.append_tokens("a", kv(2)[0], kv(3)[1]), ValueError,
                          ["v", f"[{L}, 2, {H}, {D}]", f"[{L}, 3, {H}, {D}]"]),
    "tokens 3-d": (lambda c: c.append_tokens("a", tok[0], tok[1]), ValueError,
                   ["k", "[num_layers, n, kv_heads"]),
    "tokens dtype": (lambda c: c.append_tokens("a", kv(2)[0], kv(2)[1].half()), ValueError, ["v", "float16"]),
    "tokens out of blocks": (lambda c: c.append_tokens("a", *kv(3 + 2 * BS)), OutOfBlocksError,
                             ["2 needed", "1 free"]),
    "batch unknown id": (lambda c: c.append_batch(["a", "zz", "e"], *kv(3)), KeyError, ["'zz'"]),
    "batch duplicate id": (lambda c: c.append_batch(["a", "e", "a"], *kv(3)), ValueError,
                           ["'a'", "distinct"]),
    "batch size mismatch": (lambda c: c.append_batch(["a", "e"], *kv(3)), ValueError,
                            ["k", f"[{L}, 2, {H}, {D}]", f"[{L}, 3, {H}, {D}]"]),
    "batch dtype": (lambda c: c.append_batch(["a"], kv(1)[0], kv(1)[1].bfloat16()), ValueError,
                    ["v", "bfloat16"]),
    "batch out of blocks": (lambda c: c.append_batch(["a", "full", "e"], *kv(3)), OutOfBlocksError,
                            ["2 needed", "1 free"]),
    "add existing id": (lambda c: c.add_sequence("a"), ValueError, ["'a'", "already exists"]),
    "add unhashable id": (lambda c: c.add_sequence(["a"]), TypeError, []),
    "add None id": (lambda c: c.add_sequence(None), ValueError, ["seq_id", "None"]),
    "batch ids in a set": (lambda c: c.append_batch({"a", "e"}, *kv(2)), ValueError, ["seq_ids", "set"]),
    "batch ids in a str": (lambda c: c.append_batch("ae", *kv(2)), ValueError, ["seq_ids", "str"]),
    "tokens sparse v": (lambda c: c.append_tokens("a", kv(2)[0], kv(2)[1].to_sparse()), ValueError,
                        ["v", "dense", "sparse"]),
    "tokens v is a view of the pool": (lambda c: c.append_tokens("a", kv(2)[0], c.v[0, :, :2]), ValueError,
                                       ["v", "view of the cache"]),
    "token k is a view of the pool": (lambda c: c.append_token("a", c.k[1, :, 0], tok[1]), ValueError,
                                      ["k_vec", "view of the cache"]),
    "batch v is a view of the pool": (lambda c: c.append_batch(["e"], kv(1)[0], c.v[2, :, :1]), ValueError,
                                      ["v", "view of the cache"]),
    "slot float pos": (lambda c: c.slot("a", 1.0), ValueError, ["pos", "1.0"]),
    "block_table float width": (lambda c: c.block_table(["a"], width=3.5), ValueError, ["width", "3.5"]),
    "layer float": (lambda c: c.layer(1.0), ValueError, ["l must be an int"]),
    "free unknown id": (lambda c: c.free_sequence("b"), KeyError, ["'b'"]),
    "gather unknown id": (lambda c: c.gather(3), KeyError, ["3"]),
    "slot unknown id": (lambda c: c.slot(3, 0), KeyError, ["3"]),
    "slot out of range": (lambda c: c.slot("a", 9), IndexError, ["9"]),
    "block_table unknown id": (lambda c: c.block_table(["a", 3]), KeyError, ["3"]),
    "seq_lens_tensor unknown id": (lambda c: c.seq_lens_tensor([3]), KeyError, ["3"]),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_error_leaves_state_unchanged(busy, name):
    call, exc, fragments = ERRORS[name]
    snap = snapshot(busy)
    with pytest.raises(exc) as info:
        call(busy)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert_unchanged(busy, snap)


def test_unknown_id_error_is_a_keyerror_with_a_readable_message():
    c = make()
    c.add_sequence(1)
    with pytest.raises(UnknownSequenceError) as info:
        c.gather(2)
    assert isinstance(info.value, KeyError) and info.value.seq_id == 2
    assert str(info.value) == "unknown sequence id 2 (live sequences: [1])"


# --- check_invariants catches each kind of corruption ---------------------------------------------


@pytest.mark.parametrize(
    "corrupt, number",
    [
        (lambda c: c.tables["b"].append(c.tables["a"][0]), "1:"),  # a block with two owners
        (lambda c: c.free.append(c.tables["a"][0]), "2:"),  # an allocated block on the free stack
        (lambda c: c.tables["a"].__setitem__(0, 99), "3:"),  # an invalid id in a table
        (lambda c: c.free.append(-1), "3:"),  # an invalid id on the stack
        (lambda c: c.seq_lens.__setitem__("a", 1), "4:"),  # wrong number of blocks for the length
        (lambda c: c.free.pop(), "2:"),  # a leaked block (neither free nor held)
        (lambda c: c.free.append(c.free[0]), "2:"),  # a block twice on the stack
        (lambda c: c.ref_counts.__setitem__(c.tables["a"][0], 2), "1:"),  # a count no table accounts for
        (lambda c: c.tables["a"].__setitem__(1, c.tables["a"][0]), "1:"),  # one table holds a block twice
    ],
)
def test_check_invariants_detects_corruption(corrupt, number):
    c = make(8)
    for s, n in [("a", 6), ("b", 3)]:
        c.add_sequence(s)
        c.append_tokens(s, *kv(n))
    check_invariants(c)
    corrupt(c)
    with pytest.raises(InvariantError, match=number):
        check_invariants(c)


def test_read_side_takes_any_iterable_of_ids_and_tensors():
    cache = PagedKVCache(8, 1, 2, 1, 2)
    for s, n in ((0, 3), (1, 1)):
        cache.add_sequence(s)
        cache.append_tokens(s, torch.ones(1, n, 1, 2), torch.ones(1, n, 1, 2))
    want_lens = torch.tensor([3, 1], dtype=torch.int32)
    assert torch.equal(cache.seq_lens_tensor(iter([0, 1])), want_lens)  # a generator is read once
    assert torch.equal(cache.seq_lens_tensor(torch.tensor([0, 1])), want_lens)
    assert cache.block_table(iter([0, 1])).tolist() == [[0, 1], [2, -1]]
    assert cache.block_table(torch.tensor([1])).tolist() == [[2]]
    with pytest.raises(KeyError, match="unknown sequence id 5"):
        cache.seq_lens_tensor(iter([0, 5]))


# --- hostile input (each test fails on a version without the check it names) ------------------------


def test_constructor_names_the_bad_argument_before_allocating():
    for kwargs, name in [({"dtype": torch.float8_e4m3fnuz}, "dtype"), ({"dtype": torch.int32}, "dtype"),
                         ({"dtype": torch.float16, "fill": 1e10}, "fill"), ({"fill": "x"}, "fill"),
                         ({"device": "no-such-device"}, "device")]:
        with pytest.raises(ValueError, match=name):
            make(4, **kwargs)
    with pytest.raises(ValueError, match=r"num_blocks=1000000000 asks for 131,072,000,000,000 bytes"):
        PagedKVCache(10**9, 1, 16, 8, 128)  # 131 TB: refused before torch is asked for it
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(2**31, 1, 1, 1, 1)  # block ids must fit the int32 block tables
    c = PagedKVCache(np.int64(4), np.int32(L), BS, H, D, free_order=[np.int64(1)], fill=float("inf"))
    assert c.num_blocks == 4 and type(c.num_blocks) is int and c.free[-1] == 1
    assert make(2, dtype=torch.float16, fill=float("nan")).k.isnan().all()


def test_writes_never_record_history_nor_keep_inputs_alive():
    c = make()
    for s in range(2):
        c.add_sequence(s)
    k, v = (t.requires_grad_() for t in kv(3))
    k1, v1 = (t.requires_grad_() for t in kv(2, seed=1))
    c.append_tokens(0, k, v)
    c.append_token(1, k1[:, 0], v1[:, 0])
    c.append_batch([0, 1], k1, v1)
    assert not c.k.requires_grad and not c.v.requires_grad and c.k.grad_fn is None
    refs = [weakref.ref(t) for t in (k, v, k1, v1)]
    del k, v, k1, v1
    assert all(r() is None for r in refs), "the cache keeps the appended tensors alive"
    assert not c.gather(0)[0].requires_grad


def test_errors_survive_pickle():
    for e in (OutOfBlocksError(3, 1, "a prompt"), UnknownSequenceError("x", ["a", "b"]),
              InvariantError("1: block 3 is lost")):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.args == e.args
    back = pickle.loads(pickle.dumps(OutOfBlocksError(3, 1, "a prompt")))
    assert (back.needed, back.free, back.what) == (3, 1, "a prompt")
    back = pickle.loads(pickle.dumps(UnknownSequenceError("x", ["a", "b"])))
    assert back.seq_id == "x" and str(back) == "unknown sequence id 'x' (live sequences: ['a', 'b'])"


def test_a_cache_pickles_and_deep_copies():
    c = make(6)
    c.add_sequence(0)
    c.append_tokens(0, *kv(5))
    for copy in (pickle.loads(pickle.dumps(c)), __import__("copy").deepcopy(c)):
        assert copy.tables == c.tables and torch.equal(copy.gather(0)[0], c.gather(0)[0])
        copy.append_token(0, *kv())  # the copy is independent of the original
        assert c.seq_lens[0] == 5


def test_state_diff_names_what_changed():
    c = make(6, fill=float("nan"))
    c.add_sequence(0)
    before = snapshot(c)
    assert state_diff(c, before) == []  # NaN slots compare equal to themselves
    c.append_tokens(0, *kv(5))
    assert set(state_diff(c, before)) == {"k", "v", "free", "tables", "seq_lens", "ref_counts"}


def test_reserving_takes_the_slots_an_append_would_write_and_writes_no_kv():
    """``reserving`` (a one-off model step: the model writes K/V layer by layer itself) advances the same
    bookkeeping as an append and hands over a ``Batch``: each sequence's flat slot ids, tables and lengths
    after the step, and the block copies to make first. It copies and writes nothing itself."""
    ref, c = make(fill=float("nan")), make(fill=float("nan"))
    for cache in (ref, c):
        for s, n in (("a", 3), ("b", 5)):
            cache.add_sequence(s)
            cache.append_tokens(s, *kv(n, seed=n))
        cache.fork("a", "f")  # "f" shares a's partly filled block: reserving for it copies the block
    pools = c.k.clone(), c.v.clone()
    with c.reserving(["f", "b"], [[0] * 2, [0] * 4]) as batch:
        assert torch.equal(c.k.nan_to_num(7.0), pools[0].nan_to_num(7.0))  # nothing written, no copy made
        assert torch.equal(c.v.nan_to_num(7.0), pools[1].nan_to_num(7.0))
        c.pool.copy_blocks(batch.copies)
    k, v = kv(6, seed=9)
    ref.append_tokens("f", k[:, :2], v[:, :2])
    ref.append_tokens("b", k[:, 2:], v[:, 2:])
    assert c.tables == ref.tables and c.seq_lens == ref.seq_lens and c.free == ref.free and c.cow_copies == 1
    want = [[c.slot(s, p).block * BS + c.slot(s, p).offset for p in range(c.seq_lens[s] - n, c.seq_lens[s])]
            for s, n in (("f", 2), ("b", 4))]
    copy = c.tables["f"][0]
    assert batch.slots == want and batch.copies == [(c.tables["a"][0], copy)]
    assert batch.seq_ids == ["f", "b"] and batch.seq_lens == [5, 9]
    assert batch.block_tables == [c.tables["f"], c.tables["b"]]
    assert torch.equal(c.k[copy, :, :3], c.k[c.tables["a"][0], :, :3])  # the copy holds a's 3 tokens
    check_invariants(c)
    snap = snapshot(c)
    for seq_ids, chunks, text in [(["a"], [[1], [2]], "chunks must hold 1 lists"),
                                  (["a", "a"], [[1], [1]], "distinct"),
                                  (["a"], [None], "got None"), (["a"], "ab", "chunks must hold"),
                                  (["a"], [[1, -1]], r"chunks\[0\]\[1\] must be >= 0")]:
        with pytest.raises(ValueError, match=text):
            with c.reserving(seq_ids, chunks):
                pass
        assert_unchanged(c, snap)
    with pytest.raises(OutOfBlocksError, match="a batch of 2 sequences"):
        with c.reserving(["a", "b"], [[0] * 40, [0]]):
            pass
    assert_unchanged(c, snap)
    with pytest.raises(KeyboardInterrupt):  # interrupted inside the block: undone
        with c.reserving(["f", "b"], [[0], [0] * 7]):
            raise KeyboardInterrupt
    assert_unchanged(c, snap)
