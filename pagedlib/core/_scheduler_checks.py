"""``Scheduler``'s and its callers' argument checks, run before anything changes. Apart from
``_checks.py`` (the cache's): these need ``PagedKVCache`` and ``Request``, which import that module."""

from __future__ import annotations

import numbers

from pagedlib.core import _checks as cache_checks
from pagedlib.core.cache import PagedKVCache
from pagedlib.core.connector import KVConnector
from pagedlib.core.request import Request, Status
from pagedlib.util import as_int, refuse


def scheduler(cache: object, max_num_seqs: object, budget: object, threshold: object, watermark: object,
              max_model_len: object, full_prompt_must_fit: object, connector: object
              ) -> tuple[int, int | None, int | None, int]:
    """The constructor's arguments: ``(max_num_seqs, max_num_batched_tokens, chunk cap, max_model_len)``
    as ints (the optional ones ``None`` or an int >= 1); ``cache`` an empty ``PagedKVCache``; ``connector``
    a ``KVConnector`` or ``None`` (one: vLLM chains several through its ``MultiConnector``)."""
    refuse((connector is not None and not isinstance(connector, KVConnector),
            f"connector must be a KVConnector or None, got {type(connector).__name__}"))
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    refuse((connector is not None and cache.manager.windows != (None,),
            f"connector with KV-cache groups {[str(group) for group in cache.groups]} is not supported yet "
            f"(one full-attention group only)"))
    if cache.seq_lens:
        raise ValueError(f"cache must be empty: it holds sequences {list(cache.seq_lens)[:8]}")
    fraction = isinstance(watermark, numbers.Real) and not isinstance(watermark, bool)
    if not fraction or not 0 <= watermark < 1:
        raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
    if not isinstance(full_prompt_must_fit, bool):
        raise ValueError(f"full_prompt_must_fit must be a bool, got {full_prompt_must_fit!r}")
    refuse((threshold is not None and budget is None,
            "long_prefill_token_threshold needs max_num_batched_tokens (a token budget)"))
    max_num_seqs = as_int("max_num_seqs", max_num_seqs, minimum=1)
    max_model_len = as_int("max_model_len", max_model_len, minimum=2)
    budget = _optional_int("max_num_batched_tokens", budget)
    threshold = _optional_int("long_prefill_token_threshold", threshold)
    return max_num_seqs, budget, threshold, max_model_len


def offered(tokens: object, most: int) -> None:
    """What a connector's ``get_num_new_matched_tokens`` answered: ``most`` tokens at most (never the
    last)."""
    good = isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0
    refuse((not good or tokens > max(most, 0),
            f"the connector offered {tokens!r} tokens: at most {max(most, 0)}, never the last token"))


def _optional_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    return as_int(name, value, minimum=1)


def admissible(scheduler: object, request: object) -> None:
    """``ValueError`` if the cache holds a sequence with ``request``'s id already (the cache is the
    scheduler's: a caller added one behind its back)."""
    cache_checks.seq(scheduler.cache, request.req_id, "req_id", new=True)


def new_request(scheduler: object, request: object) -> None:
    """``ValueError`` unless ``request`` is new, fits the model and, alone, the cache."""
    if not isinstance(request, Request):
        raise ValueError(f"request must be a Request, got {type(request).__name__}")
    if request.req_id in scheduler.requests:
        raise ValueError(f"request id {request.req_id} is already queued or running")
    if request.status is not Status.WAITING or request.output_tokens:
        raise ValueError(f"request {request.req_id} has run before: pass a new Request")
    if scheduler.cache.prefix_cache is not None and request.prompt_tokens is None:
        raise ValueError(f"request {request.req_id} has no prompt_tokens: prefix caching "
                         f"looks its blocks up by them")
    total = request.prompt_len + request.output_len
    if total > scheduler.max_model_len:
        raise ValueError(f"request {request.req_id}: prompt_len + output_len = {total} > "
                         f"max_model_len = {scheduler.max_model_len}")
    need = scheduler.blocks_alone(request)
    if need > scheduler.kv_budget_blocks:
        raise ValueError(f"request {request.req_id} needs {need} blocks, more than the "
                         f"budget of {scheduler.kv_budget_blocks}: it could never run")


def no_open_plan(scheduler: object) -> None:
    """Refuse a new plan, or a change to the queues, while a plan is open (neither updated nor undone)."""
    if scheduler.plan is not None:
        raise RuntimeError("a step's plan is open (schedule() returned it): update() it with the sampled "
                           "tokens, or undo() it, before anything else changes the scheduler")


def open_plan(scheduler: object, plan: object) -> None:
    """Refuse a plan that is not the open one: taken already, undone, or never made here."""
    if plan is None or plan is not scheduler.plan:
        raise ValueError("plan is not this scheduler's open plan: a plan is updated or undone once, "
                         "and only the latest schedule()'s")


def unfinished(scheduler: object, request: object) -> None:
    """Refuse to finish a request that is not waiting or running here."""
    if scheduler.requests.get(getattr(request, "req_id", None)) is not request:
        raise ValueError(f"request {getattr(request, 'req_id', request)!r} is not a waiting or running "
                         f"request of this scheduler (finished already?)")


def live_request(scheduler: object, req_id: object) -> Request:
    """The unfinished request ``req_id``, between steps."""
    no_open_plan(scheduler)
    request = scheduler.requests.get(req_id)
    if request is None:
        raise ValueError(f"req_id {req_id!r} is not a waiting or running request")
    return request


def sampled(sampled: object, n: int) -> list[int]:
    """``update``'s tokens as ints: one token id (>= 0) per row of the plan's work."""
    try:
        tokens = list(sampled)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"sampled must be a list of {n} token ids, got {type(sampled).__name__}") from None
    if len(tokens) != n:
        raise ValueError(f"sampled must hold {n} tokens, one per row of the plan, got {len(tokens)}")
    return [as_int(f"sampled[{i}]", token, minimum=0) for i, token in enumerate(tokens)]
