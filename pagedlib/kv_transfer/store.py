"""A store of KV blocks in files (notebook 14): what one engine computes, another loads.

One entry per full block, a ``safetensors`` file named by the block's **chained hash**: SHA-256 over the
parent block's hash and the block's token ids (as little-endian int64), so any engine that knows the token
ids, pagedlib's or vLLM's, finds the same entries. An entry holds K and V of every layer in one neutral
layout, ``[num_layers, block_size, kv_heads, head_dim]`` (pagedlib's block), and says in its metadata the
model, the geometry and who wrote it (for vLLM, the CPU kernels' ISA it read the block through).

The store's folder has a manifest, ``store.json``, fixed when the store is made: a store opened for another
model or another geometry is refused before anything is written. Entries are written to a temporary file
and renamed into place (``os.replace``), so a reader never sees half of one; a bad entry (missing,
truncated, corrupt, written for another model) raises ``EntryError`` naming what is wrong.

Nothing in the folder is trusted: a key is exactly what ``block_hashes`` makes (64 lowercase hex digits),
so no key names a path outside the folder; only regular files are opened (never a FIFO, a device or a
symbolic link), and only in shard folders that are plain folders (not symbolic links), so nothing is read
or written outside the store. The manifest is created exclusively (linked into place), so of two engines
making the same new store for different geometries exactly one wins."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import reprlib
import secrets
import stat
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedlib.core.prefix_cache import chained_keys

FORMAT = "pagedlib-kv/1"
GEOMETRY = ("model", "block_size", "num_layers", "kv_heads", "head_dim", "dtype")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MANIFEST = "store.json"
MANIFEST_BYTES = 1 << 16   # a manifest is a few hundred bytes: a bigger one is not read
HEADER_BYTES = 1 << 20     # an entry's header is well under 1 KiB: a bigger one is corrupt
KEY = re.compile(r"[0-9a-f]{64}")  # what block_hashes makes: SHA-256 in lowercase hex
# read-only and never blocking: a FIFO swapped in after the check does not hang the open; no symbolic link
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)


class EntryError(Exception):
    """An entry that cannot be used: ``key`` and ``reason`` say which and why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"entry {key[:12]}...: {reason}")
        self.key = key
        self.reason = reason


def is_key(key: object) -> bool:
    """Whether ``key`` is a store key: a block hash as ``block_hashes`` makes it (64 lowercase hex digits)."""
    return isinstance(key, str) and KEY.fullmatch(key) is not None


def check_key(key: object, name: str = "key") -> str:
    """``key`` if it is a store key, else ``ValueError`` naming ``name``: a key names a file, so nothing
    else (``..``, a slash, an empty string, uppercase) is ever let near a path."""
    if not is_key(key):
        raise ValueError(f"{name} must be a block hash (64 lowercase hex digits, as block_hashes makes), got "
                         f"{reprlib.repr(key)} ({type(key).__name__})")
    return key  # type: ignore[return-value]


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words."""
    for test, name in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISREG, "regular file")):
        if test(mode):
            return name
    return "special file"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def block_hashes(token_ids: Sequence[int], block_size: int, n: int | None = None) -> list[str]:
    """The chained hashes (hex) of the first ``n`` full blocks of ``token_ids`` (default: every full one):
    the digests of their ``BlockKey``s (``core.prefix_cache``), the prefix cache's keys."""
    return [key.digest for key in chained_keys(token_ids, block_size, n)]


