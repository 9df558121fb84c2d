"""Task ``token_budget`` (notebook 09): how chunked prefill shares one step's tokens out.

The reader's ``plan_step`` is compared with pagedlib's ``Scheduler.schedule`` run on the same state (its
pool large enough for every request: memory plays no part in this rule), and served over whole workloads
(arrivals, long prompts) to show that the budget holds, no running request waits behind a prompt, and a
prompt longer than the budget arrives whole, in chunks.
"""

from __future__ import annotations

import copy

from hypothesis import assume, given
from hypothesis import strategies as st

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request, Status
from pagedlib.core.scheduler import Scheduler
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal
from pagedlib.util import ceil_div

BLOCK = 16  # the block size of pagedlib's pool here: any would do, the pool holds every request


def pagedlib_plan(running, waiting, token_budget, max_seqs, chunk_cap=None):
    """pagedlib's ``Scheduler.schedule`` on this state. A running request with one token left decodes (it
    holds its one prompt token and feeds the token it sampled); one with more has computed the first token
    of its prompt; a waiting one is new. The pool holds them all."""
    requests = [*running, *waiting]
    cache = PagedKVCache(sum(ceil_div(t + 1, BLOCK) for _, t in requests) + 1, 1, BLOCK, 1, 1)
    sched = Scheduler(cache, max_num_seqs=max_seqs, max_num_batched_tokens=token_budget,
                      long_prefill_token_threshold=chunk_cap,
                      max_model_len=max((t for _, t in requests), default=0) + 3)
    for req_id, left in running:  # the state a step of the scheduler and its update would leave
        request = Request(req_id, 0, prompt_len=1 if left == 1 else left + 1, output_len=2)
        if left == 1:
            request.output_tokens.append(0)
        cache.manager.add_sequence(req_id)
        cache.manager.commit(cache.manager.reserve([req_id], [1]))
        request.num_computed_tokens, request.status = 1, Status.RUNNING
        sched.running.append(request)
        sched.requests[req_id] = request
    for req_id, tokens in waiting:
        sched.add(Request(req_id, 0, prompt_len=tokens, output_len=1))
    return [(request.req_id, n) for request, n in sched.schedule().work]


def plan_of(impl, case: dict) -> list[tuple[int, int]]:
    """The reader's plan for ``case``, as a list of ``(req_id, num_tokens)`` tuples."""
    got = impl.plan_step(**copy.deepcopy(case))  # the reader's code may change its arguments
    try:
        return [(req_id, n) for req_id, n in got]
    except (TypeError, ValueError):
        raise Failed("plan_step must return a list of (req_id, num_tokens) pairs", got=got,
                     case=case) from None


@st.composite
def states(draw, most: int = 5) -> dict:
    """A step's state: running requests (often decoding: 1 token left), waiting ones, distinct ids in no
    particular order, a budget, seats for the running ones and a few more, perhaps a chunk cap."""
    left = st.integers(-15, 40).map(lambda n: max(n, 1))  # 1 a third of the time (one_of is slower)
    running = draw(st.lists(left, max_size=most))
    waiting = draw(st.lists(st.integers(1, 40), max_size=most))
    ids = draw(st.permutations(range(len(running) + len(waiting))))
    return dict(running=list(zip(ids, running)), waiting=list(zip(ids[len(running):], waiting)),
                token_budget=draw(st.integers(1, 64)),
                max_seqs=draw(st.integers(max(1, len(running)), len(running) + 4)),
                chunk_cap=draw(st.none() | st.integers(1, 40)))


def same_plan(impl) -> None:
    @cases(150)
    @given(case=states())
    def prop(case):
        got = plan_of(impl, case)
        expect_equal("the step's plan, (req_id, num_tokens) in order", pagedlib_plan(**case), got, case)
    prop()


def cap_when_shared(impl) -> None:
    @cases(100)
    @given(case=states(most=1), cap=st.integers(1, 40))
    def prop(case, cap):
        case = {**case, "chunk_cap": cap}
        alone = len(case["running"]) + len(case["waiting"]) == 1
        assume(alone or case["running"] and case["waiting"])
        got = plan_of(impl, case)
        what = "a request alone is not capped" if alone else "two requests: each is capped"
        expect_equal(what, pagedlib_plan(**case), got, case)
    prop()


def within_limits(impl) -> None:
    @cases(150)
    @given(case=states())
    def prop(case):
        plan = plan_of(impl, case)
        left = dict(case["running"] + case["waiting"])
        ids = [req_id for req_id, _ in plan]
        if len(set(ids)) != len(ids) or not set(ids) <= set(left):
            raise Failed("each request in the plan once, and only the requests given",
                         expected=f"ids among {sorted(left)}, each once", got=plan, case=case)
        if sum(n for _, n in plan) > case["token_budget"]:
            raise Failed("the step's tokens within the budget", expected=f"at most {case['token_budget']}",
                         got=plan, case=case)
        for req_id, n in plan:
            if not 1 <= n <= left[req_id]:
                raise Failed(f"request {req_id} given 1 to {left[req_id]} tokens (what it has left)",
                             expected=f"1 to {left[req_id]}", got=n, case=case)
        seats = len(case["running"]) + sum(req_id not in dict(case["running"]) for req_id in ids)
        if seats > case["max_seqs"]:
            raise Failed("running and admitted requests within max_seqs",
                         expected=f"at most {case['max_seqs']} running", got=plan, case=case)
    prop()


