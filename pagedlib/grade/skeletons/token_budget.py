"""Build it yourself, notebook 09: chunked prefill's token budget, how one step's tokens are shared out.

Write ``plan_step`` below, then grade it:  python -m pagedlib.grade token_budget
(or, in a notebook: ``from pagedlib.grade import grade; grade("token_budget")``).

The rule is that of pagedlib's ``Scheduler.schedule`` with ``max_num_batched_tokens`` (vLLM V1's), with
memory left out: the pool is taken to hold every request, so nobody is preempted and every admission
fits (notebook 07's task, ``scheduler``, is about the blocks).

Checked: your plans equal pagedlib's on generated states; a plan never takes more tokens than the budget,
more than a request has left or more seats than ``max_seqs``; the chunk cap applies only while more than
one request is running or waiting; and, served step after step over generated workloads, every running
request gets a token at every step, and a prompt longer than the budget arrives in chunks that sum to it.
"""


def plan_step(running: list[tuple[int, int]], waiting: list[tuple[int, int]], token_budget: int,
              max_seqs: int, chunk_cap: int | None = None) -> list[tuple[int, int]]:
    """Plan one step: which requests compute how many new tokens.

    ``running``: ``(req_id, tokens_left)`` of the running requests, oldest first (in the order they were
    admitted); ``tokens_left >= 1`` is what a request has still to compute: 1 when it decodes, more while
    its prompt is computed chunk by chunk. ``waiting``: ``(req_id, tokens)`` of the waiting requests in
    arrival order, ``tokens`` what each must compute when admitted (its whole prompt). ``token_budget``: the
    most tokens the step computes, all requests together. ``max_seqs``: the most requests running at once
    (``len(running) <= max_seqs``). ``chunk_cap``: the most tokens of one request a step takes, ``None``
    for no cap; it applies only while more than one request is running or waiting (``len(running) +
    len(waiting) > 1``): a request alone has nobody to starve.

    Running requests come first, in their order, each taking as many of its tokens left as the budget not
    yet spent (and the cap) allow; once the budget is spent, the others get nothing. Then waiting requests
    are admitted in arrival order, each with as many of its tokens as what is left of the budget (and the
    cap) allow, while budget is left and fewer than ``max_seqs`` requests run (the running ones count,
    whether or not they got tokens this step).

    Returns ``(req_id, num_tokens)`` for every request that computes tokens this step, ``num_tokens >= 1``,
    in that order: running ones, then admitted ones.
    """
    raise NotImplementedError
