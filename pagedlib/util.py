"""Neutral helpers every layer may use: it imports nothing from ``pagedlib``, so no layer reaches upward
through it."""

from __future__ import annotations

import operator


def as_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` (an int, numpy integer or one-element integer tensor, not a bool) as an ``int``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got a bool ({value!r})")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {result}")
    return result


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def refuse(*checks: tuple[object, str]) -> None:
    """``ValueError`` with the message of the first ``(condition, message)`` whose condition holds."""
    for bad, message in checks:
        if bad:
            raise ValueError(message)
