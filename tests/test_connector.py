"""Notebook 14's KV connector: a prefill engine saves blocks to a store, a decode engine (here, in another
process) loads them; the tokens equal one engine's, whatever goes wrong with the store."""

from __future__ import annotations

import os
import random
import shutil
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlib.core.connector import KVConnector, LoadFailed
from pagedlib.disagg import decode, decode_in_child, handoff, store_throughput, tiny_store
from pagedlib.engine import Engine
from pagedlib.kv_transfer.connectors import HostConnector, StoreConnector
from pagedlib.kv_transfer.host_tier import HostTier
from pagedlib.kv_transfer.store import EntryError, KVStore, block_hashes

BLOCK = 32
SETTINGS = {"num_blocks": 48, "block_size": BLOCK, "max_num_batched_tokens": 64}


@pytest.fixture(scope="module")
def tiny():
    from pagedlib.teach.train_tiny import load_tiny

    return load_tiny()[0]


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(96) for _ in range(n)] for n in lengths]


LENGTHS = (100, 128, 134, 31, 64)  # mid-block, on a boundary, two chunks, under a block, two blocks


@pytest.fixture(scope="module")
def reference(tiny):
    prompts = prompts_of(LENGTHS)
    return prompts, Engine(tiny, **SETTINGS).generate(prompts, 12)


def prefill(tiny, root, prompts, **options):
    engine = Engine(tiny, **{**SETTINGS, **options}, connector=StoreConnector(tiny_store(root), "producer"))
    return engine, engine.generate(prompts, 1)


def decoder(tiny, root, **options):
    return Engine(tiny, **{**SETTINGS, **options}, connector=StoreConnector(tiny_store(root), "consumer"))


def test_prefill_here_decode_in_another_process_gives_one_engines_tokens(tiny, reference, tmp_path):
    prompts, expected = reference
    _, first = prefill(tiny, tmp_path, prompts)
    done = decode_in_child(tmp_path, handoff(prompts, first), 11, **SETTINGS)
    assert [f + t for f, t in zip(first, done.tokens)] == expected
    # whole blocks found at admission; the block of the last token (the first token, appended) is computed
    assert done.found == [(n + 1 - 1) // BLOCK * BLOCK for n in LENGTHS]
    assert done.computed == [n + 1 - f + 10 for n, f in zip(LENGTHS, done.found)]
    assert done.stats["loaded_tokens"] == sum(done.found)
    assert done.stats["written_entries"] == 0  # a consumer saves nothing


def check_timing(run, new_tokens):
    """A ``Decoded``'s timing is whole and consistent (no speed is asserted)."""
    steps = len(run.step_seconds)
    assert steps > 0
    for field in (run.load_seconds, run.save_seconds, run.step_tokens, run.step_context, run.step_bytes):
        assert len(field) == steps
    assert all(s > 0 for s in run.step_seconds)
    for load, save, seconds in zip(run.load_seconds, run.save_seconds, run.step_seconds):
        assert 0 <= load + save <= seconds
    assert sum(run.step_tokens) == sum(run.computed)
    assert all(c >= t > 0 for t, c in zip(run.step_tokens, run.step_context))
    assert sum(run.step_bytes) == run.stats["bytes_read"] + run.stats["bytes_written"]
    for steps_made, times, gaps, tokens in zip(run.token_steps, run.times(), run.gaps(), run.tokens):
        assert len(steps_made) == len(times) == len(tokens) == new_tokens
        assert len(gaps) == len(tokens) - 1
        assert all(b > a >= 0 for a, b in zip([0.0] + times, times))  # one token a step: times increase
        assert all(g > 0 for g in gaps)
    assert run.times([1.0] * steps) == [[step + 1.0 for step in made] for made in run.token_steps]


def test_both_sides_of_the_split_are_timed_transfer_included(tiny, reference, tmp_path):
    prompts, expected = reference
    engine = Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(tmp_path), "producer"))
    first = decode(engine, prompts, 1)
    check_timing(first, 1)
    assert sum(first.save_seconds) > 0 and sum(first.load_seconds) < sum(first.save_seconds)
    done = decode_in_child(tmp_path, handoff(prompts, first.tokens), 11, threads=1, warm_up=True, **SETTINGS)
    assert [f + t for f, t in zip(first.tokens, done.tokens)] == expected  # warming up changes no token
    check_timing(done, 11)
    assert done.stats["loaded_tokens"] == sum(done.found) > 0   # the warm-up loaded nothing
    assert sum(done.load_seconds) > 0 and sum(done.save_seconds) < sum(done.load_seconds)
    assert all(load > 0 for load, moved in zip(done.load_seconds, done.step_bytes) if moved)


