"""The KV store (notebook 14) against a hostile folder and hostile callers: keys that are not block hashes,
files that are not regular files, shard folders that are symbolic links, two engines making one store at
once, and a seeded random run of puts, gets and damage with faults injected into the writes."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
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


# the seeded random fault run
class Faults:
    """``os.replace`` and ``os.write`` that fail while ``armed`` (a write after writing half its bytes, as a
    full disk does), on files under ``root`` only."""

    def __init__(self, monkeypatch, root: Path) -> None:
        self.armed = None
        self.root = str(root)
        self.replace, self.write = os.replace, os.write
        monkeypatch.setattr(os, "replace", self.fake_replace)
        monkeypatch.setattr(os, "write", self.fake_write)

    def fake_replace(self, *args, **kwargs):
        if self.armed == "replace":
            raise OSError(errno.EIO, "injected: rename failed")
        return self.replace(*args, **kwargs)

    def fake_write(self, fd, data):
        if self.armed == "write" and os.readlink(f"/proc/self/fd/{fd}").startswith(self.root):
            self.write(fd, bytes(data[:len(data) // 2]))
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return self.write(fd, data)


DAMAGE = ["truncate", "garble", "swap", "folder", "fifo", "symlink out", "shard symlink", "empty", "remove",
          "remove"]  # a damaged regular file is never written over: removing one lets the run write it again


def damage(rng: random.Random, store: KVStore, keys: list[str], outside: Path, planted: set) -> None:
    """Damage one entry (or its shard folder) on disk, as a hostile user or a failing disk would."""
    key = rng.choice(keys)
    path = store.path(key)
    kind = rng.choice(DAMAGE)
    shard = path.parent
    if kind == "shard symlink":
        if shard.is_symlink():
            shard.unlink()
            planted.discard(str(shard))
        elif shard.is_dir():
            for child in shard.iterdir():  # out of the way: the store's folders hold nothing else
                child.unlink() if not child.is_dir() or child.is_symlink() else child.rmdir()
            shard.rmdir()
            shard.symlink_to(outside / "shard")
            planted.add(str(shard))
        return
    if not shard.is_dir() or shard.is_symlink():
        return
    if path.is_symlink() or (path.exists() and not path.is_file()):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        planted.discard(str(path))
        return
    if kind == "remove" and path.is_file():
        path.unlink()
    elif kind in ("truncate", "garble", "empty") and path.is_file():
        data = bytearray(path.read_bytes())
        if kind == "truncate" and data:
            data = data[:rng.randrange(len(data))]
        elif kind == "garble" and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data) if kind != "empty" else b"")
    elif kind == "swap":
        other = store.path(rng.choice(keys))
        if path.is_file() and other.is_file() and other != path and not other.parent.is_symlink():
            tmp = path.with_suffix(".swap")
            os.rename(path, tmp)
            os.rename(other, path)
            os.rename(tmp, other)
    elif kind == "folder" and not path.exists():
        path.mkdir()
    elif kind == "fifo" and not path.exists():
        os.mkfifo(path)
    elif kind == "symlink out" and not path.exists():
        path.symlink_to(outside / "entry.safetensors")  # a sound entry of keys[0], outside the store
        planted.add(str(path))


def check_tree(store: KVStore, parent: Path, outside_before: dict, planted: set) -> None:
    """Nothing outside the root changed; inside, every path the store made is inside it, no temporary
    file is left, and the only links are the ones the run planted."""
    assert tree(parent / "outside") == outside_before
    assert sorted(p.name for p in parent.iterdir()) == ["outside", "store"]
    root = os.path.realpath(store.root)
    for dirpath, dirnames, filenames in os.walk(store.root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            assert not name.endswith(".tmp"), f"a temporary file left behind: {path}"
            if os.path.islink(path):
                assert path in planted, f"a link the store made: {path}"
            else:
                assert os.path.realpath(path).startswith(root + os.sep)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_puts_gets_and_damage_with_faults_keep_the_store_sound(seed, tmp_path, monkeypatch):
    rng = random.Random(seed)
    parent = tmp_path / "parent"
    outside = parent / "outside"
    (outside / "shard").mkdir(parents=True)
    (outside / "secret").write_text("do not touch")
    store = KVStore(parent / "store", **GEOMETRY)
    keys = [key_of(n) for n in range(10)]
    keys += [block_hashes([n, 1, 2, 3], 4)[0] for n in range(40) if block_hashes([n, 1, 2, 3], 4)[0][:2]
             == keys[0][:2]][:2]  # two more in the first key's shard folder
    truth = {key: tensors(n) for n, key in enumerate(keys)}
    KVStore(tmp_path / "scratch", **GEOMETRY).put(keys[0], "", *truth[keys[0]], "test")
    (KVStore(tmp_path / "scratch", **GEOMETRY).path(keys[0])).rename(outside / "entry.safetensors")
    outside_before = tree(outside)
    faults = Faults(monkeypatch, store.root)
    planted: set[str] = set()
    foreign = ["../x", "../../outside/secret", "a" * 63, "A" * 64, "", keys[0].upper(), keys[0] + "0"]
    counts = {"put": 0, "written": 0, "get": 0, "got": 0, "damage": 0, "fault": 0}
    with no_hang(60):
        for _ in range(1500):
            op = rng.choices(["put", "get", "in", "header", "damage", "foreign"], [5, 5, 2, 2, 3, 1])[0]
            key = rng.choice(keys)
            if op == "put":
                counts["put"] += 1
                faults.armed = rng.choice([None, None, None, "replace", "write"])
                counts["fault"] += faults.armed is not None
                try:
                    written = store.put(key, "", *truth[key], "test")
                except OSError:
                    written = False  # a failed write, a folder in the entry's place or a linked shard
                finally:
                    faults.armed = None
                if written:
                    counts["written"] += 1
                    got = store.get(key)  # nothing damaged it since
                    assert all(torch.equal(a, b) for a, b in zip(got, truth[key]))
            elif op == "get":
                counts["get"] += 1
                try:
                    got = store.get(key)
                except EntryError:
                    pass
                else:
                    counts["got"] += 1
                    assert all(torch.equal(a, b) for a, b in zip(got, truth[key]))
                    path = store.path(key)  # read from a regular file in a plain folder, never through a link
                    assert stat.S_ISREG(os.lstat(path).st_mode)
                    assert stat.S_ISDIR(os.lstat(path.parent).st_mode)
            elif op == "in":
                path = store.path(key)
                regular = path.parent.is_dir() and not path.parent.is_symlink() and path.is_file() \
                    and not path.is_symlink()
                assert (key in store) == regular
            elif op == "header":
                assert store.check_header(key) is None or isinstance(store.check_header(key), str)
            elif op == "damage":
                counts["damage"] += 1
                damage(rng, store, keys, outside, planted)
            else:
                bad = rng.choice(foreign)
                assert bad not in store
                for call, args in ((store.put, (bad, "", *truth[key], "test")), (store.get, (bad,)),
                                   (store.check_header, (bad,))):
                    with pytest.raises(ValueError, match="key"):
                        call(*args)
            check_tree(store, parent, outside_before, planted)
    assert min(counts.values()) > 0, counts  # every kind of step happened
