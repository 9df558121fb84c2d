"""The trace replay of notebook 13: reading Mooncake-format traces, ``HostCache``'s invariants, the replay's
figures, vLLM's own ``CPUOffloadingManager`` as the oracle of both policies, and ``bench trace``.

The oracle runs in one child process for the whole module (``vllm_manager_runs``): importing vLLM takes
most of its time, the runs themselves a second or two."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedlib.kv_transfer.host_tier import HostCache
from pagedlib.kv_transfer.policies import POLICIES as POLICY_CLASSES
from pagedlib.sim.trace import (
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_TRACE,
    TraceError,
    TraceRequest,
    read_trace,
    replay,
)
from pagedlib.vllm.bridge import vllm_available
from pagedlib.vllm.offload import vllm_manager_hits, vllm_manager_runs

POLICIES = tuple(POLICY_CLASSES)  # the policies by name: lru, arc

AVAILABLE, WHY = vllm_available()
SLICE = 1500  # requests of the shipped trace the replay and the oracle tests use


# ---- helpers -----------------------------------------------------------------------------------------------

def shared_prefix_trace(rng: random.Random, n: int, max_new: int = 6) -> list[list[int]]:
    """``n`` requests' hash ids: most continue a random prefix of an earlier request with fresh ids, so ids
    are equal exactly when the prefix is (the traces' rule)."""
    fresh = itertools.count(rng.randrange(1000))
    requests: list[list[int]] = []
    for _ in range(n):
        ids = []
        if requests and rng.random() < 0.75:
            base = rng.choice(requests)
            ids = base[:rng.randrange(len(base) + 1)]
        ids = ids + [next(fresh) for _ in range(rng.randrange(0 if ids else 1, max_new + 1))]
        requests.append(ids)
    return requests


def write_trace(path, requests: list[list[int]], rng: random.Random) -> None:
    """A trace file of ``requests``: input lengths that fill all blocks but the last, partly."""
    lines = []
    for number, ids in enumerate(requests):
        tokens = max(0, (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS) + rng.randrange(1, MOONCAKE_BLOCK_TOKENS + 1)
        tokens = tokens if ids else 0
        lines.append(json.dumps({"timestamp": 7 * number, "input_length": tokens,
                                 "output_length": rng.randrange(500), "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")


def host_cache_hits(requests, capacity: int, policy: str) -> list[int]:
    """``HostCache`` driven as the oracle drives vLLM's manager: lookup, load the hits, store the rest,
    finish; each request's hits."""
    cache, hits = HostCache(capacity, policy), []
    for number, request in enumerate(requests):
        ids = list(getattr(request, "hash_ids", request))
        found = cache.lookup(ids)
        cache.load(number, ids[:found])
        cache.release(ids[:found])
        cache.store(number, ids[found:])
        cache.finish(number)
        hits.append(found)
    return hits


def prefix_hits(requests) -> list[int]:
    """An infinite cache's hits, counted here: each request's leading ids met before."""
    seen, hits = set(), []
    for request in requests:
        ids = request.hash_ids
        n = 0
        while n < len(ids) and ids[n] in seen:
            n += 1
        hits.append(n)
        seen.update(ids)
    return hits


@pytest.fixture(scope="module")
def mooncake():
    return read_trace(MOONCAKE_TRACE, limit=SLICE)


def distinct(requests) -> int:
    return len({i for request in requests for i in request.hash_ids})


# ---- reading a trace ---------------------------------------------------------------------------------------

GOOD = '{"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}'
BAD_LINES = {
    "not JSON": ('{"timestamp": 0, "input_length": 7', "not JSON"),
    "not an object": ("[1, 2, 3]", "expected a JSON object"),
    "missing field": ('{"timestamp": 0, "input_length": 7, "output_length": 3}', "missing hash_ids"),
    "negative length": ('{"timestamp": 0, "input_length": -7, "output_length": 3, "hash_ids": [1]}',
                        "input_length must be an integer >= 0"),
    "float length": ('{"timestamp": 0, "input_length": 7, "output_length": 2.5, "hash_ids": [1]}',
                     "output_length must be an integer"),
    "bool timestamp": ('{"timestamp": true, "input_length": 7, "output_length": 3, "hash_ids": [1]}',
                       "timestamp must be an integer"),
    "ids not a list": ('{"timestamp": 0, "input_length": 7, "output_length": 3, "hash_ids": 5}',
                       "hash_ids must be a list of integers"),
    "ids not ints": ('{"timestamp": 0, "input_length": 7, "output_length": 3, "hash_ids": [1, "2"]}',
                     "hash_ids must be a list of integers"),
    "repeated id": ('{"timestamp": 0, "input_length": 7, "output_length": 3, "hash_ids": [1, 2, 1]}',
                    "repeats an id"),
    "deeply nested": ("[" * 100_000, "not a trace record (JSON nested too deeply)"),  # json recurses
    **({"huge integer": ('{"timestamp": ' + "9" * 5000 + ', "input_length": 7, "output_length": 3, '
                         '"hash_ids": []}', "not a trace record (Exceeds the limit")}
       if sys.version_info >= (3, 11) else {}),  # json's int conversion has a limit on digits since 3.11
    "nested ids": ('{"timestamp": 0, "input_length": 7, "output_length": 3, "hash_ids": ' + "[" * 400
                   + "]" * 400 + "}", "hash_ids must be a list of integers, got [[[[[[[...]]]]]]]"),
}


@pytest.mark.parametrize("kind", BAD_LINES)
def test_a_bad_line_is_named_by_its_number(kind, tmp_path):
    line, message = BAD_LINES[kind]
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{line}\n{GOOD}\n")  # a blank line still counts: line 4
    with pytest.raises(TraceError) as error:
        read_trace(path)
    assert f"{path}, line 4: " in str(error.value) and message in str(error.value)


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank lines"])
def test_a_file_without_requests_is_refused(text, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(TraceError, match="no requests"):
        read_trace(path)


def test_a_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match="a folder"):
        read_trace(tmp_path)


@pytest.mark.skipif(sys.platform == "win32", reason="FIFOs")
def test_a_fifo_is_not_a_regular_file_and_is_never_opened(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    os.mkfifo(path)  # opening it for reading would wait for a writer
    with pytest.raises(TraceError, match=f"^{re.escape(str(path))}: not a regular file$"):
        read_trace(path)
    code, stdout, stderr = run_bench([str(path), "--blocks", "4"], capsys)
    assert code == 2 and stderr.strip().endswith(f"{path}: not a regular file") and not stdout


def test_a_file_not_in_utf8_is_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{GOOD}\n".encode() + b'{"timestamp": 0, "note": "\xff"}\n')
    with pytest.raises(TraceError, match=f"{path}, line .*not UTF-8"):
        read_trace(path)


def test_a_bad_byte_is_named_by_its_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{GOOD}\n".encode() * 3 + b'{"timestamp": 0, "note": "\xff"}\n')
    with pytest.raises(TraceError, match="line 4: not UTF-8"):
        read_trace(path)


def test_limit_reads_the_first_requests_only(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [GOOD.replace("[1, 2]", f"[{i}]") for i in range(5)]
    path.write_text("\n".join(lines[:3]) + "\nnot json\n")  # the bad line lies past the limit
    assert [r.hash_ids for r in read_trace(path, limit=3)] == [(0,), (1,), (2,)]
    assert [r.hash_ids for r in read_trace(path, limit=1)] == [(0,)]
    with pytest.raises(TraceError, match="line 4"):
        read_trace(path, limit=4)
    with pytest.raises(ValueError, match="limit"):
        read_trace(path, limit=0)


def test_the_shipped_trace_is_read_whole():
    requests = read_trace(MOONCAKE_TRACE)
    assert len(requests) == 12031
    assert all(len(r.hash_ids) == -(-r.input_length // MOONCAKE_BLOCK_TOKENS) for r in requests)
    assert [r.timestamp for r in requests] == sorted(r.timestamp for r in requests)


# ---- HostCache's invariants --------------------------------------------------------------------------------

KEYS = st.lists(st.integers(0, 9), max_size=6)
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("lookup"), KEYS),
    st.tuples(st.just("load"), st.integers(0, 2), KEYS),
    st.tuples(st.just("store"), st.integers(0, 2), KEYS),
    st.tuples(st.just("finish"), st.integers(0, 2)),
    st.tuples(st.just("take_slots"), st.integers(0, 4)),
    st.tuples(st.just("give_slots"), st.integers(0, 3)),
    st.tuples(st.just("cancel_store"), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 3)),
), max_size=60)


def check_store(cache: HostCache, req: int, keys: list[int]) -> list:
    before = dict(cache.slots)
    offer = list(dict.fromkeys(keys))
    new = [key for key in offer if key not in before]
    taken = cache.store(req, keys)
    if taken is None:
        assert cache.slots == before, "a refused store changed the slots"
        return []
    assert [key for key, _ in taken] == new, "a store takes slots for exactly the keys it lacked"
    assert all(cache.slots[key] == slot for key, slot in taken)
    assert all(key in cache for key in offer), "a store evicted a key of its own offer"
    assert set(cache.last_evicted) <= set(before) - set(offer)
    assert not set(cache.last_evicted) & set(cache.slots)
    return taken


def apply(cache: HostCache, operation: tuple, reserved: list, stored: list, loading: list) -> None:
    name, *args = operation
    if name == "lookup":
        hits = cache.lookup(args[0])
        assert all(key in cache for key in args[0][:hits])
        assert hits == len(args[0]) or args[0][hits] not in cache
    elif name == "load":  # the keys a lookup found, as a caller loads them
        keys = list(dict.fromkeys(args[1]))
        keys = keys[:cache.lookup(keys)]
        assert cache.load(args[0], keys) == [cache.slots[key] for key in keys]
        loading.append(keys)  # pinned until released: no store or take_slots may evict them
    elif name == "release" and loading:
        cache.release(loading.pop(args[0] % len(loading)))
    elif name == "store":
        stored.append(check_store(cache, *args))
    elif name == "finish":
        cache.finish(args[0])
    elif name == "take_slots":
        before = dict(cache.slots)
        slots = cache.take_slots(args[0])
        if slots is None:
            assert cache.slots == before
        else:
            assert len(slots) == args[0] and not set(slots) & set(cache.slots.values())
            reserved.append(slots)
    elif name == "give_slots" and reserved:
        cache.give_slots(reserved.pop(args[0] % len(reserved)))
    elif name == "cancel_store" and stored and not any(key in cache.pinned for key, _ in stored[-1]):
        taken = stored.pop()  # a copy that failed: the latest store's (the engine cancels at once)
        cache.cancel_store(taken)
        assert not any(cache.slots.get(key) == slot for key, slot in taken)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(capacity=st.integers(1, 6), policy=st.sampled_from(sorted(POLICIES)), operations=OPERATIONS)
def test_host_cache_keeps_its_invariants(capacity, policy, operations):
    cache = HostCache(capacity, policy)
    reserved: list[list[int]] = []
    stored: list[list] = []
    loading: list[list[int]] = []
    for operation in operations:
        apply(cache, operation, reserved, stored, loading)
        assert cache.check() is None, cache.check()
        assert all(key in cache for keys in loading for key in keys), "a pinned key was evicted"
        assert cache.reserved == sum(map(len, reserved))
        assert len(cache) <= capacity - cache.reserved


# ---- a trace worked out by hand ----------------------------------------------------------------------------

# Capacity 3. A is stored (r0) and reused (r1): LRU moves it to the recent end, ARC promotes it to t2, the
# list of keys used twice. B, C (r2, r3) fill the cache. D (r4) needs one slot: LRU evicts the least recent,
# A (order A B C); ARC evicts from t1 (its target is still 0), the oldest once-used key, B. So r5 (A again)
# misses under LRU and hits under ARC.
RECENCY = [[1], [1], [2], [3], [4], [1]]
RECENCY_HITS = {"lru": [0, 1, 0, 0, 0, 0], "arc": [0, 1, 0, 0, 0, 1]}
# Capacity 3. r0 stores X Y; finishing it touches its keys tail first, so X (the head) ends most recent:
# LRU order Y X, then Z (r1). W (r2) evicts Y, the tail, under both policies (ARC's t1 has the same order).
# r3 (X Y) finds X and misses Y. Eviction in store order (X before Y) would have found nothing.
TAIL_FIRST = [[10, 11], [12], [13], [10, 11]]
TAIL_FIRST_HITS = {"lru": [0, 0, 0, 1], "arc": [0, 0, 0, 1]}


@pytest.mark.parametrize("policy", POLICIES)
def test_hand_worked_traces(policy):
    assert host_cache_hits(RECENCY, 3, policy) == RECENCY_HITS[policy]
    assert host_cache_hits(TAIL_FIRST, 3, policy) == TAIL_FIRST_HITS[policy]


def test_replay_device_tier_is_lru_on_the_hand_worked_traces():
    for requests, hits in [(RECENCY, RECENCY_HITS), (TAIL_FIRST, TAIL_FIRST_HITS)]:
        trace = [TraceRequest(0, len(ids) * MOONCAKE_BLOCK_TOKENS, 1, tuple(ids)) for ids in requests]
        assert [d for d, _ in replay(trace, 3).per_request] == hits["lru"]


# ---- replay's figures --------------------------------------------------------------------------------------

def test_a_device_tier_holding_every_block_reaches_the_ceiling(mooncake):
    result = replay(mooncake, distinct(mooncake))
    assert [d for d, _ in result.per_request] == prefix_hits(mooncake)
    assert result.hit_rate == result.ceiling and result.saved_tokens == result.ceiling_tokens
    assert result.blocks == sum(len(r.hash_ids) for r in mooncake)
    assert result.tokens == sum(r.input_length for r in mooncake)


def test_no_host_tier_finds_nothing_there(mooncake):
    result = replay(mooncake, 500, host_blocks=0)
    assert result.host_hits == 0 and all(h == 0 for _, h in result.per_request)
    assert result.device_hits == sum(d for d, _ in result.per_request) <= result.ceiling_hits


@pytest.mark.parametrize("write", ["through", "victim"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_host_tier_only_adds_hits(mooncake, write, policy):
    """The device tier decides alone: behind it a host tier leaves its hits as they were and adds some."""
    size, host_hits = distinct(mooncake), []
    for blocks, host_blocks in [(size // 100, size // 10), (size // 10, size // 2), (size // 10, size // 20)]:
        alone = replay(mooncake, blocks)
        both = replay(mooncake, blocks, host_blocks, policy=policy, write=write)
        assert [d for d, _ in both.per_request] == [d for d, _ in alone.per_request]
        assert both.device_hits + both.host_hits >= alone.device_hits
        assert both.device_hits + both.host_hits <= both.ceiling_hits
        assert both.saved_tokens >= alone.saved_tokens
        host_hits.append(both.host_hits)
    assert max(host_hits) > 0


def test_a_write_through_host_holding_every_block_reaches_the_ceiling(mooncake):
    result = replay(mooncake, 300, host_blocks=distinct(mooncake))
    assert [d + h for d, h in result.per_request] == prefix_hits(mooncake)


# ---- vLLM's manager as the oracle --------------------------------------------------------------------------

def capacities(requests) -> list[int]:
    """Small, medium and large beside the distinct blocks of ``requests``."""
    size = distinct(requests)
    return [size // 100, size // 10, size // 2]


@pytest.fixture(scope="module")
def oracle(mooncake):
    """The runs of this module, by name, and vLLM's per-request hits for each, from one child process: the
    shipped slice at three capacities, the hand-worked traces, and small random traces that evict often."""
    runs = {("mooncake", cap, policy): (mooncake, cap, policy)
            for cap in capacities(mooncake) for policy in POLICIES}
    for policy in POLICIES:
        runs["recency", 3, policy] = (RECENCY, 3, policy)
        runs["tail", 3, policy] = (TAIL_FIRST, 3, policy)
    rng = random.Random(20250213)
    for k in range(300):
        policy = tuple(POLICIES)[k % 2]
        requests = shared_prefix_trace(rng, rng.randrange(5, 80))
        runs["random", k, policy] = (requests, rng.randrange(1, 16), policy)
    return runs, dict(zip(runs, vllm_manager_runs(list(runs.values()))))


needs_vllm = pytest.mark.skipif(not AVAILABLE, reason=WHY or "vLLM is available")


@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("size", ["small", "medium", "large"])
@pytest.mark.parametrize("policy", POLICIES)
def test_host_cache_finds_what_vllms_manager_finds(oracle, mooncake, size, policy):
    _, theirs = oracle
    cap = capacities(mooncake)[["small", "medium", "large"].index(size)]
    assert host_cache_hits(mooncake, cap, policy) == theirs["mooncake", cap, policy]
    if policy == "lru":  # the replay's device tier is the same LRU
        assert [d for d, _ in replay(mooncake, cap).per_request] == theirs["mooncake", cap, policy]


@pytest.mark.slow
@needs_vllm
def test_the_hand_worked_traces_are_vllms_too(oracle):
    _, theirs = oracle
    for policy in POLICIES:
        assert theirs["recency", 3, policy] == RECENCY_HITS[policy]
        assert theirs["tail", 3, policy] == TAIL_FIRST_HITS[policy]


@pytest.mark.slow
@needs_vllm
def test_random_traces_agree_with_vllm(oracle):
    runs, theirs = oracle
    differ = [(name, runs[name]) for name in runs if name[0] == "random"
              and host_cache_hits(*runs[name]) != theirs[name]]
    assert not differ, f"HostCache and vLLM differ on {len(differ)} random traces, first {differ[0]}"


def test_the_oracle_checks_its_arguments():
    with pytest.raises(ValueError, match="policy"):
        vllm_manager_hits([[1]], 4, "fifo")
    with pytest.raises(ValueError, match="num_blocks"):
        vllm_manager_hits([[1]], 0)
    with pytest.raises(ValueError, match="request 1: repeats"):
        vllm_manager_hits([[1], [2, 3, 2]], 4)
    with pytest.raises(ValueError, match="64 bits"):
        vllm_manager_hits([[2**64]], 4)


def test_the_oracle_says_why_vllm_cannot_run(monkeypatch):
    monkeypatch.setattr("pagedlib.vllm.bridge.vllm_available", lambda: (False, "no vLLM on this machine"))
    with pytest.raises(RuntimeError, match="no vLLM on this machine"):
        vllm_manager_hits([[1]], 4)


@pytest.mark.skipif(sys.platform == "win32", reason="a shell script stands in for Python")
def test_a_failing_child_is_a_runtime_error_quoting_its_stderr(monkeypatch, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\ncat > /dev/null\necho 'first line' >&2\necho 'ImportError: no vllm' >&2\n"
                    "exit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr("pagedlib.vllm.bridge.vllm_available", lambda: (True, ""))
    monkeypatch.setattr(sys, "executable", str(fake))
    with pytest.raises(RuntimeError, match="exited with 3") as error:
        vllm_manager_hits([[1]], 4)
    assert "ImportError: no vllm" in str(error.value)


# ---- bench trace -------------------------------------------------------------------------------------------

def run_bench(argv, capsys):
    from pagedlib.bench.__main__ import main

    code = main(["trace", *argv])
    return code, *capsys.readouterr()


def table_row(out: str) -> dict[str, str]:
    header, _, row = out.strip().splitlines()[-3:]
    return dict(zip(header.split(), row.split()))


@pytest.mark.parametrize("flags", [[], ["--host-blocks", "60", "--policy", "arc"],
                                   ["--host-blocks", "40", "--write", "victim", "--limit", "900"]])
def test_bench_trace_prints_and_writes_the_replays_figures(flags, tmp_path, capsys):
    rng = random.Random(len(flags))
    path, out = tmp_path / "fresh.jsonl", tmp_path / "out.json"
    write_trace(path, shared_prefix_trace(rng, 1200), rng)
    code, stdout, stderr = run_bench([str(path), "--blocks", "25", *flags, "--json", str(out)], capsys)
    assert code == 0, stderr
    options = dict(zip(flags[::2], flags[1::2]))
    limit = int(options.get("--limit", 0)) or None
    host = int(options.get("--host-blocks", 0))
    expected = replay(read_trace(path, limit=limit), 25, host, policy=options.get("--policy", "lru"),
                      write=options.get("--write", "through")).summary()
    row = table_row(stdout)
    for name in ("requests", "blocks", "saved_tokens", "tokens"):
        assert int(row[name]) == expected[name]
    for name in ("hit_rate", "device_hit_rate", "host_hit_rate", "ceiling"):
        assert float(row[name]) == pytest.approx(expected[name], rel=5e-3, abs=1e-9)
    written = json.loads(out.read_text())
    assert written["summary"] == expected
    assert written["settings"]["blocks"] == 25 and written["settings"]["file"] == str(path)
    assert written["settings"]["limit"] == limit
    assert ("replay" in stderr) == (expected["requests"] > 1000)  # the progress bar, on stderr
    assert "replay" not in stdout


BAD_FILES = {
    "missing": (None, ": no such file"),
    "empty": (b"", ": no requests"),
    "not utf-8": (f"{GOOD}\n".encode() + b'{"x": "\xff"}\n', ", line .*not UTF-8"),
    **{kind: (f"{GOOD}\n{GOOD}\n{line}\n".encode(), f", line 3: .*{re.escape(message)}")
       for kind, (line, message) in BAD_LINES.items()},
}


@pytest.mark.parametrize("kind", BAD_FILES)
def test_bench_trace_refuses_a_bad_file_in_one_line(kind, tmp_path, capsys):
    content, message = BAD_FILES[kind]
    path, out = tmp_path / "bad.jsonl", tmp_path / "out.json"
    if content is not None:
        path.write_bytes(content)
    code, stdout, stderr = run_bench([str(path), "--blocks", "4", "--json", str(out)], capsys)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert re.search(re.escape(str(path)) + message, stderr), stderr
    assert "Traceback" not in stderr and not stdout
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--blocks", "0"], "argument --blocks: expected an integer >= 1"),
    (["--blocks", "-3"], "argument --blocks: expected an integer >= 1"),
    ([], "the following arguments are required: --blocks"),
    (["--blocks", "4", "--host-blocks", "-1"], "argument --host-blocks"),
    (["--blocks", "4", "--policy", "fifo"], "argument --policy"),
    (["--blocks", "4", "--policy", "arc"], "give --host-blocks"),
    (["--blocks", "4", "--limit", "0"], "argument --limit"),
    (["--blocks", "9" * 30], f"--blocks {'9' * 30} and --host-blocks 0 needs about"),  # no OverflowError
    (["--blocks", "4", "--host-blocks", str(10**15)], f"--blocks 4 and --host-blocks {10**15} needs about"),
])
def test_bench_trace_flags_are_usage_errors(flags, message, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD + "\n")
    with pytest.raises(SystemExit) as exit_info:
        run_bench([str(path), *flags], capsys)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
