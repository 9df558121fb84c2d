def plan_step(running, waiting, token_budget, max_seqs, chunk_cap=None):
    cap = token_budget
    if chunk_cap is not None and len(running) + len(waiting) > 1:
        cap = chunk_cap
    seats = max_seqs - len(running)
    plan, left = [], token_budget
    for req_id, tokens in running + waiting[:seats]:
        n = min(tokens, left, cap)
        if n == 0:
            break
        plan.append((req_id, n))
        left -= n
    return plan
