"""Moving K/V against computing it again (notebook 13): the time to load a prefix's blocks over a link, and
the time to prefill it again, for a named model on a named accelerator. Every figure is a datasheet peak,
so each time is a lower bound; their ratio is what the notebook reads.

Loading ``n`` tokens in blocks of ``b`` costs ``ceil(n / b) * transfers_per_block * per_transfer`` (a fixed
cost per copy call: launching it, a DMA descriptor) plus ``n * kv_bytes_per_token / bandwidth``.
Recomputing costs the prefill's FLOPs, ``2 * params * n`` for the weights and ``2 * layers * q_dim * n**2``
for causal attention (``QK^T`` and ``PV``, 2 FLOPs a multiply-add, half the square), over the peak."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlib.util import ceil_div


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_second: float  # one direction
    source: str


#: Per direction. PCIe: 16 and 32 GT/s a lane, 16 lanes, 128b/130b encoding (PCI-SIG, PCI Express Base
#: Specification 4.0 and 5.0). NVLink-C2C: 900 GB/s between Grace and Hopper in both directions together
#: (NVIDIA GH200 Grace Hopper Superchip datasheet), 450 GB/s each way.
LINKS = {
    "PCIe 4.0 x16": Link("PCIe 4.0 x16", 16e9 * 16 * 128 / 130 / 8, "PCI-SIG, PCIe 4.0: 16 GT/s a lane"),
    "PCIe 5.0 x16": Link("PCIe 5.0 x16", 32e9 * 16 * 128 / 130 / 8, "PCI-SIG, PCIe 5.0: 32 GT/s a lane"),
    "NVLink-C2C": Link("NVLink-C2C", 450e9, "NVIDIA GH200 datasheet: 900 GB/s, both directions"),
}


@dataclass(frozen=True)
class Accelerator:
    name: str
    flops: float  # dense fp16/bf16 tensor-core peak, FLOP/s
    link: str     # how its host memory is reached: a key of ``LINKS``


#: NVIDIA's datasheets: A100 312 TFLOP/s (PCIe 4.0 host link), H100 SXM 989 TFLOP/s (PCIe 5.0), and the
#: GH200's H100 989 TFLOP/s with its Grace CPU's memory over NVLink-C2C.
ACCELERATORS = {
    "A100": Accelerator("A100", 312e12, "PCIe 4.0 x16"),
    "H100": Accelerator("H100", 989e12, "PCIe 5.0 x16"),
    "GH200": Accelerator("GH200", 989e12, "NVLink-C2C"),
}


@dataclass(frozen=True)
class Transformer:
    """What loading and recomputing a prefix depend on: the K/V per token and the prefill's FLOPs."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    q_heads: int
    params: float
    bytes_per_value: int = 2

    @property
    def kv_bytes_per_token(self) -> int:  # K and V, every layer
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.bytes_per_value

    def prefill_flops(self, tokens: float) -> float:
        q_dim = self.q_heads * self.head_dim
        return 2 * self.params * tokens + 2 * self.num_layers * q_dim * tokens ** 2


#: The course's running example (notebook 01): 32 layers, 8 KV heads, ``head_dim`` 128, fp16; Meta-Llama-3-8B
#: has this shape and 8.03 billion parameters (its ``config.json`` and model card).
LLAMA_3_8B = Transformer("32-layer GQA (Llama-3-8B)", num_layers=32, kv_heads=8, head_dim=128, q_heads=32,
                         params=8.03e9)


def load_seconds(model: Transformer, tokens: int, link: Link, *, block_size: int = 16,
                 per_transfer: float = 0.0, transfers_per_block: int = 1) -> float:
    """Lower bound on copying ``tokens`` tokens' K/V over ``link`` in blocks of ``block_size``."""
    copies = ceil_div(tokens, block_size) * transfers_per_block
    return copies * per_transfer + tokens * model.kv_bytes_per_token / link.bytes_per_second


def recompute_seconds(model: Transformer, tokens: int, accelerator: Accelerator) -> float:
    """Lower bound on prefilling ``tokens`` tokens again at the accelerator's peak."""
    return model.prefill_flops(tokens) / accelerator.flops


def load_over_recompute(model: Transformer, tokens: int, accelerator: Accelerator, **load: float) -> float:
    """How many times longer loading takes than recomputing (below 1: loading wins)."""
    link = LINKS[accelerator.link]
    return load_seconds(model, tokens, link, **load) / recompute_seconds(model, tokens, accelerator)


def crossover_tokens(model: Transformer, accelerator: Accelerator, *, block_size: int = 16,
                     per_transfer: float = 0.0, transfers_per_block: int = 1) -> float:
    """The prefix length from which loading beats recomputing (``ceil`` ignored): recomputing costs
    ``2 * params / flops`` a token plus a share that grows with the prefix (attention), loading a constant
    ``transfers_per_block * per_transfer / block_size + kv_bytes / bandwidth`` a token. 0: loading always
    wins."""
    link = LINKS[accelerator.link]
    load_per_token = transfers_per_block * per_transfer / block_size + \
        model.kv_bytes_per_token / link.bytes_per_second
    excess = load_per_token * accelerator.flops - 2 * model.params  # FLOPs a token attention must make up
    return max(0.0, excess / (2 * model.num_layers * model.q_heads * model.head_dim))
