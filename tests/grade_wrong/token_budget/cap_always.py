"""Catches: the chunk cap applies only while more than one request is running or waiting

Applies the chunk cap even to a request alone, which then takes more steps than it needs."""


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget if chunk_cap is None else chunk_cap
    plan, left = [], token_budget
    for req_id, tokens in running + waiting[:max_seqs - len(running)]:
        n = min(tokens, left, cap)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    return plan
