"""The vLLM paper's Orca baselines (notebook 07, its §6.1): a contiguous slab of memory per request, sized on
admission by a reservation policy and placed first fit. The simulation compares them with paging."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.core.scheduler import Scheduler
from pagedlib.util import as_int, ceil_div, refuse

POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")


class FirstFit:
    """Contiguous slabs in ``capacity`` slots, each at the lowest address where it fits: freed slabs leave
    holes, and a request can be refused while enough slots are free in total (external fragmentation)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = as_int("capacity", capacity, minimum=1)
        self.slabs: dict[Hashable, tuple[int, int]] = {}  # key -> (start, size)

    def holes(self) -> list[tuple[int, int]]:
        """The free runs ``(start, size)``, in address order."""
        holes = []
        cursor = 0
        for start, size in sorted(self.slabs.values()) + [(self.capacity, 0)]:
            if start > cursor:
                holes.append((cursor, start - cursor))
            cursor = start + size
        return holes

    def allocate(self, key: Hashable, size: int) -> int | None:
        """Place a slab of ``size`` slots in the first hole that holds it: its start, or ``None``."""
        refuse((key in self.slabs, f"{key!r} already holds a slab"))
        size = as_int("size", size, minimum=1)
        for start, room in self.holes():
            if room >= size:
                self.slabs[key] = (start, size)
                return start
        return None

    def free(self, key: Hashable) -> None:
        del self.slabs[key]

    @property
    def used_slots(self) -> int:
        return sum(size for _, size in self.slabs.values())

    @property
    def free_slots(self) -> int:
        return self.capacity - self.used_slots


class SlabScheduler(Scheduler):
    """The scheduler with a slab per request instead of blocks on demand: a request is admitted only if
    its slab, sized by ``policy``, fits in the ``kv_budget_blocks`` budget's slots, and never grows or is
    preempted. The cache stores the tokens only: it needs ``kv_budget_blocks + max_num_seqs`` blocks (a
    slab's tokens can straddle one block more). ``options``: ``Scheduler``'s, whole prompts only."""

    def __init__(self, cache: PagedKVCache, policy: str, *, kv_budget_blocks: int | None = None,
                 **options: Any) -> None:
        refuse((policy not in POLICIES[1:], f"policy must be one of {POLICIES[1:]}, got {policy!r}"))
        refuse((options.get("max_num_batched_tokens") is not None,
                "chunked prefill (max_num_batched_tokens) needs the 'paged' policy and no sliding_window"))
        super().__init__(cache, **options)
        self.policy = policy
        self.kv_budget_blocks = _slab_budget(cache, kv_budget_blocks, self.max_num_seqs)
        self.slots = FirstFit(self.kv_budget_blocks * self.block_size)

    def reservation(self, request: Request) -> int:
        """Slots set aside for ``request`` when it is admitted."""
        if self.policy == "reserve-max":
            return self.max_model_len
        if self.policy == "reserve-pow2":  # "if the true output length is 25, it reserves 32"
            output = 2 ** (request.output_len - 1).bit_length()
            return min(self.max_model_len, request.prompt_len + output)
        return request.max_kv_len  # reserve-oracle

    def blocks_alone(self, request: Request) -> int:
        return ceil_div(self.reservation(request), self.block_size)

    def blocks_for(self, request: Request, n: int) -> int:
        return 0  # the slab covers every token the request will write

    def fits(self, request: Request, found: list[list[int]], num_tokens: int) -> bool:
        """Place the request's slab (it then holds every token the request will write), or say no hole
        holds it."""
        return self.slots.allocate(request.req_id, self.reservation(request)) is not None

    def free(self, request: Request) -> None:
        super().free(request)
        self.slots.free(request.req_id)  # placed by fits, whether or not the sequence was added


def _slab_budget(cache: PagedKVCache, budget: object, max_num_seqs: int) -> int:
    """``kv_budget_blocks`` as an int (default: what the cache leaves after one spare block per request)."""
    if cache.prefix_cache is not None:
        raise ValueError("prefix caching needs the 'paged' policy (a contiguous slab is never shared)")
    if budget is None:
        budget = cache.num_blocks - max_num_seqs
        refuse((budget < 1, f"a reservation policy needs a cache of more than max_num_seqs = {max_num_seqs} "
                            f"blocks (one spare block per request), got num_blocks = {cache.num_blocks}"))
    budget = as_int("kv_budget_blocks", budget, minimum=1)
    refuse((cache.num_blocks < budget + max_num_seqs,
            "the cache stores a reservation policy's tokens and needs "
            f"kv_budget_blocks + max_num_seqs = {budget + max_num_seqs} blocks, it has {cache.num_blocks}"))
    return budget
