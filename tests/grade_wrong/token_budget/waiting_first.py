"""Catches: no running request is starved: each gets a token at every step, whatever prompts arrive

Admits the waiting requests before the running ones take their tokens: a long new prompt spends the budget
and the decodes wait."""


def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget
    if chunk_cap is not None and len(running) + len(waiting) > 1:
        cap = chunk_cap
    plan, left = [], token_budget
    for req_id, tokens in waiting[:max_seqs - len(running)] + running:
        n = min(tokens, left, cap)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    return plan
