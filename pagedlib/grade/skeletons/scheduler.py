"""Build it yourself, notebook 07: one scheduler step, continuous batching with preemption by recomputation.

Write the class below, then grade it:  python -m pagedlib.grade scheduler
(or, in a notebook: ``from pagedlib.grade import grade; grade("scheduler")``).

It holds block COUNTS only (no K/V, no block ids) and decides what pagedlib's ``Scheduler`` decides in its
simplest configuration: whole prompts (no token budget), no prefix caching, no watermark. Requests are
added between steps; each ``step()`` plans one step and runs it: every scheduled request produces one token.

Checked: workloads are generated (requests arriving at given steps, prompt and output lengths, a pool small
enough to force preemption, ``max_seqs``) and served by your scheduler and pagedlib's side by side: every
step's decisions must be equal. A failure shows the smallest such workload: ``requests`` as
``(arrival step, prompt_len, max_new_tokens)``, each request's ``req_id`` its position in that list (added
in that order), and the step that differs. Also checked: ``blocks_held`` against the tokens your own
decisions gave each request, never more blocks in use than the pool, and, on a pool that holds the
largest request, every request finishing with its tokens.
"""


class Scheduler:
    """Continuous batching over a pool of ``num_blocks`` blocks of ``block_size`` tokens; at most ``max_seqs``
    requests run at once."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int) -> None:
        raise NotImplementedError

    def add(self, req_id: int, prompt_len: int, max_new_tokens: int) -> None:
        """A request arrives: it joins the back of the waiting queue. ``prompt_len >= 1``, ``max_new_tokens >=
        1``; the grader adds only requests that fit the pool alone at their longest (``prompt_len +
        max_new_tokens - 1`` tokens of K/V: the last token produced is never fed back)."""
        raise NotImplementedError

    def step(self) -> tuple[list[int], list[int]]:
        """Plan one step, run it, and return ``(scheduled, preempted)``: the ids of the requests that compute
        this step (the running ones in their order, then the admitted ones in theirs), and of those preempted
        (in the order they were preempted). A running request holds ``prompt_len + made - 1`` tokens of K/V,
        ``made`` the tokens it has produced, in as few blocks as hold them.

        1. The running requests, oldest first (in the order they were admitted), each compute one token:
           one whose blocks are full (its tokens a multiple of ``block_size``) needs a new block. While none
           is free, the request at the END of the running list is preempted: it frees all its blocks and goes
           to the FRONT of the waiting queue, keeping the tokens it made (so of two preempted in one step,
           the one preempted last comes back first). If the request needing the block is itself preempted,
           the running requests' part of the step ends there.
        2. Only if nobody was preempted in this step: waiting requests are admitted from the front of the
           queue while fewer than ``max_seqs`` requests run. One is admitted if blocks for all its tokens,
           its prompt and the tokens it made before a preemption (all computed again), are free; the first
           one that does not fit stops admission (no one overtakes it). An admitted request joins the end of
           the running list and takes its blocks.
        3. Every scheduled request has produced one token. A request that has produced ``max_new_tokens``
           tokens is finished: it leaves, and its blocks are free for the next step.
        """
        raise NotImplementedError

    def blocks_held(self, req_id: int) -> int:
        """The blocks request ``req_id`` holds now: 0 while it waits, once preempted, and once finished."""
        raise NotImplementedError
