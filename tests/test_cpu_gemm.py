"""Weights packed for oneDNN (``PagedLlama.pack_weights``, ``PackedLinear``): the products equal
``F.linear``'s to float32 rounding, the packed copy follows every change of the weight, a product that
needs gradients or a weight that left float32 takes ``F.linear``, packing is refused by name where it
cannot be done, and the engine's tokens with packed weights and the fused CPU kernel equal transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_greedy, oracle_prompts, tiny_hf_model

from pagedlib.kernels.cpu_gemm import PackedLinear
from pagedlib.model import PagedLlama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this PyTorch was built without oneDNN")


def packed_layer(inputs: int = 64, outputs: int = 96, seed: int = 0) -> PackedLinear:
    torch.manual_seed(seed)
    layer = PackedLinear(inputs, outputs, bias=False).requires_grad_(False)
    layer.pack()
    return layer


@pytest.mark.parametrize("rows", [1, 5, 32, 257])
def test_a_packed_product_equals_f_linear_to_rounding(rows):
    layer = packed_layer()
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.3e-6, atol=1e-5)
    assert layer(x[None]).shape == (1, rows, 96)                # any leading dimensions


def test_the_packed_copy_follows_every_change_of_the_weight():
    layer = packed_layer()
    x = torch.randn(7, 64)
    layer.weight.mul_(2.0)                                        # in place: a new version
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.3e-6, atol=1e-5)
    layer.load_state_dict({"weight": torch.randn(96, 64)})      # load_state_dict copies in place
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.3e-6, atol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(96, 64), requires_grad=False)  # a new tensor
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1.3e-6, atol=1e-5)


def test_gradients_and_other_dtypes_take_f_linear():
    layer = packed_layer()
    layer.weight.requires_grad_(True)
    x = torch.randn(3, 64)
    layer(x).sum().backward()                                     # the packed op has no backward pass
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(96, -1))
    half = packed_layer().to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    assert torch.equal(half(xb), F.linear(xb, half.weight))


def test_packing_is_refused_by_name_where_it_cannot_be_done():
    layer = PackedLinear(8, 8, bias=False).to(torch.float16)
    with pytest.raises(ValueError, match="packed for oneDNN as float32 on a CPU, got torch.float16 on cpu"):
        layer.pack()
    assert layer.packed is None


def test_the_engine_with_packed_weights_and_the_cpu_kernel_generates_transformers_tokens():
    from pagedlib.engine import Engine
    from pagedlib.kernels.cpu_varlen import cpu_kernel_available

    if not cpu_kernel_available()[0]:
        pytest.skip(cpu_kernel_available()[1])
    hf = tiny_hf_model()
    model = PagedLlama.from_hf(hf)
    assert model.pack_weights() is model
    assert all(m.packed is not None for m in model.modules() if isinstance(m, PackedLinear))
    prompts = oracle_prompts()
    engine = Engine(model, 96, 16, attention="cpu", max_num_batched_tokens=48)
    assert engine.generate(prompts, 10) == [hf_greedy(hf, p, 10)[0] for p in prompts]
