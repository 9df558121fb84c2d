"""Attention over a block table: the torch paths and the float64 oracle (``attention``), one forward pass's
flat batch of queries and its attention metadata (``varlen``), the fused Triton decode kernel
(``triton_decode``) and the unified one for decodes and prompt chunks (``triton_varlen``), Triton's
interpreter switch (``triton_mode``), the same loop in C for CPUs (``cpu_varlen``) and a CPU's matrix
products on weights packed for oneDNN (``cpu_gemm``)."""
