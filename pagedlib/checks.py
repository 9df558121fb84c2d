"""Small argument checks shared by every public entry point, so each fact is written once.

A hostile caller passes bools for ints, numpy scalars, floats that look like ints, huge sizes. Every
public function turns its integer arguments into plain Python ints here, at the boundary, so that later
arithmetic cannot wrap around (numpy ``int32`` does) and every error names the argument it is about.
"""

from __future__ import annotations

import operator

__all__ = ["as_int", "ceil_div"]


def as_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a plain Python ``int``, or ``ValueError`` naming ``name`` and what was expected.

    Accepted: ``int`` and integer scalars that implement ``__index__`` (numpy integers, one-element
    integer tensors). Rejected: ``bool`` (``True`` is not a size), floats (even ``3.0``), strings.
    """
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
    """``ceil(a / b)`` for ints ``a >= 0``, ``b >= 1``, exactly (no floats): e.g. blocks that hold
    ``a`` tokens at ``b`` tokens per block."""
    return -(-a // b)
