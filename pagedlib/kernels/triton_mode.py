"""Triton's interpreter switch. Without CUDA, ``pagedlib`` sets ``TRITON_INTERPRET=1`` before triton's
first import and the kernels run through Triton's interpreter (numpy on the CPU, one program at a time)."""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():  # decorated as the kernels are, right before them: it takes the mode they take
    pass


# Triton's library (tl.sum, ...) takes its mode when triton is first imported, a kernel when it is
# decorated; they differ when triton was imported before pagedlib could set TRITON_INTERPRET=1.
_LIBRARY = isinstance(tl.sum, InterpretedFunction)
_KERNELS = isinstance(_probe, InterpretedFunction)
_LOCK = threading.Lock()


def interpreting() -> bool:
    """True when the kernels run through Triton's interpreter."""
    return _LIBRARY and _KERNELS


def interpreter_lock() -> contextlib.AbstractContextManager:
    """Held by interpreted launches: the interpreter keeps global state while it runs a kernel."""
    if interpreting():
        return _LOCK
    return contextlib.nullcontext()


def check_mode() -> None:
    """Refuse the setups that cannot work, with a message that says how to fix them."""
    if _LIBRARY == _KERNELS and (_LIBRARY or torch.cuda.is_available()):
        return
    what = "paged_attention_triton: triton was imported in compiled mode"
    if _KERNELS:
        what += " before pagedlib could select its interpreter"
    if not torch.cuda.is_available():
        what += ", and there is no CUDA device"
    raise RuntimeError(what + ". Triton fixes its mode when it is first imported, and importing "
                       "torch._dynamo or torch.compile imports it. Import pagedlib before those, or set "
                       "TRITON_INTERPRET=1 in the environment before starting Python.")
