"""vLLM with pagedlib's connector (``pagedlib.vllm.connector``): blocks computed by one engine, vLLM's or
pagedlib's, and loaded by another through a ``KVStore`` give the tokens one vLLM engine gives alone.

A prefill engine runs each prompt with ``max_tokens=1`` and is closed; a decode engine, started afresh on the
same store, gets the prompt plus that first token (what the proxy of vLLM's disaggregated setups sends on)
and makes the rest. vLLM runs in worker processes (``VllmWorker``), one for each engine.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlib.vllm.bridge import TINY_MODEL, Arrival, BridgeConfig, VllmWorker, vllm_available

AVAILABLE, WHY = vllm_available()
if not AVAILABLE:
    pytest.skip(WHY, allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BLOCK = 32
NEW_TOKENS = 8
# one prompt ending mid-block, one on a block boundary, a longer one for the damaged entries
PROMPTS = {"mid": 100, "edge": 128, "long": 200}
CONFIG = BridgeConfig(num_blocks=48, block_size=BLOCK, max_num_batched_tokens=256)


def prompt(name: str) -> list[int]:
    import random

    rng = random.Random(name)
    return [rng.randrange(96) for _ in range(PROMPTS[name])]


def geometry() -> dict:
    from pagedlib.kv_transfer.store import model_fingerprint

    return dict(model=model_fingerprint(TINY_MODEL), block_size=BLOCK, num_layers=3, kv_heads=2, head_dim=32,
                dtype="float32")


@pytest.fixture(scope="module")
def reference():
    """One vLLM engine, no store: the tokens every pairing must give."""
    with VllmWorker() as worker:
        _, tokens = worker.run(CONFIG, [Arrival(name, prompt(name), NEW_TOKENS) for name in PROMPTS])
    return tokens


def vllm_prefill(store: Path) -> dict[str, list[int]]:
    with VllmWorker() as worker:
        _, tokens = worker.run(dataclasses.replace(CONFIG, kv_store=str(store)),
                               [Arrival(name, prompt(name), 1) for name in PROMPTS])
    return tokens


def vllm_decode(store: Path, first: dict[str, list[int]], names=tuple(PROMPTS)):
    """A fresh vLLM engine on ``store``: each prompt plus its first token, ``NEW_TOKENS - 1`` more."""
    with VllmWorker() as worker:
        records, tokens = worker.run(dataclasses.replace(CONFIG, kv_store=str(store)),
                                     [Arrival(name, prompt(name) + first[name], NEW_TOKENS - 1)
                                      for name in names])
    return records, {name: first[name] + tokens[name] for name in names}


@pytest.fixture(scope="module")
def vllm_store(tmp_path_factory):
    """A store that a vLLM prefill filled (and the first tokens it made)."""
    store = tmp_path_factory.mktemp("vllm_store")
    return store, vllm_prefill(store)


def loadable_blocks(name: str) -> int:
    """The blocks the decode side loads: the full ones before the one holding its last prompt token
    (its prompt is one token longer than the prefill's)."""
    return PROMPTS[name] // BLOCK


def test_layout_round_trip_against_the_op():
    """Blocks written by vLLM's op read back unchanged, and our write lays them out as the op does."""
    code = """
import torch
from vllm import _custom_ops as ops
from pagedlib.vllm.connector import CpuBlockLayout, cpu_attention_isa
for dtype in (torch.float32, torch.bfloat16):
    isa = cpu_attention_isa(dtype, 32, 32)
    layout = CpuBlockLayout(isa, 2, 32, 32, dtype)
    k, v = torch.randn(3, 32, 2, 32).to(dtype), torch.randn(3, 32, 2, 32).to(dtype)
    cache = torch.randn(6, 2, 32, 64).to(dtype)
    key_cache, value_cache = layout.halves(cache)
    slots = torch.cat([torch.arange(32) + 32 * b for b in (4, 1, 2)])
    ops.cpu_attn_reshape_and_cache(k.reshape(-1, 2, 32), v.reshape(-1, 2, 32), key_cache, value_cache,
                                   slots, isa)
    k2, v2 = layout.read(cache, [4, 1, 2])
    assert torch.equal(k, k2) and torch.equal(v, v2), isa
    other = torch.zeros_like(cache)
    layout.write(other, [4, 1, 2], k, v)
    assert torch.equal(other[[4, 1, 2]], cache[[4, 1, 2]]), isa
    print(dtype, isa)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.float32" in result.stdout


def test_vllm_prefill_writes_entries(vllm_store):
    """The prefill saved every full block of each prompt, in the store's layout, named by vLLM's ISA."""
    from pagedlib.kv_transfer.store import KVStore, block_hashes

    store_dir, _ = vllm_store
    store = KVStore(store_dir, **geometry())
    for name in PROMPTS:
        keys = block_hashes(prompt(name), BLOCK)
        assert len(keys) == PROMPTS[name] // BLOCK
        for index, key in enumerate(keys):
            assert store.check_header(key) is None, name
            data = store.path(key).read_bytes()
            meta = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])["__metadata__"]
            assert meta["written_by"].startswith("vllm 0.32.0 cpu_attn isa=")
            assert meta["parent"] == (keys[index - 1] if index else "")
            store.get(key)


def test_vllm_prefill_vllm_decode(vllm_store, reference, tmp_path):
    """A new vLLM engine loads the prefill's blocks (counted as prefix hits at admission, whole blocks)
    and gives one engine's tokens, for a prompt ending mid-block and one ending on a block boundary."""
    store_dir, first = vllm_store
    store = tmp_path / "store"
    shutil.copytree(store_dir, store)
    records, tokens = vllm_decode(store, first)
    assert tokens == reference
    assert records[0].hits == {name: loadable_blocks(name) * BLOCK for name in PROMPTS}


def test_damaged_entries_change_no_token(vllm_store, reference, tmp_path):
    """A corrupt entry (its K/V bytes changed: only loading finds it, vLLM recomputes the block) and a
    missing one (the admission's lookup stops before it) change no token."""
    from pagedlib.kv_transfer.store import KVStore, block_hashes

    store_dir, first = vllm_store
    store_path = tmp_path / "store"
    shutil.copytree(store_dir, store_path)
    store = KVStore(store_path, **geometry())
    corrupt = store.path(block_hashes(prompt("long"), BLOCK)[2])
    data = bytearray(corrupt.read_bytes())
    data[-100:-90] = bytes(10)             # inside V's numbers: the header still looks right
    corrupt.write_bytes(bytes(data))
    assert store.check_header(corrupt.stem) is None
    store.path(block_hashes(prompt("mid"), BLOCK)[1]).unlink()
    records, tokens = vllm_decode(store_path, first)
    assert tokens == reference
    assert records[0].hits["mid"] == 1 * BLOCK                   # the lookup stopped at the missing block
    assert records[0].hits["long"] == loadable_blocks("long") * BLOCK   # found at admission, failed to load


# ---- pagedlib's engine on the other side --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from pagedlib.teach.train_tiny import load_tiny

    return load_tiny()[0]


def pagedlib_engine(tiny, store: Path):
    from pagedlib.engine import Engine
    from pagedlib.kv_transfer.connectors import StoreConnector
    from pagedlib.kv_transfer.store import KVStore

    return Engine(tiny, CONFIG.num_blocks, BLOCK, max_num_batched_tokens=CONFIG.max_num_batched_tokens,
                  connector=StoreConnector(KVStore(store, **geometry())))


def test_pagedlib_prefill_vllm_decode(tiny, reference, tmp_path):
    store = tmp_path / "store"
    engine = pagedlib_engine(tiny, store)
    firsts = engine.generate([prompt(name) for name in PROMPTS], 1)
    first = dict(zip(PROMPTS, firsts))
    records, tokens = vllm_decode(store, first)
    assert tokens == reference
    assert records[0].hits == {name: loadable_blocks(name) * BLOCK for name in PROMPTS}


def test_vllm_prefill_pagedlib_decode(vllm_store, tiny, reference, tmp_path):
    from pagedlib.vllm.bridge import run_engine

    store_dir, first = vllm_store
    store = tmp_path / "store"
    shutil.copytree(store_dir, store)
    engine = pagedlib_engine(tiny, store)
    records, tokens = run_engine(engine, [Arrival(name, prompt(name) + first[name], NEW_TOKENS - 1)
                                          for name in PROMPTS])
    assert {name: first[name] + tokens[name] for name in PROMPTS} == reference
    assert records[0].hits == {name: loadable_blocks(name) * BLOCK for name in PROMPTS}


def test_a_failed_load_saves_no_block_computed_over_it(vllm_store, tmp_path):
    """The step whose load fails still runs the request's new tokens, over a block it never got: a block
    those tokens complete must not be saved then. The prompt here is the prefill's plus 28 tokens, so its
    block 3 is completed in the step that loads blocks 0 to 2; with block 1 corrupt, the entry of block 3
    must hold what a clean engine computes."""
    import random

    import torch

    from pagedlib.kv_transfer.store import KVStore, block_hashes

    store_dir, first = vllm_store
    rng = random.Random(3)
    longer = prompt("mid") + first["mid"] + [rng.randrange(96) for _ in range(27)]
    assert len(longer) == 4 * BLOCK
    damaged, clean = tmp_path / "damaged", tmp_path / "clean"
    shutil.copytree(store_dir, damaged)
    keys = block_hashes(longer, BLOCK)
    entry = KVStore(damaged, **geometry()).path(keys[1])
    data = bytearray(entry.read_bytes())
    data[-100:-90] = bytes(10)
    entry.write_bytes(bytes(data))
    for folder in (damaged, clean):
        with VllmWorker() as worker:
            worker.run(dataclasses.replace(CONFIG, kv_store=str(folder)), [Arrival("q", longer, 2)])
    ours, theirs = (KVStore(folder, **geometry()).get(keys[3]) for folder in (damaged, clean))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
