"""vLLM's own host tier over a trace: ``CPUOffloadingManager`` (0.32.0), the oracle of ``HostCache``
(notebook 13, ``tests/test_trace.py``).

The manager runs in a child process (``python -m pagedlib.vllm.offload``): importing vLLM takes seconds
and leaves threads and logging set up in the process that does it, so the caller's process never imports
it. The hash ids go in as JSON on stdin; each run's hits per request come back as JSON on stdout.

The child drives the manager one request at a time, as vLLM's offloading scheduler does when no load or
store is in flight: look the request's blocks up until the first miss, load the hits (``prepare_load``,
``touch``, ``complete_load``), store the rest (``prepare_store``, ``complete_store``), finish it. A request's
hits are the blocks its lookup found: ``HostCache.lookup`` driven the same way must find the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pagedlib.util import as_int
from pagedlib.vllm.bridge import vllm_available

POLICIES = ("lru", "arc")          # the policies vLLM's CachePolicyFactory builds in
CHILD_ENV = {
    "VLLM_LOGGING_LEVEL": "WARNING",              # no INFO lines from the import
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",    # stdout carries the answer
}
ID_RANGE = (-(2**63), 2**63)       # an id becomes the 8 bytes of a block hash


def vllm_manager_hits(requests: Iterable[Any], num_blocks: int, policy: str = "lru") -> list[int]:
    """Per request of ``requests`` (``TraceRequest`` s or lists of hash ids), the blocks a fresh
    ``CPUOffloadingManager`` of ``num_blocks`` blocks with ``policy`` finds, replaying them in order."""
    return vllm_manager_runs([(requests, num_blocks, policy)])[0]


def vllm_manager_runs(runs: Sequence[tuple[Iterable[Any], int, str]], timeout: float = 600.0
                      ) -> list[list[int]]:
    """``vllm_manager_hits`` for each ``(requests, num_blocks, policy)`` of ``runs``, each on a fresh
    manager, all in one child process (vLLM's import, not the runs, takes most of its time).
    ``RuntimeError`` where vLLM is missing or the child fails (quoting its stderr)."""
    jobs = []
    for requests, num_blocks, policy in runs:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        jobs.append({"requests": [_hash_ids(request, n) for n, request in enumerate(requests)],
                     "num_blocks": as_int("num_blocks", num_blocks, minimum=1), "policy": policy})
    available, why = vllm_available()
    if not available:
        raise RuntimeError(f"vLLM's offloading manager cannot run: {why}")
    answer = _run_child(json.dumps(jobs), timeout)
    if len(answer) != len(jobs) or any(len(a) != len(job["requests"]) for a, job in zip(answer, jobs)):
        raise RuntimeError(f"the vLLM child answered {len(answer)} runs for {len(jobs)}, or a run with "
                           f"another count of requests than it was given")
    return answer


def _hash_ids(request: Any, number: int) -> list[int]:
    ids = list(getattr(request, "hash_ids", request))
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not ID_RANGE[0] <= i < ID_RANGE[1]:
            raise ValueError(f"request {number}: hash ids must be integers of 64 bits, got {i!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"request {number}: repeats a hash id (an id names a block and its whole prefix)")
    return ids


def _run_child(payload: str, timeout: float) -> list[list[int]]:
    """The child's answer to ``payload``; ``RuntimeError`` with its stderr's tail if it fails."""
    root = str(Path(__file__).resolve().parents[2])   # this pagedlib, wherever the child starts
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **CHILD_ENV, "PYTHONPATH": path}
    command = [sys.executable, "-m", "pagedlib.vllm.offload"]
    try:
        done = subprocess.run(command, input=payload, capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the vLLM child ({' '.join(command)}) took more than {timeout:g} s") from None
    if done.returncode != 0:
        raise RuntimeError(f"the vLLM child ({' '.join(command)}) exited with {done.returncode}:\n"
                           f"{_tail(done.stderr)}")
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])  # the last line: anything printed before it is not the answer
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"the vLLM child answered no JSON: {done.stdout[-300:]!r}\n"
                           f"{_tail(done.stderr)}") from None


def _tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:]) or "(nothing on stderr)"


# ---- the child's side ------------------------------------------------------------------------------------

def manager_hits(requests: Sequence[Sequence[int]], num_blocks: int, policy: str) -> list[int]:
    """Run in the child: a fresh ``CPUOffloadingManager`` driven request by request (module docstring)."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=num_blocks, cache_policy=policy)
    found = []
    for number, ids in enumerate(requests):
        ctx = ReqContext(req_id=str(number))
        manager.on_new_request(ctx)
        keys = [make_offload_key(i.to_bytes(8, "little", signed=True), 0) for i in ids]
        hits = 0
        while hits < len(keys) and manager.lookup(keys[hits], ctx) is LookupResult.HIT:
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], ctx)
            manager.touch(keys[:hits], ctx)
            manager.complete_load(keys[:hits], ctx)
        stored = manager.prepare_store(keys[hits:], ctx)
        if stored is not None:
            manager.complete_store(stored.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        found.append(hits)
    return found


def _child() -> None:
    jobs = json.loads(sys.stdin.read())
    out, sys.stdout = sys.stdout, sys.stderr   # whatever vLLM prints goes to stderr, not into the answer
    answer = [manager_hits(job["requests"], job["num_blocks"], job["policy"]) for job in jobs]
    out.write(json.dumps(answer) + "\n")
    out.flush()


if __name__ == "__main__":
    _child()
