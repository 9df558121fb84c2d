"""Triton's interpreter mode: without CUDA, ``pagedlib`` sets ``TRITON_INTERPRET=1`` before triton's first
import and the kernels run through Triton's interpreter (numpy on the CPU)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
import triton.language as tl

_INTERPRETER_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------------------
# interpreter mode


def _modes() -> tuple[bool, bool]:
    """(triton's own library functions are interpreted, pagedlib's kernels are interpreted).

    Triton's library (``tl.sum``, ``tl.max``, ...) takes its mode when triton is first imported; a kernel
    takes it when it is decorated. The two differ when triton was imported before ``pagedlib`` set
    ``TRITON_INTERPRET=1``, and such a mix fails inside the interpreter with an obscure message."""
    from triton.runtime.interpreter import InterpretedFunction

    from pagedlib.kernels.triton_decode import _paged_decode_kernel

    return isinstance(tl.sum, InterpretedFunction), isinstance(_paged_decode_kernel, InterpretedFunction)


def interpreting() -> bool:
    """True when the kernels run through Triton's interpreter (numpy on the CPU)."""
    return all(_modes())


def check_mode() -> None:
    """Refuse the setups that cannot work, with a message that says how to fix them."""
    library, kernels = _modes()
    if library == kernels and (library or torch.cuda.is_available()):
        return
    raise RuntimeError(
        "paged_attention_triton: triton was imported in compiled mode"
        + (" before pagedlib could select its interpreter" if kernels else "")
        + (", and there is no CUDA device" if not torch.cuda.is_available() else "")
        + ". Triton fixes its mode when it is first imported, and importing torch._dynamo or torch.compile "
        "imports it. Import pagedlib before those, or set TRITON_INTERPRET=1 in the environment before "
        "starting Python."
    )


def interpreter_lock() -> contextlib.AbstractContextManager[Any]:
    """A process-wide lock while the kernels are interpreted (one launch at a time); compiled launches on
    a GPU need no lock and take none."""
    return _INTERPRETER_LOCK if interpreting() else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------------
