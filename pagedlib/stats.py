"""``EngineStats``: what an ``Engine`` did since it was built, counted from each step's plan (notebooks 08,
09). Not on a request's path through the engine: nothing the engine decides reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedlib.core.scheduler import StepPlan


@dataclass
class EngineStats:
    """What the engine did since it was built."""

    steps: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0         # recomputed tokens count again
    cached_tokens: int = 0          # found in the prefix cache at admission: attached, not prefilled
    connector_tokens: int = 0       # loaded through the connector at admission: the host tier's hits and
                                    # swapped blocks (notebook 13), a store's entries (14); not prefilled
    load_failures: int = 0          # steps planned again because a connector's block failed to load
    recomputed_tokens: int = 0      # K/V a recomputing preemption threw away, computed again
    decode_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0            # most blocks held at once
    peak_running: int = 0           # most requests decoding or prefilling in one step
    finished: list[int] = field(default_factory=list)   # request ids, in finishing order

    def count(self, plan: StepPlan, used_blocks: int) -> None:
        """Add one step's ``plan`` (after the forward pass, before its tokens are appended: ``sampling``
        depends on it) and the blocks in use then."""
        self.steps += 1
        self.generated_tokens += len(plan.sampling)
        self.prefill_tokens += sum(n for _, n in plan.prefill)
        self.cached_tokens += plan.counts.cached_tokens
        self.connector_tokens += plan.counts.connector_tokens
        self.recomputed_tokens += plan.counts.recomputed_tokens
        self.decode_tokens += len(plan.decode)
        self.preemptions += len(plan.preempted)
        self.peak_blocks = max(self.peak_blocks, used_blocks)
        self.peak_running = max(self.peak_running, len(plan.work))  # partial chunks too
