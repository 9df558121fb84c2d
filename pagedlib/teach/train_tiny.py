"""A tiny character-level Llama trained on Python's own documentation (``pydoc_data.topics``), so notebook 08
shows readable text. ``nice -n 10 python -m pagedlib.teach.train_tiny`` (seeded, one thread) writes it, and
``training.json`` (the run), to ``pagedlib/data/tiny_char_llama/``; tests and notebooks only load them.

``--hybrid`` trains its sibling for notebook 15 (``pagedlib/data/tiny_char_hybrid/``): four layers,
sliding-window and full attention in turn, as a transformers ``MinistralForCausalLM`` (Llama's weights plus
a config's ``layer_types`` and ``sliding_window``, the two fields vLLM's Llama/Mistral path reads too)."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedlib.checks import token_list
from pagedlib.model import PagedLlama

TINY_DIR = Path(__file__).parent.parent / "data" / "tiny_char_llama"
HYBRID_DIR = Path(__file__).parent.parent / "data" / "tiny_char_hybrid"
COMMAND = "nice -n 10 python -m pagedlib.teach.train_tiny"
HYBRID_LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
HYBRID_WINDOW = 48  # tokens a sliding layer sees (itself included): 3 blocks of 16, 1.5 of vLLM's CPU 32

# the few non-ASCII characters of the corpus, spelled in ASCII so the vocabulary stays printable ASCII
_ASCII = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                        "\u2014": "-", "\u2026": "...", "\u00df": "ss", "\u00b0": " degrees"})


class CharTokenizer:
    """One token per character; the vocabulary is a string (token id = index)."""

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars) or not chars:
            raise ValueError("chars must be a non-empty string of distinct characters")
        self.chars, self.index = chars, {c: i for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; ``ValueError`` naming the first character outside the vocabulary."""
        text = text.translate(_ASCII)
        if (bad := next((c for c in text if c not in self.index), None)) is not None:
            raise ValueError(f"character {bad!r} is not in the vocabulary")
        return [self.index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; ``ValueError`` for an id outside ``[0, len(self))`` (no wrap-around)."""
        return "".join(self.chars[i] for i in token_list("ids", ids, len(self.chars)))


def corpus() -> str:
    """Every topic of ``pydoc_data.topics``, in key order, in ASCII (~465k characters)."""
    from pydoc_data.topics import topics
    return "\n".join(topics[k] for k in sorted(topics)).translate(_ASCII)


@dataclass(frozen=True)
class TrainConfig:
    """The model's sizes and the training schedule (the same values make the same run)."""

    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2       # grouped-query attention: 2 query heads per KV head
    intermediate_size: int = 256
    context: int = 128          # training window
    max_positions: int = 512    # max_position_embeddings (rotary needs no table: generation may run longer)
    batch: int = 32
    steps: int = 500
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0
    threads: int = 1            # on 2 shared cores a second thread made each step ~5x slower (measured)
    layer_types: tuple[str, ...] | None = None  # the hybrid sibling's: a sliding window or full attention
    sliding_window: int | None = None


def _lr(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``cfg.lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    done = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def _loss(model: Any, data: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    """Mean next-character cross-entropy (nats) over the windows ``data[start : start + context + 1]``."""
    chunk = data[starts[:, None] + torch.arange(context + 1)]                       # [batch, context + 1]
    logits = model(input_ids=chunk[:, :-1]).logits                                   # [batch, context, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())


def train(cfg: TrainConfig, log: Any = print) -> tuple[Any, CharTokenizer, dict[str, Any]]:
    """Train a ``LlamaForCausalLM`` on ``corpus()`` (the last 5% held out): the model, the tokenizer and
    what the run measured (losses in nats per character, seconds)."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    tok = CharTokenizer("\n" + "".join(chr(c) for c in range(32, 127)))             # 96 characters
    data = torch.tensor(tok.encode(corpus()))
    train_data, val_data = data[:int(len(data) * 0.95)], data[int(len(data) * 0.95):]
    sizes = dict(vocab_size=len(tok), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                 num_key_value_heads=cfg.num_kv_heads, max_position_embeddings=cfg.max_positions,
                 bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = _hf_class(cfg.layer_types is not None)(sizes, cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g, start = torch.Generator().manual_seed(cfg.seed), time.perf_counter()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, step)
        starts = torch.randint(0, len(train_data) - cfg.context - 1, (cfg.batch,), generator=g)
        loss = _loss(model, train_data, starts, cfg.context)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}  {time.perf_counter() - start:6.1f} s")
    seconds = time.perf_counter() - start
    with torch.no_grad():
        val_starts = torch.arange(0, len(val_data) - cfg.context - 1, cfg.context)[:64]
        val_loss = _loss(model.eval(), val_data, val_starts, cfg.context).item()
    return model, tok, {"train_seconds": round(seconds, 1), "final_train_loss": round(loss.item(), 4),
                        "val_loss": round(val_loss, 4), "uniform_loss": round(math.log(len(tok)), 4)}


def config_record(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` as ``training.json`` records it: the hybrid fields only for the hybrid sibling."""
    record = dict(cfg.__dict__)
    if cfg.layer_types is None:
        del record["layer_types"], record["sliding_window"]
    else:
        record["layer_types"] = list(cfg.layer_types)
    return record


def _hf_class(hybrid: bool) -> Any:
    """A maker of the transformers model: ``LlamaForCausalLM``, or for the hybrid sibling
    ``MinistralForCausalLM`` with ``layer_types``, ``sliding_window`` and ``architectures`` set so that vLLM
    serves it with its Llama/Mistral path (its registry has no ``MinistralForCausalLM``)."""
    def make(sizes: dict[str, Any], cfg: TrainConfig) -> Any:
        if not hybrid:
            from transformers import LlamaConfig, LlamaForCausalLM
            return LlamaForCausalLM(LlamaConfig(**sizes))
        from transformers import MinistralConfig, MinistralForCausalLM
        config = MinistralConfig(**sizes, head_dim=cfg.hidden_size // cfg.num_heads,
                                 layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
                                 architectures=["MistralForCausalLM"])
        return MinistralForCausalLM(config)
    return make


def save(model: Any, tok: CharTokenizer, cfg: TrainConfig, stats: dict[str, Any], out: Path | str) -> None:
    """Write the weights, ``config.json``, ``vocab.json`` and ``training.json`` (the run) into ``out``."""
    from safetensors.torch import save_file
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    model.config.to_json_file(str(out / "config.json"))
    (out / "vocab.json").write_text(json.dumps({"chars": tok.chars}) + "\n")
    command = COMMAND + (" --hybrid" if cfg.layer_types else "")
    record = {"command": command, "config": config_record(cfg), **stats, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine()}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def load_tiny_hf(path: Path | str = TINY_DIR) -> tuple[Any, CharTokenizer]:
    """The committed weights in a ``transformers.LlamaForCausalLM`` (eval mode), and the tokenizer."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    if not ((path := Path(path)) / "model.safetensors").exists():
        raise FileNotFoundError(f"no tiny model under {path}: run `{COMMAND}` to make it")
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(path / "config.json")))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval(), CharTokenizer(json.loads((path / "vocab.json").read_text())["chars"])


def load_tiny_hybrid_hf(path: Path | str = HYBRID_DIR) -> tuple[Any, CharTokenizer]:
    """The committed hybrid sibling in a ``transformers.MinistralForCausalLM`` (eval mode; its config's
    ``layer_types`` and ``sliding_window`` say which layers see a window), and the tokenizer."""
    from safetensors.torch import load_file
    from transformers import MinistralConfig, MinistralForCausalLM
    if not ((path := Path(path)) / "model.safetensors").exists():
        raise FileNotFoundError(f"no tiny hybrid model under {path}: run `{COMMAND} --hybrid` to make it")
    model = MinistralForCausalLM(MinistralConfig.from_json_file(str(path / "config.json")))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval(), CharTokenizer(json.loads((path / "vocab.json").read_text())["chars"])


def load_tiny(path: Path | str = TINY_DIR, device: str = "cpu") -> tuple[PagedLlama, CharTokenizer]:
    """The committed tiny model as a ``PagedLlama`` (float32) and its tokenizer."""
    hf, tok = load_tiny_hf(path)
    return PagedLlama.from_hf(hf, device=device), tok


def load_tiny_hybrid(path: Path | str = HYBRID_DIR,
                     device: str = "cpu") -> tuple[PagedLlama, CharTokenizer]:
    """The committed hybrid sibling as a ``PagedLlama`` (float32; sliding and full layers), its tokenizer."""
    hf, tok = load_tiny_hybrid_hf(path)
    return PagedLlama.from_hf(hf, device=device), tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlib.teach.train_tiny", description=__doc__)
    parser.add_argument("--out", type=Path, default=None,
                        help=f"output folder (default: {TINY_DIR}, or {HYBRID_DIR} with --hybrid)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps, help="optimizer steps")
    parser.add_argument("--hybrid", action="store_true",
                        help="the hybrid sibling: 4 layers, sliding-window and full attention in turn")
    args = parser.parse_args(argv)
    cfg = TrainConfig(steps=args.steps)
    if args.hybrid:
        cfg = TrainConfig(steps=args.steps, num_layers=len(HYBRID_LAYERS), layer_types=HYBRID_LAYERS,
                          sliding_window=HYBRID_WINDOW)
    if args.out is None:
        args.out = HYBRID_DIR if args.hybrid else TINY_DIR
    model, tok, stats = train(cfg)
    save(model, tok, cfg, stats, args.out)
    print(json.dumps(stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
