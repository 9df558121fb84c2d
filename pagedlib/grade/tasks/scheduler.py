"""Task ``scheduler`` (notebook 07): one step of continuous batching, with preemption by recomputation.

The reader's ``Scheduler`` holds block counts only. Each generated workload (arrival steps, prompt and output
lengths, a pool and ``max_seqs``) is served by it and by pagedlib's own ``Scheduler`` side by side, and every
step's decisions must be equal; the blocks it says each request holds are checked against the tokens its
own decisions gave that request; and on a pool that holds the largest request, every request must finish.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.grade.framework import Check, Failed, Task, cases, expect_equal
from pagedlib.util import ceil_div


class PagedlibScheduler:
    """pagedlib's ``Scheduler`` behind the task's interface, in its simplest configuration: whole prompts (no
    token budget), no prefix caching, no connector, no watermark (its default, vLLM V1's). A step's plan is
    run at once: each scheduled request samples a token (0; nobody reads them), and finished ones leave."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int) -> None:
        self.cache = PagedKVCache(num_blocks, 1, block_size, 1, 1)  # 1 layer, 1 head, head_dim 1: tiny K/V
        self.scheduler = Scheduler(self.cache, max_num_seqs=max_seqs, watermark=0.0)

    def add(self, req_id: int, prompt_len: int, max_new_tokens: int) -> None:
        self.scheduler.add(Request(req_id, 0, prompt_len, max_new_tokens))

    def step(self) -> tuple[list[int], list[int]]:
        plan = self.scheduler.schedule()
        self.scheduler.update(plan, [0] * len(plan.work))
        return [request.req_id for request, _ in plan.work], [request.req_id for request in plan.preempted]

    def blocks_held(self, req_id: int) -> int:
        return len(self.cache.tables.get(req_id, ()))


@st.composite
def workloads(draw, room: bool) -> dict:
    """Requests ``(arrival step, prompt_len, max_new_tokens)``, their ids their positions, each fitting the
    pool alone at its longest; the pool holds them all at once (``room``) or the largest and a few blocks."""
    block_size = draw(st.integers(1, 4))
    requests = draw(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 10), st.integers(1, 8)),
                             min_size=1, max_size=6))
    alone = [ceil_div(prompt + new - 1, block_size) for _, prompt, new in requests]
    num_blocks = sum(alone) if room else max(alone) + draw(st.integers(0, 3))
    return dict(num_blocks=num_blocks, block_size=block_size, max_seqs=draw(st.integers(1, 4)),
                requests=requests)


@st.composite
def crowds(draw) -> dict:
    """Alike requests arriving together on a pool that holds one at its longest and a block or two: they
    all need a block at the same steps, and one step often preempts several."""
    block_size, count = draw(st.integers(1, 2)), draw(st.integers(3, 6))
    prompt_len, new = draw(st.integers(1, 3)), draw(st.integers(2, 8))
    return dict(num_blocks=ceil_div(prompt_len + new - 1, block_size) + draw(st.integers(0, 2)),
                block_size=block_size, max_seqs=count, requests=[(0, prompt_len, new)] * count)


def arrive(schedulers, requests, step: int) -> None:
    for req_id, (arrival, prompt_len, new) in enumerate(requests):
        if arrival == step:
            for scheduler in schedulers:
                scheduler.add(req_id, prompt_len, new)


def decisions(result, case: dict) -> dict[str, list[int]]:
    """A ``step()``'s answer as ``{"scheduled": [...], "preempted": [...]}``."""
    try:
        scheduled, preempted = result
        return {"scheduled": list(scheduled), "preempted": list(preempted)}
    except (TypeError, ValueError):
        raise Failed("step() returns (scheduled, preempted): two lists of request ids", got=result,
                     case=case) from None


def steps(case: dict) -> range:
    """Steps enough for pagedlib to finish ``case`` and one more: after the last arrival, each step gives the
    oldest running request a token (preemption takes the newest), or admits the first waiting one."""
    requests = case["requests"]
    return range(max(a for a, _, _ in requests) + sum(new for _, _, new in requests) + 2)


def same_decisions(impl, case: dict) -> None:
    """Serve ``case`` with the reader's scheduler and pagedlib's; every step's decisions equal."""
    mine = impl.Scheduler(case["num_blocks"], case["block_size"], case["max_seqs"])
    theirs = PagedlibScheduler(case["num_blocks"], case["block_size"], case["max_seqs"])
    last = max(a for a, _, _ in case["requests"])
    for step in steps(case):
        arrive((mine, theirs), case["requests"], step)
        at = {**case, "step": step}
        got = decisions(mine.step(), at)
        expected = decisions(theirs.step(), at)
        expect_equal(f"step {step}: the requests scheduled (in order) and preempted (in order)",
                     expected, got, at)
        if step >= last and not expected["scheduled"] and not theirs.scheduler.has_unfinished:
            return


