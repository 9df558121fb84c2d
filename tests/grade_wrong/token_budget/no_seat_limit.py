"""Catches: a step stays within the budget, each request's tokens left and max_seqs

Counts the seats without the running requests: it admits up to max_seqs new ones whatever runs already."""


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget
    if chunk_cap is not None and len(running) + len(waiting) > 1:
        cap = chunk_cap
    plan, left = [], token_budget
    for req_id, tokens in running + waiting[:max_seqs]:
        n = min(tokens, left, cap)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    return plan
