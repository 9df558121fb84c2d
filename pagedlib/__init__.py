"""pagedlib: the code behind the paged-attention course.

Modules (each notebook imports from exactly one or two of them):

- ``sizing``            KV-cache memory math and model presets (notebook 01)
- ``cache``             ``PagedKVCache``: block pool, free stack, block tables (02), sharing blocks (06)
- ``prefix_cache``      block keys and LRU eviction for prefix caching (notebook 06)
- ``tracer``            ``BlockTableTracer`` widget (notebook 03)
- ``attention``         reference, vectorized paged and contiguous attention (notebook 04)
- ``triton_attention``  the fused Triton decode kernel (notebook 05)
- ``serving``, ``window``  workloads, the step-level scheduler, sliding windows (notebook 07)
- ``triton_tools``      Triton's interpreter mode and compiling the kernels for a GPU without one (05)
- ``plots``, ``bench``, ``notebook``  figures, benchmarks, notebook helpers
"""

from __future__ import annotations

import os

__version__ = "0.1.0"


def _choose_triton_mode() -> None:
    """Run Triton kernels through its interpreter when there is no CUDA device.

    Triton reads ``TRITON_INTERPRET`` once, when it is first imported, so this must run before any
    ``import triton``. An explicit setting by the user always wins.
    """
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_choose_triton_mode()