def model_fingerprint(folder: str | Path) -> str:
    """A model folder's name for the store: SHA-256 (first 16 hex digits) of its ``config.json`` and weight
    files, so two engines loading the same folder agree and another model's entries are told apart."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class KVStore:
    """Entries under ``root`` for one model and one geometry (``block_size``, ``num_layers``, ``kv_heads``,
    ``head_dim``, ``dtype``). Counts what it read and wrote (``stats()``)."""

    def __init__(self, root: str | Path, *, model: str, block_size: int, num_layers: int, kv_heads: int,
                 head_dim: int, dtype: str | torch.dtype = "float32") -> None:
        from pagedlib.util import as_int

        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string naming the model, got {model!r}")
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r} (an fp8 cache is not "
                             f"stored)")
        self.geometry = {"model": model, "block_size": as_int("block_size", block_size, minimum=1),
                         "num_layers": as_int("num_layers", num_layers, minimum=1),
                         "kv_heads": as_int("kv_heads", kv_heads, minimum=1),
                         "head_dim": as_int("head_dim", head_dim, minimum=1), "dtype": dtype}
        self.root = Path(root)
        self.block_size = self.geometry["block_size"]
        self.shape = (num_layers, block_size, kv_heads, head_dim)
        self.dtype = DTYPES[dtype]
        self._open()
        self.read_entries = 0
        self.written_entries = 0
        self.bytes_read = 0
        self.bytes_written = 0

    def _open(self) -> None:
        """Check the manifest against this store's geometry, or create it: ``ValueError`` before anything is
        written if ``root`` is not a folder, its manifest is not a regular file, or it is another model's
        store. Created exclusively (written aside, then linked into place: a link fails if the name
        exists), so of two engines creating the same store at once the second compares with the first."""
        root, manifest = self.root, self.root / MANIFEST
        if root.exists() and not root.is_dir():
            raise ValueError(f"root={str(root)!r} is a file, not a folder")
        theirs = self._read_manifest(manifest)
        if theirs is None:
            root.mkdir(parents=True, exist_ok=True)
            if self._create_manifest(manifest):
                return
            theirs = self._read_manifest(manifest)  # another engine's, made since we looked
            if theirs is None:
                raise ValueError(f"{manifest} vanished while this store was being made")
        if not isinstance(theirs, dict) or theirs.get("format") != FORMAT:
            raise ValueError(f"{manifest} is not a {FORMAT} manifest")
        wrong = {name: (value, theirs.get(name)) for name, value in self.geometry.items()
                 if theirs.get(name) != value}
        if wrong:
            raise ValueError(f"root={str(root)!r} is a store for another model or layout: (this "
                             f"engine, the store) differ in {wrong}")

    @staticmethod
    def _read_manifest(manifest: Path) -> object:
        """The manifest's JSON, ``None`` if there is none; ``ValueError`` for anything but a regular file
        of JSON (a FIFO, a device or a symbolic link is never opened)."""
        try:
            mode = os.lstat(manifest).st_mode
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ValueError(f"{manifest} is not a store manifest ({error.strerror or error})") from None
        if not stat.S_ISREG(mode):
            raise ValueError(f"{manifest} is not a regular file (a {_kind(mode)}), not a store manifest")
        try:
            fd = os.open(manifest, READ_FLAGS)
            with os.fdopen(fd, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                text = f.read(MANIFEST_BYTES + 1) if stat.S_ISREG(mode) else b""
        except OSError as error:
            raise ValueError(f"{manifest} is not a store manifest ({error.strerror or error})") from None
        if not stat.S_ISREG(mode):  # swapped in since the lstat
            raise ValueError(f"{manifest} is not a regular file (a {_kind(mode)}), not a store manifest")
        if len(text) > MANIFEST_BYTES:
            raise ValueError(f"{manifest} is not a store manifest (over {MANIFEST_BYTES} bytes)")
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as error:
            raise ValueError(f"{manifest} is not a store manifest ({error})") from None

    def _create_manifest(self, manifest: Path) -> bool:
        """Write this store's manifest unless one exists: ``True`` if this call made it."""
        data = json.dumps({"format": FORMAT, **self.geometry}, indent=1).encode()
        fd, tmp = tempfile.mkstemp(dir=manifest.parent, prefix=f".{manifest.name}.", suffix=".tmp")
        try:
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            try:
                os.link(tmp, manifest)  # whole or not at all, and never over another's
            except FileExistsError:
                raise
            except OSError as error:  # a file system without hard links: created exclusively in place
                if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                fd = os.open(manifest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                             0o600)
                try:
                    _write_all(fd, data)
                finally:
                    os.close(fd)
            return True
        except FileExistsError:
            return False
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def path(self, key: str) -> Path:
        """Where the entry of ``key`` is (``ValueError`` if ``key`` is not a block hash)."""
        key = check_key(key)
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: object) -> bool:
        """Whether the store has a regular file for ``key`` (its header unchecked: ``check_header``).
        ``False`` for a key that is not a block hash (no entry has that name), for an entry that is not a
        regular file and for one whose shard folder is not a plain folder (a symbolic link): neither is
        ever read."""
        if not is_key(key):
            return False
        shard = self.root / key[:2]  # type: ignore[index]
        try:
            if not stat.S_ISDIR(os.lstat(shard).st_mode):
                return False
            return stat.S_ISREG(os.lstat(shard / f"{key}.safetensors").st_mode)
        except OSError:
            return False

    def metadata(self, key: str, written_by: str, parent: str, digest: str) -> dict[str, str]:
        return {"format": FORMAT, **{name: str(value) for name, value in self.geometry.items()},
                "key": key, "parent": parent, "written_by": written_by, "sha256": digest}

    def put(self, key: str, parent: str, k: torch.Tensor, v: torch.Tensor, written_by: str) -> bool:
        """Write the entry of block ``key`` (``k``, ``v``: ``[num_layers, block_size, kv_heads, head_dim]``)
        unless the store has it: ``True`` if written. Atomic: a temporary file renamed into place, removed
        again if the write fails. ``ValueError`` for a key that is not a block hash, ``TypeError`` for K or
        V that is not a tensor (nothing written); ``NotADirectoryError`` naming the shard folder if it is
        not a plain folder in the store (a symbolic link: nothing is written through it)."""
        from safetensors.torch import save

        key = check_key(key)
        for name, value in (("parent", parent), ("written_by", written_by)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a string, got {type(value).__name__}")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if key in self:
            return False
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != self.shape or t.dtype != self.dtype:
                raise ValueError(f"{name} must be {self.dtype} {list(self.shape)}, got {t.dtype} "
                                 f"{list(t.shape)}")
        k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        if k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr():
            v = v.clone()  # one tensor given as both (safetensors refuses to save shared memory)
        data = save({"k": k, "v": v}, metadata=self.metadata(key, written_by, parent, _digest(k, v)))
        shard = self._shard(key, create=True)
        try:
            self._write_atomic(shard, self.path(key), data)
        finally:
            os.close(shard)
        self.written_entries += 1
        self.bytes_written += len(data)
        return True

    def _shard(self, key: str, create: bool = False) -> int:
        """The shard folder of ``key`` opened (a descriptor, to open and rename in it): not the root, so a
        store whose folder vanished stays gone. ``NotADirectoryError`` naming it if it is not a plain folder
        (a symbolic link is not followed); ``FileNotFoundError`` if it is missing."""
        shard = self.root / key[:2]
        if create:
            try:
                os.mkdir(shard)
            except FileExistsError:
                pass
        try:
            return os.open(shard, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as error:
            if error.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
        try:
            kind = _kind(os.lstat(shard).st_mode)
        except OSError:
            kind = "file that changed"
        raise NotADirectoryError(errno.ENOTDIR, f"not a plain folder in the store (a {kind})", str(shard))

    @staticmethod
    def _write_atomic(folder: int, path: Path, data: bytes) -> None:
        """``data`` as ``path`` in the open ``folder`` (its folder, checked), written aside and renamed into
        place; the temporary file is removed again if anything fails."""
        tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600,
                     dir_fd=folder)
        try:
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(path.parent / tmp, path)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=folder)
            except OSError:
                pass
            raise

    def _open_entry(self, key: str) -> int:
        """The entry of ``key`` opened for reading: ``EntryError`` if it is not a regular file or its shard
        is not a plain folder (neither is opened), ``OSError`` if it cannot be read (missing)."""
        try:
            shard = self._shard(key)
        except NotADirectoryError as error:
            raise EntryError(key, f"is in a shard folder that is {error.strerror} ({error.filename}): not "
                                  f"read") from None
        try:
            name = f"{key}.safetensors"
            mode = os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                try:
                    fd = os.open(name, READ_FLAGS, dir_fd=shard)
                except OSError as error:
                    if error.errno != errno.ELOOP:  # a symbolic link swapped in since the stat
                        raise
                    mode = stat.S_IFLNK
                else:
                    mode = os.fstat(fd).st_mode
                    if not stat.S_ISREG(mode):  # swapped in since the stat
                        os.close(fd)
        finally:
            os.close(shard)
        if not stat.S_ISREG(mode):
            raise EntryError(key, f"is not a regular file (a {_kind(mode)})")
        return fd

    @property
    def entry_bytes(self) -> int:
        """The most bytes an entry of this store can have (a larger file is not read)."""
        numel = self.shape[0] * self.shape[1] * self.shape[2] * self.shape[3]
        return 8 + HEADER_BYTES + 2 * numel * self.dtype.itemsize

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of block ``key``, checked: ``EntryError`` if the entry is missing, unreadable, not a
        regular file (never opened), in a shard folder that is not a plain folder, or written for another
        model, geometry or block; ``ValueError`` if ``key`` is not a block hash."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        key = check_key(key)
        try:
            with os.fdopen(self._open_entry(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.entry_bytes:
                    raise EntryError(key, f"is corrupt ({size} bytes, over an entry's {self.entry_bytes})")
                data = f.read(self.entry_bytes + 1)
        except OSError as error:
            raise EntryError(key, f"cannot be read ({type(error).__name__}: {error.strerror or error})"
                             ) from None
        reason = self.check_header(key, data)
        if reason:
            raise EntryError(key, reason)
        try:
            tensors = load(data)
        except (SafetensorError, ValueError, RuntimeError, TypeError, KeyError, OverflowError) as error:
            raise EntryError(key, f"is corrupt ({error})") from None
        k, v = tensors.get("k"), tensors.get("v")
        for name, t in (("k", k), ("v", v)):
            if t is None or tuple(t.shape) != self.shape or t.dtype != self.dtype:
                raise EntryError(key, f"holds no {self.dtype} {list(self.shape)} tensor {name!r}")
        if _digest(k, v) != self.header_digest(data):
            raise EntryError(key, "is corrupt (its K/V do not match their SHA-256)")
        self.read_entries += 1
        self.bytes_read += len(data)
        return k, v

    def check_header(self, key: str, data: bytes | None = None) -> str | None:
        """Why the entry of ``key`` cannot be used, from its header alone (``None``: it looks right): an
        entry that is not a regular file, or in a shard folder that is not a plain folder, is never opened.
        Reads the whole file only if ``data`` is given. ``ValueError`` if ``key`` is not a block hash."""
        key = check_key(key)
        try:
            size, body, total = self._head(key, data)
        except EntryError as error:
            return error.reason
        except OSError as error:
            return f"cannot be read ({type(error).__name__}: {error.strerror or error})"
        corrupt = "is corrupt (its header is not a safetensors header of k and v)"
        if size is not None and size > HEADER_BYTES:
            return "is corrupt (it does not start with a safetensors header)"
        if size is None or size > len(body):
            return "is truncated (its header is cut off)"
        try:
            header = json.loads(body)
        except (ValueError, RecursionError):
            return corrupt
        if not isinstance(header, dict) or not all(isinstance(header.get(name), dict) for name in ("k", "v")):
            return corrupt
        meta = header.get("__metadata__", {})
        if not isinstance(meta, dict):
            return corrupt
        try:
            end = max(int(header[name]["data_offsets"][1]) for name in ("k", "v"))
        except (KeyError, TypeError, ValueError, IndexError, OverflowError):
            return corrupt
        if 8 + size + end > total:
            return f"is truncated ({total} bytes of {8 + size + end})"
        if meta.get("format") != FORMAT:
            return f"is not a {FORMAT} entry"
        if meta.get("key") != key:
            return f"holds block {reprlib.repr(meta.get('key'))[:16]}..., not this one"
        wrong = {name: meta.get(name) for name, value in self.geometry.items()
                 if meta.get(name) != str(value)}
        if wrong:
            return f"was written for another model or layout: {reprlib.repr(wrong)}"
        return None

    def _head(self, key: str, data: bytes | None) -> tuple[int | None, bytes, int]:
        """An entry's header length (``None``: cut off), the header's bytes (1 MiB at most), its size."""
        if data is None:
            with os.fdopen(self._open_entry(key), "rb") as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                body = f.read(min(size, HEADER_BYTES)) if size is not None else b""
                return size, body, os.fstat(f.fileno()).st_size
        size = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else None
        body = data[8:8 + min(size, HEADER_BYTES)] if size is not None else b""
        return size, body, len(data)

    @staticmethod
    def header_digest(data: bytes) -> str | None:
        """The SHA-256 an entry's metadata gives for its K and V (``None``: none, or no sound header)."""
        try:
            size = struct.unpack("<Q", data[:8])[0]
            if size > HEADER_BYTES or 8 + size > len(data):
                return None
            meta = json.loads(data[8:8 + size]).get("__metadata__", {})
            digest = meta.get("sha256") if isinstance(meta, dict) else None
        except (struct.error, ValueError, RecursionError, AttributeError, TypeError):
            return None
        return digest if isinstance(digest, str) else None

    def stats(self) -> dict[str, int]:
        return {"read_entries": self.read_entries, "written_entries": self.written_entries,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}


def _digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """SHA-256 of K's then V's bytes: safetensors checks shapes, not contents."""
    digest = hashlib.sha256()
    for t in (k, v):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
