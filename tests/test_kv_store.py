"""The KV store (notebook 14) against a hostile folder and hostile callers: keys that are not block hashes,
files that are not regular files, shard folders that are symbolic links, two engines making one store at
once, and a seeded random run of puts, gets and damage with faults injected into the writes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagedlib.kv_transfer.store import EntryError, KVStore, block_hashes

GEOMETRY = {"model": "m", "block_size": 4, "num_layers": 2, "kv_heads": 2, "head_dim": 8}
SHAPE = (2, 4, 2, 8)
BAD_KEYS = ["../../x", "../" + "a" * 61, "/" + "a" * 63, "", "A" * 64, "ab" * 31, "ab" * 33, "g" * 64,
            "a" * 64 + "\n", " " + "a" * 63, 5, None, b"a" * 64]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs, symbolic links and signals")


@contextlib.contextmanager
def no_hang(seconds: float):
    """``TimeoutError`` if the block takes longer (a FIFO opened for reading blocks until a writer comes)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s: hung")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def key_of(n: int) -> str:
    return block_hashes([n] * 4, 4)[0]


def tensors(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)


def tree(folder: Path) -> dict[str, tuple]:
    """Every path under ``folder`` (not followed through links): its kind, and a regular file's content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            content = Path(path).read_bytes() if stat.S_ISREG(mode) else os.readlink(path) \
                if stat.S_ISLNK(mode) else None
            out[os.path.relpath(path, folder)] = (stat.S_IFMT(mode), content)
    return out


@pytest.fixture
def store(tmp_path):
    return KVStore(tmp_path / "store", **GEOMETRY)


def test_an_entry_reads_back_equal(store):
    k, v = tensors(1)
    assert store.put(key_of(1), "", k, v, "test") and key_of(1) in store
    got = store.get(key_of(1))
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    assert not store.put(key_of(1), "", k, v, "test")  # the store has it


# 1: files that are not regular files are never opened
@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink", "dangling symlink"])
def test_a_manifest_that_is_not_a_regular_file_is_refused_at_once(kind, tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    manifest = root / "store.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    elif kind == "folder":
        manifest.mkdir()
    else:  # a link to a sound manifest is refused too: the store's own files are never links
        KVStore(tmp_path / "other", **GEOMETRY)
        manifest.symlink_to(tmp_path / ("other" if kind == "symlink" else "gone") / "store.json")
    with no_hang(10), pytest.raises(ValueError, match="store.json is not a regular file"):
        KVStore(root, **GEOMETRY)


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink", "device"])
def test_an_entry_that_is_not_a_regular_file_is_never_opened(kind, store, tmp_path):
    key = key_of(2)
    outside = tmp_path / "outside.safetensors"
    store.put(key, "", *tensors(2), "test")
    os.replace(store.path(key), outside)  # a sound entry, outside the store
    path = store.path(key)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "symlink":
        path.symlink_to(outside)
    else:
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null
        except PermissionError:
            pytest.skip("making a device needs root")
    with no_hang(10):
        assert key not in store
        assert "is not a regular file" in store.check_header(key)
        with pytest.raises(EntryError, match="is not a regular file"):
            store.get(key)


# 2, 3: a key is a block hash, nothing else
@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_a_key_that_is_not_a_block_hash_is_refused(key, tmp_path):
    store = KVStore(tmp_path / "a" / "b" / "store", **GEOMETRY)
    (tmp_path / "x").write_bytes(b"not an entry")  # what "../../x" would reach
    before = tree(tmp_path)
    for call in (lambda: store.put(key, "", *tensors(3), "test"), lambda: store.get(key),
                 lambda: store.check_header(key), lambda: store.path(key)):
        with pytest.raises(ValueError, match="key must be a block hash"):
            call()
    assert key not in store  # documented: a key no entry can have is simply not there
    assert tree(tmp_path) == before


# 4: K and V
def test_k_or_v_that_is_not_a_tensor_is_a_type_error_and_writes_nothing(store):
    k, v = tensors(4)
    before = tree(store.root)
    for name, args in (("k", ("not a tensor", v)), ("v", (k, [[1.0]])), ("k", (None, v))):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            store.put(key_of(4), "", *args, "test")
    with pytest.raises(TypeError, match="parent must be a string"):
        store.put(key_of(4), None, k, v, "test")
    assert tree(store.root) == before and key_of(4) not in store


def test_one_tensor_given_as_k_and_v_is_stored(store):
    k, _ = tensors(5)
    assert store.put(key_of(5), "", k, k, "test")
    got = store.get(key_of(5))
    assert torch.equal(got[0], k) and torch.equal(got[1], k)
    both = torch.stack(tensors(6))  # two halves of one storage
    assert store.put(key_of(6), "", both[0], both[1], "test")
    assert all(torch.equal(a, b) for a, b in zip(store.get(key_of(6)), both))


# 10: a shard folder that is a link is never followed
def test_a_shard_folder_that_is_a_symlink_is_never_followed(store, tmp_path):
    key = key_of(7)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (store.root / key[:2]).symlink_to(elsewhere)
    with pytest.raises(NotADirectoryError, match=f"not a plain folder.*/{key[:2]}'"):
        store.put(key, "", *tensors(7), "test")
    assert list(elsewhere.iterdir()) == []
    # an entry planted through the link is not the store's: absent to `in`, an EntryError to get
    KVStore(tmp_path / "planted", **GEOMETRY).put(key, "", *tensors(7), "test")
    os.replace(KVStore(tmp_path / "planted", **GEOMETRY).path(key), elsewhere / f"{key}.safetensors")
    assert key not in store
    assert "not a plain folder" in store.check_header(key)
    with pytest.raises(EntryError, match="not a plain folder"):
        store.get(key)


# check_header without assert; header_digest on garbage
def header_entry(store: KVStore, key: str, meta: object) -> bytes:
    """An entry of ``key`` whose header's ``__metadata__`` is ``meta``."""
    k, v = tensors(8)
    n = k.numel() * 4
    header = json.dumps({"__metadata__": meta, "k": {"dtype": "F32", "shape": list(SHAPE),
                                                     "data_offsets": [0, n]},
                         "v": {"dtype": "F32", "shape": list(SHAPE), "data_offsets": [n, 2 * n]}}).encode()
    data = struct.pack("<Q", len(header)) + header + k.numpy().tobytes() + v.numpy().tobytes()
    store.path(key).parent.mkdir(exist_ok=True)
    store.path(key).write_bytes(data)
    return data


