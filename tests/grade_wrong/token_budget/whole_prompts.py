"""Catches: a prompt longer than the budget is split across steps, and its chunks sum to it

Admits a waiting request only if its whole prompt fits in what is left of the budget: a prompt longer than
the budget is never admitted."""


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget
    if chunk_cap is not None and len(running) + len(waiting) > 1:
        cap = chunk_cap
    plan, left = [], token_budget
    for req_id, tokens in running:
        n = min(tokens, left, cap)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    for req_id, tokens in waiting[:max_seqs - len(running)]:
        if tokens > min(left, cap):
            break
        plan.append((req_id, tokens))
        left -= tokens
    return plan
