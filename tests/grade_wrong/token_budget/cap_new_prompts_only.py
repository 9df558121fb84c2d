"""Catches: a step's plan is pagedlib's: running requests first, in order, then waiting ones

Caps only a new prompt's first chunk: a running request part-way through its prompt takes all the budget
it can, as if the cap were about admission."""


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget
    if chunk_cap is not None and len(running) + len(waiting) > 1:
        cap = chunk_cap
    plan, left = [], token_budget
    for req_id, tokens in running:
        n = min(tokens, left)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    for req_id, tokens in waiting[:max_seqs - len(running)]:
        n = min(tokens, left, cap)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    return plan
