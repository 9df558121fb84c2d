"""Prefill on one engine, decode on another (notebook 14), through a ``KVStore`` both can reach.

The prefill engine runs each prompt and samples its first token, saving every full block as it fills
(``StoreConnector``, role ``"producer"``). A proxy hands the decode engine each prompt with that first
token appended (vLLM's disaggregated setups do the same); the decode engine, in another process, finds the
prompt's full blocks in the store at admission, loads them instead of computing them, computes the rest
(at least the last token, whose logits it needs) and continues. The tokens equal one engine's.

``decode_in_child`` runs the decode engine in a child process (``python -m pagedlib.disagg``, one JSON job
and its answer, started and guarded by ``pagedlib.child.run_child``: a timeout, the child's stderr quoted
if it fails) on the course's tiny model."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedlib.child import ChildError, run_child, serve
from pagedlib.kv_transfer.connectors import StoreConnector
from pagedlib.kv_transfer.store import KVStore, model_fingerprint


def tiny_store(root: str | Path, block_size: int = 32) -> KVStore:
    """The store for the course's tiny model (``pagedlib/data/tiny_char_llama``), as both engines open it."""
    from pagedlib.teach.train_tiny import TINY_DIR

    config = json.loads((TINY_DIR / "config.json").read_text())
    heads = config["num_attention_heads"]
    return KVStore(root, model=model_fingerprint(TINY_DIR), block_size=block_size,
                   num_layers=config["num_hidden_layers"], kv_heads=config["num_key_value_heads"],
                   head_dim=config["hidden_size"] // heads, dtype="float32")


def handoff(prompts: Sequence[Sequence[int]], first: Sequence[Sequence[int]]) -> list[list[int]]:
    """What the proxy sends the decode engine: each prompt with the prefill's first token after it."""
    if len(prompts) != len(first):
        raise ValueError(f"{len(prompts)} prompts but {len(first)} first tokens")
    return [list(prompt) + list(token) for prompt, token in zip(prompts, first)]


@dataclass
class Decoded:
    """An engine's run with a connector: per request its tokens, the tokens it found at admission (prefix
    cache and store, whole blocks), the tokens it computed, and the connector's counters. Then its timing
    (``time.perf_counter``, notebook 14's section 6): per request the step that produced each of its tokens
    (``token_steps``), and per step its wall-clock seconds (loads and saves included), the seconds of them
    spent loading blocks from the connector and saving blocks to it, the tokens it computed, the K/V tokens
    its attention read, and the bytes it moved through the connector's store (read and written)."""

    tokens: list[list[int]]
    found: list[int]
    computed: list[int]
    stats: dict[str, int]
    token_steps: list[list[int]]
    step_seconds: list[float]
    load_seconds: list[float]
    save_seconds: list[float]
    step_tokens: list[int]
    step_context: list[int]
    step_bytes: list[int]

    def times(self, step_seconds: Sequence[float] | None = None) -> list[list[float]]:
        """Per request, the seconds from the first step's start to the end of the step that produced each
        of its tokens: measured, or on ``step_seconds`` (a price for each step) if given."""
        ends, total = [], 0.0
        for seconds in self.step_seconds if step_seconds is None else step_seconds:
            total += seconds
            ends.append(total)
        return [[ends[step] for step in steps] for steps in self.token_steps]

    def gaps(self, step_seconds: Sequence[float] | None = None) -> list[list[float]]:
        """Per request, the seconds between each two of its tokens (one fewer than its tokens)."""
        return [[b - a for a, b in zip(times, times[1:])] for times in self.times(step_seconds)]


def decode(engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Decoded:
    """Step ``engine`` (built with a connector) through ``prompts`` until each has ``max_new_tokens``,
    timing each step and the connector's loads and saves in it."""
    connector = engine.connector
    spent = {"load": 0.0, "save": 0.0}
    ids = [engine.add_request(prompt, max_new_tokens) for prompt in prompts]
    found: dict[int, int] = {}
    computed = dict.fromkeys(ids, 0)
    token_steps: list[list[int]] = [[] for _ in ids]
    steps: dict[str, list] = {name: [] for name in ("seconds", "load", "save", "tokens", "context", "bytes")}
    with _timing(connector, spent):
        while engine.has_unfinished():
            spent.update(load=0.0, save=0.0)
            moved = _bytes_moved(connector)
            start = time.perf_counter()
            output = engine.step()
            steps["seconds"].append(time.perf_counter() - start)
            steps["load"].append(spent["load"])
            steps["save"].append(spent["save"])
            steps["tokens"].append(sum(output.scheduled.values()))
            steps["context"].append(sum(engine.requests[i].num_computed_tokens for i in output.scheduled))
            steps["bytes"].append(_bytes_moved(connector) - moved)
            for req_id, n in output.hits.items():
                found.setdefault(req_id, n)
            for req_id, n in output.scheduled.items():
                computed[req_id] += n
            step = len(steps["seconds"]) - 1
            for made, req_id in zip(token_steps, ids):
                made.extend([step] * (len(engine.requests[req_id].output_tokens) - len(made)))
    return Decoded([engine.output(i) for i in ids], [found[i] for i in ids], [computed[i] for i in ids],
                   connector.stats(), token_steps, steps["seconds"], steps["load"], steps["save"],
                   steps["tokens"], steps["context"], steps["bytes"])


@contextmanager
def _timing(connector: Any, spent: dict[str, float]) -> Iterator[None]:
    """While the block runs, the connector's loads and saves add their seconds to ``spent["load"]`` and
    ``spent["save"]`` (instance attributes over the class's methods, removed again at the end)."""
    def timed(name: str, call: Any) -> Any:
        def run(*args: Any) -> None:
            start = time.perf_counter()
            try:
                call(*args)
            finally:
                spent[name] += time.perf_counter() - start
        return run

    connector.start_load_kv = timed("load", connector.start_load_kv)
    connector.wait_for_save = timed("save", connector.wait_for_save)
    try:
        yield
    finally:
        del connector.start_load_kv, connector.wait_for_save


def _bytes_moved(connector: Any) -> int:
    stats = connector.stats()
    return stats.get("bytes_read", 0) + stats.get("bytes_written", 0)


def store_throughput(store: KVStore, blocks: int = 16, seed: int = 0) -> tuple[float, float]:
    """``store``'s (write, read) bytes a second: ``blocks`` new entries of random K/V put, then got
    (checked as a load checks them), each timed with ``time.perf_counter``."""
    import hashlib

    import torch

    generator = torch.Generator().manual_seed(seed)
    keys = [hashlib.sha256(f"throughput {seed} {time.time_ns()} {i}".encode()).hexdigest()
            for i in range(blocks)]   # new names: a put of an entry the store has writes nothing
    entries = [(torch.randn(store.shape, generator=generator).to(store.dtype),
                torch.randn(store.shape, generator=generator).to(store.dtype)) for _ in keys]
    written, read = store.bytes_written, store.bytes_read
    start = time.perf_counter()
    for key, (k, v) in zip(keys, entries):
        store.put(key, "", k, v, "throughput")
    write = (store.bytes_written - written) / (time.perf_counter() - start)
    start = time.perf_counter()
    for key in keys:
        store.get(key)
    return write, (store.bytes_read - read) / (time.perf_counter() - start)


def decode_in_child(root: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    timeout: float = 300.0, *, threads: int | None = None, warm_up: bool = False,
                    **settings: Any) -> Decoded:
    """``decode`` in a new process: an ``Engine`` on the tiny model with ``settings`` (``num_blocks``,
    ``block_size``, ...) and a consumer ``StoreConnector`` on ``root``. ``threads``: torch's threads in the
    child (default: torch's own choice); ``warm_up``: first serve one short prompt (under a block, so the
    store is not asked for it) and time only what follows, as a serving engine is warm before requests
    come. ``RuntimeError`` with the child's stderr if it fails, ``TimeoutError`` (the child stopped) after
    ``timeout`` seconds."""
    job = {"root": str(root), "prompts": [list(p) for p in prompts], "max_new_tokens": max_new_tokens,
           "settings": settings, "threads": threads, "warm_up": warm_up}
    try:
        return Decoded(**run_child(CHILD_MODULE, job, timeout))
    except ChildError as error:
        raise RuntimeError(f"the decode process failed: {error}") from None


CHILD_MODULE = "pagedlib.disagg"   # the decode engine's process (``python -m``): this file


def _child(job: dict) -> dict:
    from dataclasses import asdict

    import torch

    from pagedlib.engine import Engine
    from pagedlib.teach.train_tiny import load_tiny

    settings = dict(job["settings"])
    store = tiny_store(job["root"], settings.get("block_size", 32))
    settings.setdefault("block_size", store.block_size)
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    engine = Engine(load_tiny()[0], connector=StoreConnector(store, "consumer"), **settings)
    if job.get("warm_up"):
        engine.generate([[0] * (store.block_size - 1)], 2)   # no full block: nothing is looked up or loaded
    return asdict(decode(engine, job["prompts"], job["max_new_tokens"]))


if __name__ == "__main__":
    serve(_child)
