"""pagedlib's answer to task ``paged_attention``: notebook 04's vectorized decode path, whose signature is the
task's (its keyword-only extras, chunking and fp8 scales, keep their defaults)."""

from pagedlib.kernels.attention import paged_attention

__all__ = ["paged_attention"]
