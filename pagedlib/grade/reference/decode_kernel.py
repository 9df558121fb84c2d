"""pagedlib's answer to task ``decode_kernel``: notebook 05's kernel, ``_paged_decode_kernel`` (a fuller
signature than the task's: split-K, fp8 scales, a stride for every dimension), launched by
``paged_attention_triton`` with one split."""

from pagedlib.kernels.triton_decode import _paged_decode_kernel as decode_kernel
from pagedlib.kernels.triton_decode import paged_attention_triton

__all__ = ["decode_attention", "decode_kernel"]


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits=1)
