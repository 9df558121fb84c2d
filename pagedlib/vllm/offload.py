"""vLLM's own host tier over a trace: ``CPUOffloadingManager`` (0.32.0), the oracle of ``HostCache``
(notebook 13, ``tests/test_trace.py``).

The manager runs in a child process (``python -m pagedlib.vllm.offload``, started by ``bridge.ask_vllm``
and guarded by ``pagedlib.child``): importing vLLM takes seconds and leaves threads and logging set up in the
process that does it, so the caller's process never imports it. The runs' hash ids go in as one JSON job;
each run's hits per request come back as its answer.

The child drives the manager one request at a time, as vLLM's offloading scheduler does when no load or
store is in flight: look the request's blocks up until the first miss, load the hits (``prepare_load``,
``touch``, ``complete_load``), store the rest (``prepare_store``, ``complete_store``), finish it. A request's
hits are the blocks its lookup found: ``HostCache.lookup`` driven the same way must find the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pagedlib.child import serve
from pagedlib.util import as_int
from pagedlib.vllm.bridge import ask_vllm

POLICIES = ("lru", "arc")          # the policies vLLM's CachePolicyFactory builds in
ID_RANGE = (-(2**63), 2**63)       # an id becomes the 8 bytes of a block hash
CHILD_MODULE = "pagedlib.vllm.offload"   # the child (``python -m``): this file


def vllm_manager_hits(requests: Iterable[Any], num_blocks: int, policy: str = "lru") -> list[int]:
    """Per request of ``requests`` (``TraceRequest`` s or lists of hash ids), the blocks a fresh
    ``CPUOffloadingManager`` of ``num_blocks`` blocks with ``policy`` finds, replaying them in order."""
    return vllm_manager_runs([(requests, num_blocks, policy)])[0]


def vllm_manager_runs(runs: Sequence[tuple[Iterable[Any], int, str]], timeout: float = 600.0
                      ) -> list[list[int]]:
    """``vllm_manager_hits`` for each ``(requests, num_blocks, policy)`` of ``runs``, each on a fresh
    manager, all in one child process (vLLM's import, not the runs, takes most of its time).
    ``RuntimeError`` where vLLM is missing or the child fails (quoting its stderr), ``TimeoutError`` (the
    child stopped) after ``timeout`` seconds."""
    jobs = []
    for requests, num_blocks, policy in runs:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        jobs.append({"requests": [_hash_ids(request, n) for n, request in enumerate(requests)],
                     "num_blocks": as_int("num_blocks", num_blocks, minimum=1), "policy": policy})
    return ask_vllm(CHILD_MODULE, jobs, "requests", "vLLM's offloading manager", timeout)


def _hash_ids(request: Any, number: int) -> list[int]:
    ids = list(getattr(request, "hash_ids", request))
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not ID_RANGE[0] <= i < ID_RANGE[1]:
            raise ValueError(f"request {number}: hash ids must be integers of 64 bits, got {i!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"request {number}: repeats a hash id (an id names a block and its whole prefix)")
    return ids


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


def answer(jobs: list[dict[str, Any]]) -> list[list[int]]:
    """Run in the child: each run's hits (``serve`` keeps whatever vLLM prints out of the answer)."""
    return [manager_hits(job["requests"], job["num_blocks"], job["policy"]) for job in jobs]


if __name__ == "__main__":
    serve(answer)