def test_the_store_throughput_is_measured(tmp_path):
    store = tiny_store(tmp_path)
    write, read = store_throughput(store, blocks=2)
    assert write > 0 and read > 0 and store.stats()["written_entries"] == 2


@pytest.mark.parametrize("prefix_caching", [(False, True), (True, False), (True, True)])
def test_prefix_caching_on_either_side_changes_no_token(tiny, reference, tmp_path, prefix_caching):
    prompts, expected = reference
    shared = prompts_of([70])[0]  # a shared prefix: the prefix caches find part of it themselves
    prompts = [shared + p for p in prompts[:3]]
    expected = Engine(tiny, **SETTINGS).generate(prompts, 12)
    _, first = prefill(tiny, tmp_path, prompts, enable_prefix_caching=prefix_caching[0])
    engine = decoder(tiny, tmp_path, enable_prefix_caching=prefix_caching[1])
    done = decode(engine, handoff(prompts, first), 11)
    assert [f + t for f, t in zip(first, done.tokens)] == expected
    assert done.found == [len(p) // BLOCK * BLOCK for p in prompts]  # cache or store: every full block


def test_what_one_entry_holds_is_the_producers_block_bit_for_bit(tiny, tmp_path):
    prompt = prompts_of([70])[0]
    engine, _ = prefill(tiny, tmp_path, [prompt], enable_prefix_caching=True)
    store = tiny_store(tmp_path)
    keys = block_hashes(prompt, BLOCK)
    assert len(keys) == 2 and all(key in store for key in keys)
    blocks = engine.cache.prefix_cache.peek(prompt)  # the producer's cached blocks, still in its pool
    for key, block in zip(keys, blocks):
        k, v = store.get(key)
        assert torch.equal(k, engine.cache.pool.k[block]) and torch.equal(v, engine.cache.pool.v[block])


def test_host_blocks_builds_the_host_connector_a_reader_could_pass_by_hand(tiny, reference):
    prompts, _ = reference
    prompts = prompts + [p[:90] + [1, 2, 3] for p in prompts[:3]]  # later requests find earlier blocks
    small = {**SETTINGS, "num_blocks": 10, "enable_prefix_caching": True}  # the pool evicts: the tier finds
    built_in = Engine(tiny, **small, host_blocks=12)
    tokens = built_in.generate(prompts, 12)
    tier = HostTier(Engine(tiny, **small).cache.pool, 12)
    through = Engine(tiny, **small, connector=HostConnector(tier))
    assert through.generate(prompts, 12) == tokens
    ours, theirs = tier.stats(), built_in.host.stats()
    assert ours == theirs and ours["loaded_blocks"] > 0
    assert through.stats.connector_tokens == built_in.stats.connector_tokens
    assert isinstance(built_in.connector, HostConnector)  # host_blocks= builds this very connector


# ---- faults: none changes a token ----------------------------------------------------------------------

def entries(root):
    return sorted(p for p in root.rglob("*.safetensors"))


def faulty_run(tiny, root, prompts, expected, spoil, **decode_options):
    """Prefill, ``spoil`` the store, decode: the tokens must still be one engine's."""
    _, first = prefill(tiny, root, prompts)
    spoil(root)
    engine = decoder(tiny, root, **decode_options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = decode(engine, handoff(prompts, first), 11)
    assert [f + t for f, t in zip(first, done.tokens)] == expected
    return done, engine, [str(w.message) for w in caught]


def test_a_missing_entry_is_computed(tiny, reference, tmp_path):
    prompts, expected = reference
    done, _, _ = faulty_run(tiny, tmp_path, prompts, expected,
                            lambda root: tiny_store(root).path(block_hashes(prompts[1], BLOCK)[1]).unlink())
    assert done.found[1] == BLOCK  # the lookup stops at the first miss
    assert done.found[2] == 4 * BLOCK


@pytest.mark.parametrize("damage", ["truncated", "garbled", "zeroed header", "another model"])
def test_a_damaged_entry_is_refused_at_lookup_with_a_warning(tiny, reference, tmp_path, damage):
    prompts, expected = reference
    key = block_hashes(prompts[0], BLOCK)[1]

    def spoil(root):
        path = tiny_store(root).path(key)
        data = bytearray(path.read_bytes())
        if damage == "truncated":
            data = data[:len(data) // 2]
        elif damage == "garbled":
            data[-100:] = bytes(100)  # the header is fine: only the digest can tell
        elif damage == "zeroed header":
            data[:64] = bytes(64)
        else:  # an entry another model's store wrote, copied in under the same name
            other = KVStore(root / "other", model="another model", block_size=BLOCK, num_layers=3,
                            kv_heads=2, head_dim=32)
            other.put(key, "", torch.zeros(3, BLOCK, 2, 32), torch.zeros(3, BLOCK, 2, 32), "test")
            data = other.path(key).read_bytes()
        path.write_bytes(bytes(data))

    done, engine, messages = faulty_run(tiny, tmp_path, prompts, expected, spoil)
    assert done.found[0] == BLOCK
    assert done.stats["rejected_entries"] == 1
    assert any(key[:12] in m and "computed instead" in m for m in messages), messages
    if damage == "garbled":
        assert engine.stats.load_failures == 1 and done.stats["load_failures"] == 1  # found at load
        assert "SHA-256" in engine.connector.bad[key]


def test_an_entry_that_vanishes_between_lookup_and_load_undoes_the_step_and_computes_it(tiny, reference,
                                                                                         tmp_path):
    prompts, expected = reference
    _, first = prefill(tiny, tmp_path, prompts)
    engine = decoder(tiny, tmp_path)
    store = engine.connector.store
    victim = block_hashes(prompts[2], BLOCK)[0]
    original = engine.connector.start_load_kv

    def vanish_then_load(pool, meta):
        if store.path(victim).exists():
            store.path(victim).unlink()
        original(pool, meta)

    engine.connector.start_load_kv = vanish_then_load
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        done = decode(engine, handoff(prompts, first), 11)
    assert [f + t for f, t in zip(first, done.tokens)] == expected
    assert engine.stats.load_failures == 1 and done.found[2] == 0


def test_a_store_folder_that_vanishes_mid_run_only_costs_its_saves(tiny, reference, tmp_path):
    prompts, expected = reference
    engine = Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(tmp_path)))
    ids = [engine.add_request(p, 12) for p in prompts]
    engine.step()
    shutil.rmtree(tmp_path)
    with pytest.warns(RuntimeWarning, match="not saved"):
        while engine.has_unfinished():
            engine.step()
    assert [engine.output(i) for i in ids] == expected
    assert engine.connector.save_failures > 0 and not tmp_path.exists()  # nothing made it again


def test_an_interrupted_load_leaves_the_engine_as_before_the_step(tiny, reference, tmp_path):
    prompts, expected = reference
    _, first = prefill(tiny, tmp_path, prompts)
    engine = decoder(tiny, tmp_path)
    store = engine.connector.store
    get, calls = store.get, []

    def interrupted(key):
        calls.append(key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return get(key)

    store.get = interrupted
    ids = [engine.add_request(p, 11) for p in handoff(prompts, first)]
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.cache.num_used_blocks == 0 and len(engine.scheduler.waiting) == len(ids)
    while engine.has_unfinished():
        engine.step()
    assert [f + engine.output(i) for f, i in zip(first, ids)] == expected
    assert engine.connector.load_failures == 0  # an interrupt is not a bad entry


def test_an_interrupted_save_leaves_no_half_entry_and_the_run_goes_on(tiny, reference, tmp_path,
                                                                     monkeypatch):
    prompts, expected = reference
    engine = Engine(tiny, **SETTINGS, connector=StoreConnector(tiny_store(tmp_path)))
    ids = [engine.add_request(p, 12) for p in prompts]
    replace, calls = os.replace, []

    def interrupted(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt
        replace(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    monkeypatch.setattr(os, "replace", replace)
    assert len(entries(tmp_path)) == 1 and not list(tmp_path.rglob("*.tmp"))  # one whole entry, no half
    store = engine.connector.store
    assert all(store.check_header(p.stem) is None for p in entries(tmp_path))
    while engine.has_unfinished():
        engine.step()
    assert [engine.output(i) for i in ids] == expected
    assert all(store.get(p.stem) for p in entries(tmp_path))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_damage_to_a_store_never_changes_a_token(tiny, reference, tmp_path_factory, data):
    prompts, expected = reference
    root = tmp_path_factory.mktemp("store")
    _, first = prefill(tiny, root, prompts)
    paths = entries(root)
    for path in data.draw(st.lists(st.sampled_from(paths), max_size=6, unique=True)):
        kind = data.draw(st.sampled_from(["delete", "truncate", "flip"]))
        raw = bytearray(path.read_bytes())
        if kind == "delete":
            path.unlink()
        elif kind == "truncate":
            path.write_bytes(bytes(raw[:data.draw(st.integers(0, len(raw) - 1))]))
        else:
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
            path.write_bytes(bytes(raw))
    prefix_caching = data.draw(st.booleans())
    engine = decoder(tiny, root, enable_prefix_caching=prefix_caching)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        done = decode(engine, handoff(prompts, first), 11)
    assert [f + t for f, t in zip(first, done.tokens)] == expected


# ---- refusals: clear errors, nothing written ---------------------------------------------------------

def test_a_store_for_another_model_or_layout_is_refused_before_anything_is_written(tmp_path):
    tiny_store(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    for change, name in (({"model": "x"}, "model"), ({"head_dim": 64}, "head_dim"),
                         ({"block_size": 16}, "block_size"), ({"dtype": "bfloat16"}, "dtype")):
        geometry = {**tiny_store(tmp_path).geometry, **change}
        with pytest.raises(ValueError, match=name):
            KVStore(tmp_path, **geometry)
    assert sorted(tmp_path.rglob("*")) == before
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        tiny_store(tmp_path / "file")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "store.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a store manifest"):
        tiny_store(tmp_path / "bad")


def test_bad_connectors_are_refused_naming_what_is_wrong(tiny, tmp_path):
    store = tiny_store(tmp_path)
    with pytest.raises(TypeError, match="store must be a KVStore"):
        StoreConnector(str(tmp_path))
    with pytest.raises(ValueError, match="role must be one of"):
        StoreConnector(store, "sender")
    with pytest.raises(ValueError, match="block_size is 32, the cache's 16"):
        Engine(tiny, 48, 16, connector=StoreConnector(store))
    with pytest.raises(ValueError, match="a host tier and a connector"):
        Engine(tiny, **SETTINGS, host_blocks=4, connector=StoreConnector(store))
    with pytest.raises(ValueError, match="unquantized"):
        Engine(tiny, **SETTINGS, kv_cache_dtype=torch.float8_e4m3fn, connector=StoreConnector(store))
    other = KVStore(tmp_path / "o", model="m", block_size=BLOCK, num_layers=2, kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="num_layers"):
        Engine(tiny, **SETTINGS, connector=StoreConnector(other))
    with pytest.raises(ValueError, match="must be a KVConnector"):
        Engine(tiny, **SETTINGS, connector=store)
    with pytest.raises(ValueError, match="model must be a non-empty string"):
        KVStore(tmp_path, model="", block_size=BLOCK, num_layers=3, kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="fp8"):
        KVStore(tmp_path, model="m", block_size=BLOCK, num_layers=3, kv_heads=2, head_dim=32,
                dtype="float8_e4m3fn")


@pytest.mark.parametrize("offer", [40, 41, -1, 2.0])
def test_a_connector_that_offers_the_last_token_or_nonsense_is_refused(tiny, tmp_path, offer):
    class Greedy(StoreConnector):
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return offer

    engine = Engine(tiny, **SETTINGS, connector=Greedy(tiny_store(tmp_path)))
    engine.add_request(list(range(40)), 2)
    with pytest.raises(ValueError, match="at most 39, never the last token"):
        engine.step()
    assert engine.cache.num_used_blocks == 0 and engine.scheduler.plan is None


def test_put_refuses_a_block_of_another_shape_and_get_names_a_missing_entry(tmp_path):
    store = tiny_store(tmp_path)
    with pytest.raises(ValueError, match=r"k must be torch.float32 \[3, 32, 2, 32\]"):
        store.put("ab" * 32, "", torch.zeros(3, 16, 2, 32), torch.zeros(3, 32, 2, 32), "test")
    with pytest.raises(EntryError, match="cannot be read"):
        store.get("cd" * 32)
    assert entries(tmp_path) == []


def test_the_contract_is_abstract_and_load_failed_names_the_block():
    with pytest.raises(TypeError):
        KVConnector(32)
    error = LoadFailed(3, "ab" * 32, "is truncated")
    assert "request 3" in str(error) and "abababab" in str(error)
