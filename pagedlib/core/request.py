"""A request to serve (notebooks 07 and 08), like nano-vllm's ``Sequence``."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlib.util import as_int, refuse


@dataclass(frozen=True)
class Request:
    """Arrives at step ``arrival`` with ``prompt_len`` tokens (ids in ``prompt_tokens``: prefix caching needs
    them), generates ``output_len``; its K/V peak at ``max_kv_len`` (the last token is never fed back)."""

    req_id: int
    arrival: int
    prompt_len: int
    output_len: int
    prompt_tokens: tuple[int, ...] | None = None

    def __post_init__(self) -> None:  # the argument checks, normalising numpy ints to ints
        for name, minimum in (("req_id", 0), ("arrival", 0), ("prompt_len", 1), ("output_len", 1)):
            object.__setattr__(self, name, as_int(name, getattr(self, name), minimum=minimum))
        if self.prompt_tokens is not None:
            tokens = tuple(as_int("prompt_tokens[i]", t, minimum=0) for t in self.prompt_tokens)
            refuse((len(tokens) != self.prompt_len,
                    f"prompt_tokens must hold prompt_len = {self.prompt_len} ids, got {len(tokens)}"))
            object.__setattr__(self, "prompt_tokens", tokens)

    @property
    def max_kv_len(self) -> int:
        return self.prompt_len + self.output_len - 1
