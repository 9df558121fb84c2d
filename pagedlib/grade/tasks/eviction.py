"""Task ``eviction`` (notebook 13): the host tier's LRU policy, behind the methods ``HostCache`` calls.

The reader's ``LRU`` is compared with pagedlib's (``kv_transfer.policies.LRU``) on generated sequences of
operations, each answer and the order of the keys after every operation; then the lesson's properties one by
one; last, ``HostCache`` itself runs requests on the reader's policy and must find and evict what it does on
pagedlib's.
"""

from __future__ import annotations

from hypothesis import assume, given
from hypothesis import strategies as st

from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal
from pagedlib.kv_transfer.host_tier import HostCache
from pagedlib.kv_transfer.policies import LRU

keys = st.integers(0, 7)
distinct = st.lists(keys, unique=True, max_size=8)
protect = st.sets(keys, max_size=8)
# the tier's keys are block hashes: ints past 256, so an equal key is often another object (Python keeps one
# object of each int from -5 to 256 only), and a policy that finds keys with ``is`` is caught; each one drawn
# is made afresh
HASHES = range(1000, 1008)
hashes = st.integers(0, 7).map(lambda k: HASHES[k])
operations = st.lists(st.one_of(
    st.tuples(st.just("insert"), hashes), st.tuples(st.just("remove"), hashes),
    st.tuples(st.just("touch"), st.lists(hashes, unique=True, max_size=8)),
    st.tuples(st.just("evict"), st.integers(1, 6), st.sets(hashes, max_size=8))), max_size=14)


def apply(policy, op: tuple):
    """Run ``op`` on ``policy``; its answer (``evict``'s), else ``None``."""
    if op[0] == "insert":
        return policy.insert(op[1])
    if op[0] == "remove":
        return policy.remove(op[1])
    if op[0] == "touch":
        return policy.touch(list(op[1]))
    return policy.evict(op[1], set(op[2]))


def written(op: tuple) -> str:
    """``op`` as the call it is: ``insert(3)``, ``evict(2, protected={1})``."""
    if op[0] == "evict":
        return f"evict({op[1]}, protected={set(op[2]) or 'set()'})"
    return f"{op[0]}({list(op[1]) if op[0] == 'touch' else op[1]})"


def same_state(ours: LRU, theirs, case: dict) -> None:
    expect_equal("keys(), the next evicted first", ours.keys(), theirs.keys(), case)
    expect_equal("len()", len(ours), len(theirs), case)
    expect_equal(f"which keys are held (key in policy, for keys {HASHES[0]} to {HASHES[-1]})",
                 [k in ours for k in HASHES], [k in theirs for k in HASHES], case)


def decisions(impl) -> None:
    @cases(200)
    @given(ops=operations)
    def prop(ops):
        ours, theirs, done = LRU(0), impl.LRU(), []
        for op in ops:
            if op[0] == "insert" and op[1] in ours or op[0] == "remove" and op[1] not in ours:
                continue                # the tier inserts only keys it lacks, removes only keys it holds
            done.append(written(op))
            case = {"operations": done}
            got = apply(theirs, op)
            expect_equal(f"what {done[-1]} returns", apply(ours, op), got, case)
            same_state(ours, theirs, case)
    prop()


def filled(impl, inserted: list[int]):
    policy = impl.LRU()
    for key in inserted:
        policy.insert(key)
    return policy


def touch_to_back(impl) -> None:
    @cases(150)
    @given(inserted=distinct, touched=distinct)
    def prop(inserted, touched):
        policy = filled(impl, inserted)
        policy.touch(list(touched))
        used = [k for k in reversed(touched) if k in inserted]
        expected = [k for k in inserted if k not in used] + used
        expect_equal("keys() after the touch: the untouched in their order, then the touched keys held, the "
                     "last of the list first, so its first key is the most recent", expected, policy.keys(),
                     {"inserted": inserted, "touched": touched})
    prop()


