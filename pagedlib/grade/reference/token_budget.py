"""pagedlib's answer to task ``token_budget``: ``Scheduler.schedule`` with a token budget, run on the state
given (``pagedlib_plan`` builds it in a pool that holds every request, then asks the real scheduler)."""

from pagedlib.grade.tasks.token_budget import pagedlib_plan


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    return pagedlib_plan(running, waiting, token_budget, max_seqs, chunk_cap)