def serve(impl, case: dict, on_step) -> dict[int, list[int]]:
    """Serve ``case["requests"]`` (``(arrival step, prompt_len, max_new_tokens)``, ids in order) with the
    reader's ``plan_step``: a scheduled request computes its tokens; one that reaches its last samples a token
    and then has one left (its decode), or finishes. ``on_step(step, state, plan)`` checks each step.
    Returns each request's prompt chunks."""
    requests, limits = case["requests"], {k: v for k, v in case.items() if k != "requests"}
    left = {i: prompt for i, (_, prompt, _) in enumerate(requests)}
    to_make = {i: new for i, (_, _, new) in enumerate(requests)}
    chunks: dict[int, list[int]] = {i: [] for i in left}
    running, waiting = [], []  # ids, in admission order and in arrival order
    for step in range(max(a for a, _, _ in requests) + sum(p + n for _, p, n in requests) + 1):
        waiting += [i for i, (arrival, _, _) in enumerate(requests) if arrival == step]
        state = dict(running=[(i, left[i]) for i in running], waiting=[(i, left[i]) for i in waiting],
                     **limits)
        plan = plan_of(impl, state)
        if not plan and (running or waiting):  # pagedlib's rule always has a token to give then
            raise Failed(f"step {step}: requests wait, and the plan gives nobody a token",
                         expected="a token for someone", got=plan, case={**state, "step": step})
        on_step(step, state, plan)
        for i, n in plan:
            if i not in running + waiting or not 1 <= n <= left[i]:
                raise Failed(f"step {step}: each request in the plan running or waiting, given 1 to its "
                             f"tokens left", expected=f"ids among {running + waiting}", got=plan,
                             case={**state, "step": step})
            if i in waiting:
                waiting.remove(i)
                running.append(i)
            if to_make[i] == requests[i][2]:  # nothing sampled yet: a chunk of its prompt
                chunks[i].append(n)
            left[i] -= n
            if left[i] == 0:
                to_make[i] -= 1
                left[i] = 1
                if to_make[i] == 0:
                    running.remove(i)
        if not running and not waiting and step >= max(a for a, _, _ in requests):
            return chunks
    raise Failed("every request finishes", expected="all finished", got={"running": running,
                 "waiting": waiting}, case=case)


workloads = st.fixed_dictionaries(dict(
    requests=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 40), st.integers(1, 8)), min_size=1,
                      max_size=6),
    token_budget=st.integers(1, 24), max_seqs=st.integers(1, 4), chunk_cap=st.none() | st.integers(1, 16)))


def no_starving(impl) -> None:
    @cases(80)
    @given(case=workloads)
    def prop(case):
        def every_running_request_moves(step, state, plan):
            scheduled = dict(plan)
            for req_id, left in state["running"]:
                if scheduled.get(req_id, 0) < 1:
                    raise Failed(f"step {step}: running request {req_id} ({left} token(s) left) gets a "
                                 f"token", expected=f"({req_id}, n), n >= 1, in the plan", got=plan,
                                 case={**state, "step": step})
        serve(impl, case, every_running_request_moves)
    prop()


def long_prompts(impl) -> None:
    @cases(100)
    @given(case=workloads, extra=st.integers(1, 60))
    def prop(case, extra):
        budget = case["token_budget"]
        case = {**case, "requests": [(0, budget + extra, 2), *case["requests"]]}

        def within_budget(step, state, plan):
            if sum(n for _, n in plan) > budget:
                raise Failed(f"step {step}'s tokens within the budget", expected=f"at most {budget}",
                             got=plan, case={**state, "step": step})
        chunks = serve(impl, case, within_budget)
        prompt = case["requests"][0][1]
        if len(chunks[0]) < 2 or sum(chunks[0]) != prompt:
            raise Failed(f"request 0's prompt of {prompt} tokens, longer than the budget, in chunks that sum "
                         f"to it", expected=prompt, got=chunks[0], case=case)
    prop()


SECTION = "notebook 09, section 2 (The token budget: how a step is planned)"

TASK = Task("token_budget", "09", "token_budget.py",
            "Chunked prefill: how a step's token budget is shared out", (
    Check("a step's plan is pagedlib's: running requests first, in order, then waiting ones", same_plan,
          SECTION + ": each takes what the budget and the chunk cap leave"),
    Check("the chunk cap applies only while more than one request is running or waiting", cap_when_shared,
          SECTION + ": alone, a request has nobody to starve"),
    Check("a step stays within the budget, each request's tokens left and max_seqs", within_limits, SECTION),
    Check("no running request is starved: each gets a token at every step, whatever prompts arrive",
          no_starving,
          "notebook 09, section 1 (Why a long prompt stalls everyone's next token): running requests come "
          "first"),
    Check("a prompt longer than the budget is split across steps, and its chunks sum to it", long_prompts,
          SECTION),
))