def never_protected(impl) -> None:
    @cases(150)
    @given(inserted=distinct, protected=protect, n=st.integers(1, 8))
    def prop(inserted, protected, n):
        free = [k for k in inserted if k not in protected]
        assume(free)                           # nothing to evict from: the next check's business
        n = min(n, len(free))
        policy = filled(impl, inserted)
        evicted = policy.evict(n, set(protected))
        case = {"inserted": inserted, "evict": written(("evict", n, protected))}
        if evicted is None or len(evicted) != n:
            raise Failed(f"{len(free)} unprotected keys are held: evict({n}) must return {n} of them",
                         expected=free[:n], got=evicted, case=case)
        expect_equal("protected keys in the answer", [], [k for k in evicted if k in protected], case)
        expect_equal(f"evict({n})'s answer: the {n} least recent unprotected keys, least recent first",
                     free[:n], list(evicted), case)
        expect_equal("the protected keys still held", [k for k in inserted if k in protected],
                     [k for k in policy.keys() if k in protected], case)
    prop()


def all_or_nothing(impl) -> None:
    @cases(150)
    @given(inserted=distinct, protected=protect, more=st.integers(1, 4))
    def prop(inserted, protected, more):
        n = len([k for k in inserted if k not in protected]) + more      # one more than can be freed, or more
        policy = filled(impl, inserted)
        before = policy.keys()
        got = policy.evict(n, set(protected))
        case = {"inserted": inserted, "evict": written(("evict", n, protected))}
        expect_equal(f"evict({n}) with only {n - more} keys unprotected", None, got, case)
        expect_equal("keys() after the eviction that could not be made (nothing changed)", before,
                     policy.keys(), case)
    prop()


class HostPolicy:
    """The reader's ``LRU`` as ``HostCache`` calls a policy: a request finishing is a use (``touch``), as in
    pagedlib's ``LRU``; a missed store teaches LRU nothing."""

    def __init__(self, lru) -> None:
        self.lru, self.capacity = lru, 0

    def __getattr__(self, name: str):
        return getattr(self.lru, name)

    def __contains__(self, key) -> bool:
        return key in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def store_missed(self, keys) -> None:
        pass

    def finished(self, keys, inserted, reused) -> None:
        self.lru.touch(keys)


def replay(cache: HostCache, requests: list[list[int]], case: dict) -> list:
    """Each request as notebook 13's replay drives it (lookup, load, store, release, finish): what each found,
    stored and evicted, and the tier's keys at the end; ``Failed`` as soon as the policy's keys are not the
    tier's."""
    seen = []
    for number, ids in enumerate(requests):
        found = cache.lookup(ids)
        cache.load(number, ids[:found])                # pinned, so the store must not evict them
        stored = cache.store(number, ids[found:])
        cache.release(ids[:found])
        cache.finish(number)
        seen.append((found, None if stored is None else len(stored), list(cache.last_evicted)))
        if cache.check():
            raise Failed(f"after request {number}: {cache.check()}", expected=sorted(cache.slots),
                         got=sorted(cache.policy.keys()), case=case)
    return seen + [sorted(cache.slots)]


def host_tier(impl) -> None:
    @cases(150)
    @given(capacity=st.integers(1, 6), requests=st.lists(st.lists(keys, min_size=1, max_size=5, unique=True),
                                                          min_size=1, max_size=8))
    def prop(capacity, requests):
        theirs = HostCache(capacity)
        theirs.policy = HostPolicy(impl.LRU())
        case = {"capacity": capacity, "requests": requests}
        got = replay(theirs, requests, case)
        expected = replay(HostCache(capacity), requests, case)
        for i, (want, have) in enumerate(zip(expected, got)):
            what = "the keys held at the end" if i == len(requests) else (
                f"request {i}: (blocks found, blocks stored or None if refused, keys evicted)")
            expect_equal(what, want, have, case)
    prop()


TASK = Task("eviction", "13", "eviction.py", "The host tier's LRU eviction policy", (
    Check("every answer and the order of the keys equal pagedlib's LRU after any sequence of operations",
          decisions, "notebook 13, section 6 (An hour of real traffic): the host tier by LRU"),
    Check("a touched block goes to the back of the line, the first of the list last", touch_to_back,
          "notebook 13, section 6 (An hour of real traffic): a request's tail is evicted before its head"),
    Check("a protected block is never evicted", never_protected,
          "notebook 13, section 2 (Two tiers): store never evicts a key of the same offer or a pinned one"),
    Check("an eviction that cannot free n blocks returns None and changes nothing", all_or_nothing,
          "notebook 13, section 2 (Two tiers): store makes room all or nothing"),
    Check("the host tier on your policy finds, stores and evicts the blocks it does on pagedlib's", host_tier,
          "notebook 13, section 6 (An hour of real traffic): the replay, one request at a time"),
))
