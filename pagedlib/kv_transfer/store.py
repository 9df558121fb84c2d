"""A store of KV blocks in files (notebook 14): what one engine computes, another loads.

One entry per full block, a ``safetensors`` file named by the block's **chained hash**: SHA-256 over the
parent block's hash and the block's token ids (as little-endian int64), so any engine that knows the token
ids, pagedlib's or vLLM's, finds the same entries. An entry holds K and V of every layer in one neutral
layout, ``[num_layers, block_size, kv_heads, head_dim]`` (pagedlib's block), and says in its metadata the
model, the geometry and who wrote it (for vLLM, the CPU kernels' ISA it read the block through).

The store's folder has a manifest, ``store.json``, fixed when the store is made: a store opened for another
model or another geometry is refused before anything is written. Entries are written to a temporary file
and renamed into place (``os.replace``), so a reader never sees half of one; a bad entry (missing,
truncated, corrupt, written for another model) raises ``EntryError`` naming what is wrong."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedlib.core.prefix_cache import chained_keys

FORMAT = "pagedlib-kv/1"
GEOMETRY = ("model", "block_size", "num_layers", "kv_heads", "head_dim", "dtype")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class EntryError(Exception):
    """An entry that cannot be used: ``key`` and ``reason`` say which and why."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"entry {key[:12]}...: {reason}")
        self.key = key
        self.reason = reason


def block_hashes(token_ids: Sequence[int], block_size: int, n: int | None = None) -> list[str]:
    """The chained hashes (hex) of the first ``n`` full blocks of ``token_ids`` (default: every full one)."""
    return list(chained_keys(token_ids, block_size, n, _link))


def _link(parent: str | None, block: tuple[int, ...]) -> str:
    """A block's hash: SHA-256 of its parent's digest (none for the first) and its token ids."""
    head = bytes.fromhex(parent) if parent else b""
    return hashlib.sha256(head + struct.pack(f"<{len(block)}q", *block)).hexdigest()


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
        """Check the manifest against this store's geometry, or write it: ``ValueError`` before anything is
        written if ``root`` is not a folder or is another model's store."""
        root, manifest = self.root, self.root / "store.json"
        if root.exists() and not root.is_dir():
            raise ValueError(f"root={str(root)!r} is a file, not a folder")
        if manifest.exists():
            try:
                theirs = json.loads(manifest.read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"{manifest} is not a store manifest ({error})") from None
            if not isinstance(theirs, dict) or theirs.get("format") != FORMAT:
                raise ValueError(f"{manifest} is not a {FORMAT} manifest")
            wrong = {name: (value, theirs.get(name)) for name, value in self.geometry.items()
                     if theirs.get(name) != value}
            if wrong:
                raise ValueError(f"root={str(root)!r} is a store for another model or layout: (this "
                                 f"engine, the store) differ in {wrong}")
            return
        root.mkdir(parents=True, exist_ok=True)
        self._write_atomic(manifest, json.dumps({"format": FORMAT, **self.geometry}, indent=1).encode())

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def metadata(self, key: str, written_by: str, parent: str, digest: str) -> dict[str, str]:
        return {"format": FORMAT, **{name: str(value) for name, value in self.geometry.items()},
                "key": key, "parent": parent, "written_by": written_by, "sha256": digest}

    def put(self, key: str, parent: str, k: torch.Tensor, v: torch.Tensor, written_by: str) -> bool:
        """Write the entry of block ``key`` (``k``, ``v``: ``[num_layers, block_size, kv_heads, head_dim]``)
        unless the store has it: ``True`` if written. Atomic: a temporary file renamed into place."""
        from safetensors.torch import save

        if key in self:
            return False
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != self.shape or t.dtype != self.dtype:
                raise ValueError(f"{name} must be {self.dtype} {list(self.shape)}, got {t.dtype} "
                                 f"{list(t.shape)}")
        k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        data = save({"k": k, "v": v}, metadata=self.metadata(key, written_by, parent, _digest(k, v)))
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)  # not the root: a store whose folder vanished stays gone
        self._write_atomic(path, data)
        self.written_entries += 1
        self.bytes_written += len(data)
        return True

    def _write_atomic(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of block ``key``, checked: ``EntryError`` if the entry is missing, unreadable, or written
        for another model, geometry or block."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            data = self.path(key).read_bytes()
        except OSError as error:
            raise EntryError(key, f"cannot be read ({type(error).__name__}: {error.strerror or error})"
                             ) from None
        reason = self.check_header(key, data)
        if reason:
            raise EntryError(key, reason)
        try:
            tensors = load(data)
        except (SafetensorError, ValueError, RuntimeError) as error:
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
        """Why the entry of ``key`` cannot be used, from its header alone (``None``: it looks right).
        Reads the whole file only if ``data`` is given."""
        try:
            size, body, total = self._head(key, data)
        except OSError as error:
            return f"cannot be read ({type(error).__name__}: {error.strerror or error})"
        if size is not None and size > 1 << 20:
            return "is corrupt (it does not start with a safetensors header)"
        if size is None or size > len(body):
            return "is truncated (its header is cut off)"
        try:
            header = json.loads(body)
            meta = header.get("__metadata__", {})
            tensors = [header[name] for name in ("k", "v")]
            assert isinstance(meta, dict)
        except (ValueError, KeyError, AttributeError, TypeError, AssertionError):
            return "is corrupt (its header is not a safetensors header of k and v)"
        try:
            end = max(int(t["data_offsets"][1]) for t in tensors)
        except (KeyError, TypeError, ValueError, IndexError):
            return "is corrupt (its header is not a safetensors header of k and v)"
        if 8 + size + end > total:
            return f"is truncated ({total} bytes of {8 + size + end})"
        if meta.get("format") != FORMAT:
            return f"is not a {FORMAT} entry"
        if meta.get("key") != key:
            return f"holds block {str(meta.get('key'))[:12]}..., not this one"
        wrong = {name: meta.get(name) for name, value in self.geometry.items()
                 if meta.get(name) != str(value)}
        if wrong:
            return f"was written for another model or layout: {wrong}"
        return None

    def _head(self, key: str, data: bytes | None) -> tuple[int | None, bytes, int]:
        """An entry's header length (``None``: cut off), the header's bytes (1 MiB at most), its size."""
        if data is None:
            with open(self.path(key), "rb") as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
                body = f.read(min(size, 1 << 20)) if size is not None else b""
                return size, body, os.fstat(f.fileno()).st_size
        size = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else None
        body = data[8:8 + min(size, 1 << 20)] if size is not None else b""
        return size, body, len(data)

    @staticmethod
    def header_digest(data: bytes) -> str | None:
        size = struct.unpack("<Q", data[:8])[0]
        return json.loads(data[8:8 + size]).get("__metadata__", {}).get("sha256")

    def stats(self) -> dict[str, int]:
        return {"read_entries": self.read_entries, "written_entries": self.written_entries,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}


def _digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """SHA-256 of K's then V's bytes: safetensors checks shapes, not contents."""
    digest = hashlib.sha256()
    for t in (k, v):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
