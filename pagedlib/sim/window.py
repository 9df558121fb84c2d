"""Sliding windows (notebook 07): with a window of ``w`` positions (Mistral 7B: 4096) a block wholly before
the window of a sequence's newest token is never read again, so it goes back to the free stack."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler, StepPlan
from pagedlib.sim._checks import check_leading_blocks
from pagedlib.util import as_int, ceil_div, refuse


def release_leading_blocks(cache: PagedKVCache, seq_id: Hashable, n: int) -> list[int]:
    """Give back and return the first ``n`` blocks of ``seq_id`` (full, held by it alone): the sequence keeps
    its newest ``seq_len - n * block_size`` positions. Refused with prefix caching, whose keys chain each
    block to the one before it."""
    n = check_leading_blocks(cache, seq_id, n)
    manager = cache.manager
    blocks = manager.tables[seq_id][:n]
    del manager.tables[seq_id][:n]
    manager.seq_lens[seq_id] -= n * cache.block_size
    return manager.release(blocks)


def release_outside_window(cache: PagedKVCache, seq_id: Hashable, window: int) -> int:
    """Give back the leading blocks of ``seq_id`` wholly before the window of its newest token. Returns the
    number of positions released (a multiple of ``block_size``)."""
    window = as_int("window", window, minimum=1)
    behind = max(0, cache.seq_lens[seq_id] - window)  # KeyError for an unknown sequence
    dead = behind // cache.block_size
    if dead == 0:
        return 0
    return len(release_leading_blocks(cache, seq_id, dead)) * cache.block_size


def window_span_blocks(window: int, block_size: int) -> int:
    """The most blocks that ``window`` consecutive positions touch: ``ceil((window + block_size - 1) /
    block_size)``, reached when the window's first position is the last slot of a block."""
    window = as_int("window", window, minimum=1)
    return ceil_div(window + as_int("block_size", block_size, minimum=1) - 1, block_size)


def window_held_blocks(window: int, block_size: int) -> int:
    """The most blocks a request holds under ``WindowScheduler``: ``ceil((window + block_size) /
    block_size)``, ``ceil(window / block_size) + 1``. A step frees the blocks behind the window before it
    writes the step's token, so up to ``window + block_size - 1`` positions stay, plus the new one."""
    window = as_int("window", window, minimum=1)
    return ceil_div(window + as_int("block_size", block_size, minimum=1), block_size)


class WindowScheduler(Scheduler):
    """The scheduler for a model with a sliding window of ``sliding_window`` positions: each step first
    frees the blocks behind every running request's window, and a prefill stores only the blocks the
    window still sees (a real engine computes the rest too, in chunks, freeing blocks as it goes). A
    request's cache starts at position ``num_computed_tokens - seq_len``. Whole prompts only."""

    def __init__(self, cache: PagedKVCache, sliding_window: int, **options: Any) -> None:
        refuse((cache.prefix_cache is not None, "sliding_window cannot be combined with prefix caching (a "
                "cached block's key names the block before it, which the window would free)"))
        refuse((options.get("max_num_batched_tokens") is not None,
                "chunked prefill (max_num_batched_tokens) needs the 'paged' policy and no sliding_window"),
               (options.get("connector") is not None, "sliding_window takes no connector: the window frees "
                "the blocks a connector's keys chain through"))
        super().__init__(cache, **options)
        self.window = as_int("sliding_window", sliding_window, minimum=1)
        self.skipped_tokens = 0  # computed at admission but never stored: behind the window already

    def blocks_alone(self, request: Request) -> int:
        alone = ceil_div(request.max_kv_len, self.block_size)  # no more than its own length needs
        return min(alone, window_held_blocks(self.window, self.block_size))  # see first_stored

    def schedule(self) -> StepPlan:
        for request in self.running:
            release_outside_window(self.cache, request.req_id, self.window)
        return super().schedule()

    def first_stored(self, request: Request) -> int:
        """Where a prefill of ``request`` starts storing K/V: the first block its window still sees."""
        behind = max(0, request.num_tokens - self.window)
        return behind // self.block_size * self.block_size

    def cached_prefix(self, request: Request) -> tuple[list[list[int]], int, int]:
        return [[]], self.first_stored(request), 0  # the tokens before need no block; no connector

    def fits(self, request: Request, found: list[list[int]], num_tokens: int) -> bool:
        return super().fits(request, found, num_tokens - self.first_stored(request))

    def admission_tokens(self, request: Request) -> int:
        return super().admission_tokens(request) - self.first_stored(request)  # stored from first_stored on

    def attach(self, plan: StepPlan, request: Request, external: int) -> int:
        super().attach(plan, request, external)
        start = self.first_stored(request)
        self.skipped_tokens += start
        return start