def test_check_header_refuses_metadata_that_is_not_a_dict_even_under_python_O(store):
    key = key_of(8)
    header_entry(store, key, ["format", "pagedlib-kv/1"])
    assert "is corrupt" in store.check_header(key)
    with pytest.raises(EntryError, match="is corrupt"):
        store.get(key)
    script = textwrap.dedent(f"""
        from pagedlib.kv_transfer.store import KVStore
        store = KVStore({str(store.root)!r}, **{GEOMETRY!r})
        print(store.check_header({key!r}))
    """)
    done = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "is corrupt" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("data", [b"", b"\x01", b"garbage!garbage", struct.pack("<Q", 1 << 40) + b"{}",
                                  struct.pack("<Q", 5) + b"[1,2]", struct.pack("<Q", 2) + b"{}",
                                  struct.pack("<Q", 4000) + b"[" * 4000,
                                  struct.pack("<Q", 30) + b'{"__metadata__": {"sha256": 1}}'])
def test_header_digest_of_garbage_is_none(data):
    assert KVStore.header_digest(data) is None


def test_a_deeply_nested_header_is_corrupt_not_a_recursion_error(store):
    key = key_of(9)
    store.path(key).parent.mkdir(exist_ok=True)
    store.path(key).write_bytes(struct.pack("<Q", 100_000) + b"[" * 100_000)
    assert "is corrupt" in store.check_header(key)
    with pytest.raises(EntryError, match="is corrupt"):
        store.get(key)


# 5: two engines making one store for two geometries at once
WORKER = textwrap.dedent("""
    import sys, time
    from pagedlib.kv_transfer.store import KVStore
    head_dim = int(sys.argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        root, start = line.split()
        while time.time() < float(start):
            pass
        try:
            KVStore(root, model="m", block_size=4, num_layers=2, kv_heads=2, head_dim=head_dim)
            print("made", flush=True)
        except ValueError as error:
            print("refused" if "another model or layout" in str(error) else f"error {error}", flush=True)
""")


def test_two_engines_making_one_store_at_once_agree_on_one_geometry(tmp_path):
    """Two processes make a store in the same new folder, for two geometries, at the same instant (each
    spins to a start time): every round, exactly one is made and the other refused, and the manifest is the
    one that was made."""
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(head_dim)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for head_dim in (8, 16)]
    try:
        assert [w.stdout.readline().strip() for w in workers] == ["ready", "ready"]
        for round_ in range(60):
            root = tmp_path / f"store{round_}"
            start = time.time() + 0.02
            for w in workers:
                w.stdin.write(f"{root} {start}\n")
                w.stdin.flush()
            answers = [w.stdout.readline().strip() for w in workers]
            assert sorted(answers) == ["made", "refused"], (round_, answers)
            made = json.loads((root / "store.json").read_text())["head_dim"]
            assert made == (8, 16)[answers.index("made")]
            assert [p.name for p in root.iterdir()] == ["store.json"]  # no temporary file left
    finally:
        for w in workers:
            w.stdin.close()
            w.wait(timeout=30)


def test_a_file_system_without_hard_links_still_makes_the_manifest_exclusively(tmp_path, monkeypatch):
    def no_links(*_):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    KVStore(tmp_path / "s", **GEOMETRY)
    assert json.loads((tmp_path / "s" / "store.json").read_text())["head_dim"] == 8
    assert [p.name for p in (tmp_path / "s").iterdir()] == ["store.json"]
    with pytest.raises(ValueError, match="another model or layout"):
        KVStore(tmp_path / "s", **{**GEOMETRY, "head_dim": 16})
