"""pagedlib: the code behind the paged-attention course.

Read it in the order the engine runs:

- ``core``     the paged KV cache, prefix caching (hashes and a radix tree), the request, the step
  scheduler and the connector contract, its one door outward (notebooks 02, 06, 08, 09, 11); KV-cache
  groups, a block table each, for a hybrid model's window and full layers (15)
- ``kv_transfer`` K/V beyond the device pool: the host tier and its policies, the file store, the
  connectors (13, 14)
- ``kernels``  attention through a block table: torch paths, a float64 oracle, the Triton kernel (04, 05),
  each with a sliding window (15)
- ``model``    ``PagedLlama``, a Llama decoder whose attention runs on the paged cache (08)
- ``engine``   ``Engine``: continuous batching and greedy generation on the scheduler (08)
- ``vllm``     vLLM itself: stepped beside ``Engine`` (``bridge``, 12), its offloading manager as the host
  tier's oracle (``offload``, 13), the connector it loads to share the store (``connector``, 14), its
  hybrid KV-cache manager driven without a model (``hybrid``, 15);
  ``disagg`` prefill on one engine and decode on another (14)
- beside the engine, on no request's path: ``testing`` (looks inside a cache: invariants, state_diff),
  ``figures`` (what notebooks read off a cache: tokens, utilization, hit rates, its printed text),
  ``checks`` (argument checks), ``loader`` (a transformers model read in),
  ``calibration`` (fp8 scales from data), ``stats`` (what an ``Engine`` did), ``util`` (neutral helpers),
  ``child`` (every Python child process: the vLLM worker, the decode engine of 14, the PTX compiler)
- ``sim``      the serving simulation (07, 09-11), with notebook 07's slab policies and sliding windows
- ``teach``    what only the notebooks need; ``bench`` the benchmark commands (``python -m pagedlib.bench``)
- ``grade``    the build-it-yourself track: its tasks, checks and grader (``python -m pagedlib.grade``)
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

# Without CUDA the kernels run through Triton's interpreter. Triton reads TRITON_INTERPRET once, at its first
# import, so it is set here, before any ``import triton``; a setting of the user's own wins.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