def with_room(impl) -> None:
    @cases(100)
    @given(case=workloads(room=True))
    def prop(case):
        same_decisions(impl, case)
    prop()


def small_pool(impl) -> None:
    @cases(200)
    @given(case=workloads(room=False) | crowds())
    def prop(case):
        same_decisions(impl, case)
    prop()


class Book:
    """The grader's account of a workload served by the reader's decisions: the tokens each request made,
    and whether it runs (holds blocks). Refuses decisions no scheduler could make."""

    def __init__(self, case: dict) -> None:
        self.case = case
        self.made: dict[int, int] = {}
        self.running: set[int] = set()

    def arrived(self, step: int) -> None:
        self.made.update({i: 0 for i, (a, _, _) in enumerate(self.case["requests"]) if a == step})

    def apply(self, step: int, scheduled: list[int], preempted: list[int]) -> None:
        at = {**self.case, "step": step}
        for req_id in preempted:
            if req_id not in self.running or req_id in scheduled:
                raise Failed(f"step {step}: request {req_id} preempted: only a running request is, and it "
                             f"then does not run", expected="running requests only, none of them scheduled",
                             got={"scheduled": scheduled, "preempted": preempted}, case=at)
            self.running.discard(req_id)
        for req_id in scheduled:
            new = self.case["requests"][req_id][2] if req_id in self.made else 0
            if scheduled.count(req_id) > 1 or self.made.get(req_id, new) >= new:
                raise Failed(f"step {step}: request {req_id} scheduled: it has not arrived, is finished "
                             f"(made its {new} tokens) or is scheduled twice",
                             expected="requests that arrived and are unfinished, each once", got=scheduled,
                             case=at)
            self.made[req_id] += 1
            self.running.add(req_id)
            if self.made[req_id] == new:
                self.running.discard(req_id)

    def blocks(self) -> dict[int, int]:
        """The blocks each request holds: a running one, its prompt and the tokens it made but the last."""
        return {i: ceil_div(self.case["requests"][i][1] + made - 1, self.case["block_size"])
                if i in self.running else 0 for i, made in self.made.items()}

    def unfinished(self) -> dict[int, int]:
        return {i: made for i, made in self.made.items() if made < self.case["requests"][i][2]}


def serve(impl, case: dict, after_step=None) -> Book:
    """Serve ``case`` with the reader's scheduler alone, keeping the book; ``after_step(step, book,
    scheduler)`` checks each step."""
    mine = impl.Scheduler(case["num_blocks"], case["block_size"], case["max_seqs"])
    book = Book(case)
    for step in steps(case):
        arrive((mine,), case["requests"], step)
        book.arrived(step)
        got = decisions(mine.step(), {**case, "step": step})
        book.apply(step, got["scheduled"], got["preempted"])
        if after_step is not None:
            after_step(step, book, mine)
    return book


def blocks_follow_tokens(impl) -> None:
    def check(step, book, mine):
        at = {**book.case, "step": step}
        expected = book.blocks()
        if sum(expected.values()) > book.case["num_blocks"]:
            raise Failed(f"step {step}: blocks in use within the pool of {book.case['num_blocks']}",
                         expected=f"at most {book.case['num_blocks']}", got=expected, case=at)
        got = {req_id: mine.blocks_held(req_id) for req_id in expected}
        expect_equal(f"step {step}: blocks_held(req_id) of every request that has arrived", expected, got, at)

    @cases(100)
    @given(case=workloads(room=False))
    def prop(case):
        serve(impl, case, check)
    prop()


def no_starving(impl) -> None:
    @cases(100)
    @given(case=workloads(room=False))
    def prop(case):
        alone = [ceil_div(prompt + new - 1, case["block_size"]) for _, prompt, new in case["requests"]]
        case = {**case, "num_blocks": max(alone)}
        book = serve(impl, case)
        expect_equal(f"every request finishes within {len(steps(case))} steps (got: req_id: tokens made, of "
                     f"the unfinished ones)", {}, book.unfinished(), case)
    prop()


SECTION = "notebook 07, section 3 (The scheduler, one step at a time)"

TASK = Task("scheduler", "07", "scheduler.py",
            "One scheduler step: continuous batching, preempting the newest", (
    Check("with room for every request, each step is pagedlib's: the running, then arrivals up to max_seqs",
          with_room, SECTION),
    Check("on a small pool, each step is pagedlib's: the newest preempted, queued first; no overtaking",
          small_pool, SECTION + ": steps 2 and 3, and the trace after them"),
    Check("a request holds exactly the blocks its tokens fill, and never more than the pool in all",
          blocks_follow_tokens, SECTION + ": a new block when the last one is full; none once preempted"),
    Check("no request starves: on a pool that holds the largest request, every request finishes",
          no_starving, "notebook 07, section 7 (Concurrency against block size and budget; preemption)"),
))
