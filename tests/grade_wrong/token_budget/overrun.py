"""Catches: a step stays within the budget, each request's tokens left and max_seqs

Overruns the budget: each request takes its tokens (up to the cap) as long as any budget is left, instead
of only what is left."""


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget
    if chunk_cap is not None and len(running) + len(waiting) > 1:
        cap = chunk_cap
    plan, left = [], token_budget
    for req_id, tokens in running + waiting[:max_seqs - len(running)]:
        if left <= 0:
            break
        n = min(tokens, cap)
        plan.append((req_id, n))
        left -= n
    return plan
