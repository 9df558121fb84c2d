"""Replaying a request trace through one tier or two (notebook 13): the Mooncake traces' format, one JSON
object a line with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, one id per
block of the prompt (512 tokens in Mooncake's traces; the last block may be partly filled), equal in two
requests exactly when the block and everything before it are.

The replay is sequential, in the trace's order: a request looks its blocks up in the device tier, then the
rest in the host tier, to the first miss; it loads the host's hits into the device tier, stores the blocks
it misses, and finishes. Both tiers are ``HostCache`` s (keys only): the device tier with LRU, the order in
which vLLM's free block queue evicts (least recently freed first, a request's tail before its head)."""

from __future__ import annotations

import json
import os
import reprlib
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from pagedlib.kv_transfer.host_tier import HostCache
from pagedlib.kv_transfer.policies import POLICIES
from pagedlib.util import as_int

MOONCAKE_BLOCK_TOKENS = 512  # the block of Mooncake's traces
MOONCAKE_TRACE = Path(__file__).parent.parent / "data" / "mooncake" / "conversation_trace.jsonl"  # shipped
WRITES = ("through", "victim")


class TraceRequest(NamedTuple):
    timestamp: int  # ms
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace file or line that is not in the format."""


def parse_line(line: str, number: int, name: str = "trace") -> TraceRequest:
    """One line of a trace (``number`` counts from 1, for the error)."""
    where = f"{name}, line {number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:  # a line of [[[[...: json recurses once a level
        raise TraceError(f"{where}: not a trace record (JSON nested too deeply)") from None
    except ValueError as error:  # an integer of thousands of digits
        raise TraceError(f"{where}: not a trace record ({error})") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [key for key in TraceRequest._fields if key not in record]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    values = []
    for key in ("timestamp", "input_length", "output_length"):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {key} must be an integer >= 0, got {reprlib.repr(value)}")
        values.append(value)
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {reprlib.repr(ids)}")
    if len(set(ids)) != len(ids):
        raise TraceError(f"{where}: hash_ids repeats an id: an id names a block and its whole prefix")
    return TraceRequest(*values, tuple(ids))


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a trace file (the first ``limit``); ``TraceError`` naming the line at fault."""
    path = Path(path)
    if limit is not None:
        limit = as_int("limit", limit, minimum=1)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise TraceError(f"{path}: no such file") from None
    if stat.S_ISDIR(mode):
        raise TraceError(f"{path}: a folder, not a trace file")
    if not stat.S_ISREG(mode):  # a FIFO or a device: never opened (reading a FIFO waits for a writer)
        raise TraceError(f"{path}: not a regular file")
    requests = []
    # never blocking: a FIFO swapped in since the stat does not hang the open (and is refused)
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise TraceError(f"{path}: not a regular file")
        for number, raw in enumerate(file, 1):
            if limit is not None and len(requests) == limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise TraceError(f"{path}, line {number}: not UTF-8 text") from None
            if line.strip():
                requests.append(parse_line(line, number, str(path)))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


@dataclass
class ReplayResult:
    """What a replay found, in blocks (``block_tokens`` tokens each; a partly filled last block counts as
    one block and its own tokens)."""

    requests: int = 0
    blocks: int = 0           # blocks asked for
    device_hits: int = 0      # found in the device tier
    host_hits: int = 0        # found in the host tier after the device tier's hits
    ceiling_hits: int = 0     # an infinite cache's: every block met before
    tokens: int = 0           # prompt tokens
    saved_tokens: int = 0     # prompt tokens found (not prefilled again)
    ceiling_tokens: int = 0
    per_request: list[tuple[int, int]] = field(default_factory=list)  # (device hits, host hits) each

    def add(self, request: TraceRequest, device: int, host: int, ceiling: int, block_size: int) -> None:
        """Count one request that found ``device`` then ``host`` blocks (an infinite cache ``ceiling``)."""
        self.requests += 1
        self.blocks += len(request.hash_ids)
        self.device_hits += device
        self.host_hits += host
        self.ceiling_hits += ceiling
        self.tokens += request.input_length
        self.saved_tokens += sum(block_tokens(request, i, block_size) for i in range(device + host))
        self.ceiling_tokens += sum(block_tokens(request, i, block_size) for i in range(ceiling))
        self.per_request.append((device, host))

    @property
    def hit_rate(self) -> float:
        return (self.device_hits + self.host_hits) / max(self.blocks, 1)

    @property
    def device_hit_rate(self) -> float:
        return self.device_hits / max(self.blocks, 1)

    @property
    def host_hit_rate(self) -> float:
        return self.host_hits / max(self.blocks, 1)

    @property
    def ceiling(self) -> float:
        return self.ceiling_hits / max(self.blocks, 1)

    def summary(self) -> dict[str, float | int]:
        out = {key: value for key, value in asdict(self).items() if key != "per_request"}
        for name in ("hit_rate", "device_hit_rate", "host_hit_rate", "ceiling"):
            out[name] = round(getattr(self, name), 6)
        return out


def block_tokens(request: TraceRequest, index: int, size: int) -> int:
    """Prompt tokens in block ``index`` of ``request`` (the last may be partly filled)."""
    return max(0, min(size, request.input_length - index * size))


def replay(requests: Iterable[TraceRequest], blocks: int, host_blocks: int = 0, *, policy: str = "lru",
           write: str = "through", block_size: int = MOONCAKE_BLOCK_TOKENS,
           progress: bool = False) -> ReplayResult:
    """Replay ``requests`` in order through a device tier of ``blocks`` blocks (LRU) and, if
    ``host_blocks``, a host tier of that many (``policy``), filled ``write``-through (every block computed
    or loaded is stored there too, as vLLM's offloading connector does) or as a ``victim`` tier (blocks go
    there only when the device tier evicts them)."""
    blocks = as_int("blocks", blocks, minimum=1)
    host_blocks = as_int("host_blocks", host_blocks, minimum=0)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {tuple(POLICIES)}, got {policy!r}")
    if write not in WRITES:
        raise ValueError(f"write must be one of {WRITES}, got {write!r}")
    block_size = as_int("block_size", block_size, minimum=1)
    device = HostCache(blocks, "lru")
    host = HostCache(host_blocks, policy) if host_blocks else None
    seen: set[int] = set()
    result = ReplayResult()
    from tqdm.auto import tqdm

    requests = list(requests)
    for number, request in enumerate(tqdm(requests, disable=not progress, desc="replay", unit="req")):
        d, h = serve(number, list(request.hash_ids), device, host, write)
        ceiling = 0
        while ceiling < len(request.hash_ids) and request.hash_ids[ceiling] in seen:
            ceiling += 1
        seen.update(request.hash_ids)
        result.add(request, d, h, ceiling, block_size)
    return result


def serve(number: int, ids: list[int], device: HostCache, host: HostCache | None, write: str
          ) -> tuple[int, int]:
    """One request of a replay: the blocks it finds in the device tier, then in the host tier."""
    d = device.lookup(ids)
    h = host.lookup(ids[d:]) if host is not None else 0
    device.load(number, ids[:d])
    device.release(ids[:d])
    if host is not None and h:
        host.load(number, ids[d:d + h])
        host.release(ids[d:d + h])
    device.store(number, ids[d:])  # loaded and computed blocks land in the device tier
    if host is not None and write == "through":
        host.store(number, ids[d + h:])
    elif host is not None and device.last_evicted:  # victim: what the device tier evicted goes there
        host.store(number, device.last_evicted)
    device.finish(number)
    if host is not None:
        host.finish(number)
    return d, h

