"""Every load and store of a kernel run by Triton's interpreter, checked against the tensors it was given.

Inside ``with watch():`` each launch of an interpreted kernel records the tensors passed to it, at the
addresses the interpreter hands the kernel, and every load or store checks the addresses whose mask is true
(a masked-off lane touches nothing) before any memory is touched. An address that is no element of any of
those tensors raises ``OutOfBounds``, which says whether a load or a store went astray, from which program,
and which tensor it missed by how many elements; the access never happens, so a wild pointer cannot crash
the process or read another object's memory. Triton-Puzzles-Lite checks its puzzles by the same idea; this
is the course's own code for Triton 3.7.1's interpreter (``triton/runtime/interpreter.py``):
``GridExecutor._init_args_hst`` puts a launch's arguments on the host and ``interpreter_builder``'s
``create_masked_load`` and ``create_masked_store`` make every access, the unmasked ``tl.load``/``tl.store``
and block pointers included. Atomics are not watched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


class OutOfBounds(Exception):
    """A load or a store reached an address outside every tensor the kernel was given."""


@dataclass(frozen=True)
class Region:
    """One tensor argument: its name, first byte, element size, shape, and ``elements[i]``: True where the
    ``i``-th element-sized step from its first byte is one of its elements (a view's gaps are not)."""

    name: str
    start: int
    itemsize: int
    dtype: str
    shape: tuple[int, ...]
    elements: np.ndarray

    @property
    def end(self) -> int:                       # one byte past its last element
        return self.start + len(self.elements) * self.itemsize

    def holds(self, addresses: np.ndarray) -> np.ndarray:
        """True where an address is the first byte of one of this tensor's elements."""
        rel = addresses - self.start
        inside = (rel >= 0) & (rel < len(self.elements) * self.itemsize) & (rel % self.itemsize == 0)
        found = np.zeros(len(addresses), dtype=bool)
        found[inside] = self.elements[rel[inside] // self.itemsize]
        return found

    def describe(self) -> str:
        return f"{self.name} ({self.dtype} {list(self.shape)})"


def region(name: str, tensor: torch.Tensor) -> Region:
    """The ``Region`` of a (host) tensor, strided views included."""
    offsets = np.zeros(1, dtype=np.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    elements = np.zeros(int(offsets.max()) + 1 if offsets.size else 0, dtype=bool)
    elements[offsets] = True
    return Region(name, tensor.data_ptr(), tensor.element_size(), str(tensor.dtype).removeprefix("torch."),
                  tuple(tensor.shape), elements)


def missed_by(region: Region, address: int) -> tuple[int, str]:
    """How far ``address`` is from ``region``'s elements, in bytes, and in words."""
    if address < region.start:
        gap = region.start - address
        return gap, f"{count(-(-gap // region.itemsize), 'element')} before the start of {region.describe()}"
    if address >= region.end:
        gap = address - region.end + region.itemsize
        return gap, f"{count(-(-gap // region.itemsize), 'element')} past the end of {region.describe()}"
    return 0, f"between the elements of {region.describe()}, a view (a wrong stride?)"


def count(n: int, word: str) -> str:
    """``"1 element"``, ``"3 elements"``, ``"2 addresses"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def verdict(kind: str, addresses: np.ndarray, regions: list[Region], program: tuple[int, ...]) -> str | None:
    """``None`` if every address is an element of some region, else what went wrong, in words."""
    ok = np.zeros(len(addresses), dtype=bool)
    for r in regions:
        ok |= r.holds(addresses)
    bad = np.unique(addresses[~ok])
    if not len(bad):
        return None
    if not regions:
        return f"a {kind} of program {program} in a kernel given no tensor"
    # each stray address is charged to the tensor it is nearest to; the report names the farthest miss
    misses = []
    for address in bad.tolist():
        nearest = min(regions, key=lambda r: missed_by(r, address)[0])
        misses.append((missed_by(nearest, address), nearest))
    (_, where), _ = max(misses, key=lambda miss: miss[0][0])
    return (f"a {kind} of program {program} reaches {count(len(bad), 'address')} outside the tensors the "
            f"kernel was given, the farthest {where}: mask that {kind}, or fix its offsets")


@contextlib.contextmanager
def watch() -> Iterator[None]:
    """Check every load and store of the interpreted kernels launched inside the block (see the module)."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    builder = interpreter.interpreter_builder
    launch_args = executor._init_args_hst
    load, store = builder.create_masked_load, builder.create_masked_store
    regions: list[Region] = []

    def args_on_host(self, args_dev, kwargs):
        args_hst, kwargs_hst = launch_args(self, args_dev, kwargs)
        named = [*zip(self.arg_names, args_hst), *kwargs_hst.items()]
        regions[:] = [region(name, getattr(a, "base", a)) for name, a in named if hasattr(a, "data_ptr")]
        return args_hst, kwargs_hst

    def check(kind: str, ptrs, mask) -> None:
        lanes = np.broadcast_to(np.asarray(mask.data, dtype=bool), ptrs.data.shape)
        addresses = np.asarray(ptrs.data, dtype=np.uint64)[lanes].astype(np.int64)
        problem = verdict(kind, addresses, regions, tuple(builder.grid_idx))
        if problem:
            raise OutOfBounds(problem)

    def checked_load(ptrs, mask, other, *rest):
        check("load", ptrs, mask)
        return load(ptrs, mask, other, *rest)

    def checked_store(ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(ptrs, value, mask, *rest)

    executor._init_args_hst = args_on_host
    builder.create_masked_load = checked_load
    builder.create_masked_store = checked_store
    try:
        yield
    finally:
        executor._init_args_hst = launch_args
        builder.create_masked_load, builder.create_masked_store = load, store
