"""Attention over a block table: the torch paths and the float64 oracle (``attention``), the fused Triton
decode kernel (``triton_decode``) and Triton's interpreter switch (``triton_mode``)."""
