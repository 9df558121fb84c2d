"""The model's matrix products on a CPU as vLLM's CPU path runs them (notebook 08, section 6): on a copy of
each weight packed once for oneDNN, the library ``vllm/model_executor/layers/utils.py``'s
``dispatch_cpu_unquantized_gemm`` hands a CPU's large projections to (``create_onednn_mm``), here through
PyTorch's own build of it. ``F.linear`` on a CPU calls the BLAS PyTorch was built with (MKL on x86 wheels),
whose kernels differ by processor. The packed copy is a second copy of the weights: ``PagedLlama.
pack_weights`` makes it on request, never by default. ``project`` runs several projections of one input
(q, k and v; gate and up) as one product, as vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``
hold their weights side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PackedLinear(nn.Linear):
    """``nn.Linear`` that, once ``pack()``-ed, multiplies by its weight packed for oneDNN (float32, on a CPU).
    The packed copy is made again if the weight changes (its storage or its version counter: an in-place
    update, ``load_state_dict``); a weight that is no longer float32 on a CPU, or a product that needs
    gradients, takes ``F.linear``."""

    packed: tuple[tuple[int, int], torch.Tensor] | None = None   # (weight's storage and version, packed)
    joint: tuple[tuple, torch.Tensor] | None = None               # ``project``'s weights packed side by side

    def pack(self) -> None:
        """Pack the weight for oneDNN now (``ValueError`` where it cannot be: not float32 on a CPU, or a
        PyTorch built without oneDNN)."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError(f"weights are packed for oneDNN as float32 on a CPU, got {weight.dtype} on "
                             f"{weight.device}")
        if not torch.backends.mkldnn.is_available():
            raise ValueError("this PyTorch was built without oneDNN (torch.backends.mkldnn): nothing to pack "
                             "for")
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.packed = ((weight.data_ptr(), weight._version), packed)

    def plain(self) -> bool:
        """Whether a product must take ``F.linear``: not packed, no longer float32 on a CPU, or needing
        gradients (the packed product has no backward pass)."""
        weight = self.weight
        return (self.packed is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or (torch.is_grad_enabled() and weight.requires_grad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]``."""
        weight = self.weight
        if self.plain():
            return F.linear(x, weight, self.bias)
        if self.packed[0] != (weight.data_ptr(), weight._version):
            self.pack()                                   # the weight changed since it was packed
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[1], self.bias, "none", [], "")


def project(x: torch.Tensor, *layers: PackedLinear) -> tuple[torch.Tensor, ...]:
    """``x`` ``[..., in_features]`` through several projections of it (no bias), one output each: with
    packed weights one product on their weights packed side by side (made again if one of them changes),
    else one ``F.linear`` each."""
    if any(layer.plain() or layer.bias is not None for layer in layers):
        return tuple(layer(x) for layer in layers)
    first = layers[0]
    key = tuple((layer.weight.data_ptr(), layer.weight._version) for layer in layers)
    if first.joint is None or first.joint[0] != key:
        weight = torch.cat([layer.weight.detach() for layer in layers])      # [sum of out_features, in]
        first.joint = (key, torch.ops.mkldnn._reorder_linear_weight(weight, None))
    out = torch.ops.mkldnn._linear_pointwise(x, first.joint[1], None, "none", [], "")
    return out.split([layer.out_features for layer in layers], dim=-1)
