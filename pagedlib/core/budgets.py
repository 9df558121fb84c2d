"""KV budgets of the scheduler (notebook 07): ``PagedBudget`` takes blocks on demand (vLLM), ``SlabBudget``
a contiguous slab per request, first-fit (the vLLM paper's Orca baselines, §6.1): can it run, admit it now?"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedlib.core.cache import PagedKVCache
from pagedlib.core.request import Request
from pagedlib.util import as_int, ceil_div, refuse

POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")


class PagedBudget:
    """Blocks on demand (vLLM): a request holds the blocks its tokens fill and takes one more when its last
    block is full. Admission leaves ``watermark_blocks`` free for the running requests to grow into."""

    def __init__(self, cache: PagedKVCache, watermark: float, window: int | None) -> None:
        self.cache, self.block_size, self.window = cache, cache.block_size, window
        self.watermark_blocks = int(float(watermark) * cache.num_blocks)

    def blocks_alone(self, request: Request) -> int:
        """Blocks ``request`` needs to run alone: the most it ever holds, plus the watermark."""
        w, bs = self.window, self.block_size
        most = request.max_kv_len if w is None else min(request.max_kv_len, w + bs)  # see first_stored
        return ceil_div(most, bs) + self.watermark_blocks

    def decode_blocks(self, requests: Iterable[Request]) -> int:  # one per request whose last block is full
        return sum(self.cache.seq_lens[r.req_id] % self.block_size == 0 for r in requests)

    def reserve(self, request: Request, tokens: int, found: list[int], pending: int) -> int | None:
        """Blocks a prefill storing ``tokens`` takes beside the cached ``found``, or ``None`` if fewer than
        ``watermark_blocks`` stay free after ``pending`` (a found block nobody holds leaves the free ones)."""
        revived = sum(self.cache.ref_count(b) == 0 for b in found)
        new = ceil_div(tokens, self.block_size) - len(found)
        return new if self.cache.num_free_blocks - pending - new - revived >= self.watermark_blocks else None

    def release(self, request: Request) -> None:
        pass  # the cache frees the blocks


class FirstFit:
    """Contiguous slabs in ``capacity`` slots, each at the lowest address where it fits: freed slabs leave
    holes, and a request can be refused while enough slots are free in total (external fragmentation)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = as_int("capacity", capacity, minimum=1)
        self.slabs: dict[Hashable, tuple[int, int]] = {}  # key -> (start, size)

    def holes(self) -> list[tuple[int, int]]:  # the free runs (start, size), in address order
        holes, cursor = [], 0
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


class SlabBudget(FirstFit):
    """A slab per request, sized by ``policy`` on admission, placed first-fit; the cache only holds tokens."""

    def __init__(self, policy: str, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks * block_size)
        self.policy, self.block_size, self.max_model_len = policy, block_size, max_model_len

    def reservation(self, request: Request) -> int:
        """Slots set aside for ``request`` when it is admitted."""
        if self.policy == "reserve-max":
            return self.max_model_len
        if self.policy == "reserve-pow2":  # "if the true output length is 25, it reserves 32"
            return min(self.max_model_len, request.prompt_len + 2 ** (request.output_len - 1).bit_length())
        return request.max_kv_len  # reserve-oracle

    def blocks_alone(self, request: Request) -> int:
        return ceil_div(self.reservation(request), self.block_size)

    def decode_blocks(self, requests: Iterable[Request]) -> int:
        return 0  # the slab covers every token the request will write

    def reserve(self, request: Request, tokens: int, found: list[int], pending: int) -> int | None:
        """Place the request's slab (no blocks taken now: 0), or ``None`` if no hole holds it."""
        return None if self.allocate(request.req_id, self.reservation(request)) is None else 0

    def release(self, request: Request) -> None:
        self.free(request.req_id)


def check_policy(policy: object) -> str:
    refuse((policy not in POLICIES, f"policy must be one of {POLICIES}, got {policy!r}"))
    return str(policy)
