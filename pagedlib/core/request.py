"""A request and everything the scheduler knows about it (notebooks 07-09), like nano-vllm's ``Sequence``
and vLLM's ``Request``. Its blocks live in the cache, under its ``req_id``."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedlib.core import _checks as checks
from pagedlib.core.prefix_cache import BlockKey, chained_keys


class Status(enum.Enum):
    WAITING = "waiting"      # queued, never admitted
    RUNNING = "running"      # holds blocks; decodes or prefills each step
    PREEMPTED = "preempted"  # lost its blocks; queued again, first
    FINISHED = "finished"    # all its tokens generated, or aborted


@dataclass
class Request:
    """Arrives at step ``arrival`` with ``prompt_len`` tokens (ids in ``prompt_tokens``: prefix caching
    and a real model need them) and generates ``output_len``. Its K/V peak at ``max_kv_len`` tokens: the
    last sampled token is never fed back. Requests compare by what they ask for, not by their state."""

    req_id: int
    arrival: int
    prompt_len: int
    output_len: int
    prompt_tokens: tuple[int, ...] | None = None

    def __hash__(self) -> int:
        return hash(self.req_id)

    def __post_init__(self) -> None:
        checks.request_fields(self)  # ints as ints, prompt_tokens a tuple of prompt_len ids
        # the state the scheduler changes: not fields, so neither compared nor shown
        self.output_tokens: list[int] = []  # sampled so far
        self.num_computed_tokens = 0  # K/V computed: stored, or found cached
        self.lost_tokens = 0  # K/V its last preemption threw away
        self.status = Status.WAITING
        self._keys: dict[int, list[BlockKey]] = {}  # per block size: its full blocks' keys so far

    @property
    def num_tokens(self) -> int:  # prompt and generated
        return self.prompt_len + len(self.output_tokens)

    @property
    def num_uncomputed_tokens(self) -> int:  # 1 while it decodes
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_kv_len(self) -> int:
        return self.prompt_len + self.output_len - 1

    @property
    def token_ids(self) -> list[int]:
        """The prompt's token ids, then the sampled ones."""
        if self.prompt_tokens is None:
            raise ValueError(f"request {self.req_id} has no prompt_tokens")
        return list(self.prompt_tokens) + self.output_tokens

    def block_keys(self, block_size: int, n: int) -> list[BlockKey]:
        """The chained keys of its first ``n`` full blocks (fewer if it has fewer), each made once: kept and
        extended as it grows, as vLLM's ``Request.block_hashes``. The prefix cache's lookups and the
        connectors read the same keys."""
        keys = self._keys.setdefault(block_size, [])
        if len(keys) < n:  # else nothing to make: not even the token list, which each call would build
            keys += chained_keys(self.token_ids, block_size, n, len(keys), keys[-1] if keys else None)
        return keys[:n]

    def next_token_ids(self, n: int) -> list[int]:
        """The ids of the ``n`` tokens after those computed."""
        start = self.num_computed_tokens
        return self.token_ids[start:start + n]
