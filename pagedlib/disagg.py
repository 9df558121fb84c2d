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
from collections.abc import Sequence
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
    """A decode engine's run: per request its tokens, the tokens it found at admission (prefix cache and
    store, whole blocks), the tokens it computed, and the connector's counters."""

    tokens: list[list[int]]
    found: list[int]
    computed: list[int]
    stats: dict[str, int]


def decode(engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> Decoded:
    """Step ``engine`` (built with a connector) through ``prompts`` until each has ``max_new_tokens``."""
    ids = [engine.add_request(prompt, max_new_tokens) for prompt in prompts]
    found: dict[int, int] = {}
    computed = dict.fromkeys(ids, 0)
    while engine.has_unfinished():
        output = engine.step()
        for req_id, n in output.hits.items():
            found.setdefault(req_id, n)
        for req_id, n in output.scheduled.items():
            computed[req_id] += n
    return Decoded([engine.output(i) for i in ids], [found[i] for i in ids], [computed[i] for i in ids],
                   engine.connector.stats())


def decode_in_child(root: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    timeout: float = 300.0, **settings: Any) -> Decoded:
    """``decode`` in a new process: an ``Engine`` on the tiny model with ``settings`` (``num_blocks``,
    ``block_size``, ...) and a consumer ``StoreConnector`` on ``root``. ``RuntimeError`` with the child's
    stderr if it fails, ``TimeoutError`` (the child stopped) after ``timeout`` seconds."""
    job = {"root": str(root), "prompts": [list(p) for p in prompts], "max_new_tokens": max_new_tokens,
           "settings": settings}
    try:
        return Decoded(**run_child(CHILD_MODULE, job, timeout))
    except ChildError as error:
        raise RuntimeError(f"the decode process failed: {error}") from None


CHILD_MODULE = "pagedlib.disagg"   # the decode engine's process (``python -m``): this file


def _child(job: dict) -> dict:
    from dataclasses import asdict

    from pagedlib.engine import Engine
    from pagedlib.teach.train_tiny import load_tiny

    settings = dict(job["settings"])
    store = tiny_store(job["root"], settings.get("block_size", 32))
    settings.setdefault("block_size", store.block_size)
    engine = Engine(load_tiny()[0], connector=StoreConnector(store, "consumer"), **settings)
    return asdict(decode(engine, job["prompts"], job["max_new_tokens"]))


if __name__ == "__main__":
    serve(_child)
