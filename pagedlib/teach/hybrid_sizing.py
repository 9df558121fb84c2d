"""KV-cache bytes of one sequence in a hybrid model (notebook 15): some layers attend to every token, the
others to a sliding window of the last ``window`` tokens. A paged cache with one block table for every layer
(uniform allocation) keeps every token in every layer; vLLM 0.32.0's hybrid manager gives the window layers
a table of their own and gives back the blocks their window no longer reads.

When a window layer's blocks go back, as vLLM 0.32.0 does it
(``vllm/v1/core/single_type_kv_cache_manager.py``: ``SlidingWindowManager.get_num_skipped_tokens`` and
``SingleTypeKVCacheManager.remove_skipped_blocks``, which ``KVCacheManager.allocate_slots`` calls before it
allocates the step's blocks): before a step that computes the tokens after the first ``c``, the next token,
at position ``c``, sees positions ``c - window + 1 .. c``, so the first ``c - window + 1`` tokens are skipped
and the ``(c - window + 1) // block_size`` blocks wholly among them become the null block. The step then
allocates blocks up to its last token. A sequence of ``n`` tokens whose last ``new`` tokens the step writes
thus holds, in a window layer,

    ceil(n / block_size) - max(0, n - new - window + 1) // block_size      blocks

(every block up to the last token, less the leading blocks wholly behind the window). One decode step
(``new = 1``) makes it ``ceil(n / b) - max(0, n - window) // b``; a whole prompt in one step (``new = n``)
frees nothing."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from pagedlib.core.groups import FULL, LAYER_KINDS, SLIDING, kv_groups, layers_per_group
from pagedlib.teach.sizing import MAX_SEQ_LEN
from pagedlib.util import as_int, ceil_div, refuse


@dataclass(frozen=True)
class HybridSpec:
    """What one sequence's KV bytes depend on in a model of full and sliding-window layers: each layer's
    kind (``layer_types[l]``, ``FULL`` or ``SLIDING``, as a transformers config's ``layer_types``), the
    ``sliding_window`` (tokens a sliding layer's query sees, itself included), the K/V shape of a layer and
    the longest sequence the model takes (``max_model_len``, tokens)."""

    name: str
    layer_types: tuple[str, ...]
    sliding_window: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int

    def __post_init__(self) -> None:  # the checks: a tuple of known kinds, positive ints
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        refuse((not self.layer_types, "layer_types must name at least one layer"))
        for i, kind in enumerate(self.layer_types):
            refuse((kind not in LAYER_KINDS, f"layer_types[{i}] must be one of {LAYER_KINDS}, got {kind!r}"))
        for field in ("sliding_window", "num_kv_heads", "head_dim", "max_model_len"):
            object.__setattr__(self, field, as_int(field, getattr(self, field), minimum=1))

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_sliding(self) -> int:
        """Layers that attend to a sliding window."""
        return self.layer_types.count(SLIDING)

    def layer_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V one token occupies in one layer: ``2 x num_kv_heads x head_dim x dtype_bytes``."""
        return 2 * self.num_kv_heads * self.head_dim * as_int("dtype_bytes", dtype_bytes, minimum=1)


def repeat_pattern(pattern: tuple[str, ...], num_layers: int) -> tuple[str, ...]:
    """``pattern`` repeated over ``num_layers`` layers, the last repeat cut short where it does not fit."""
    num_layers = as_int("num_layers", num_layers, minimum=1)
    refuse((not pattern, "pattern must name at least one layer kind"))
    return tuple(pattern[i % len(pattern)] for i in range(num_layers))


S, F = SLIDING, FULL
#: Released hybrid models. Each number is read from the source named beside it; ``max_model_len`` is the
#: context length the model was released with.
HYBRID_PRESETS: dict[str, HybridSpec] = {s.name: s for s in (
    # google-deepmind/gemma, gemma/transformer.py, TransformerConfig.gemma2_9b / gemma2_27b: 42 / 46 layers,
    # (LOCAL_SLIDING, GLOBAL) repeated, sliding_window_size 4096, num_kv_heads 8 / 16, head_dim 256 / 128.
    # Context 8192: transformers' Gemma2Config (models/gemma2/configuration_gemma2.py),
    # max_position_embeddings.
    HybridSpec("gemma-2-9b", repeat_pattern((S, F), 42), sliding_window=4096, num_kv_heads=8, head_dim=256,
               max_model_len=8192),
    HybridSpec("gemma-2-27b", repeat_pattern((S, F), 46), sliding_window=4096, num_kv_heads=16, head_dim=128,
               max_model_len=8192),
    # google-deepmind/gemma, gemma/transformer.py, TransformerConfig.gemma3_12b / gemma3_27b: 48 / 62 layers,
    # _GEMMA3_ATTENTION_PATTERN (5 x LOCAL_SLIDING, GLOBAL) repeated and cut short, sliding_window_size 1024,
    # num_kv_heads 8 / 16, head_dim 256 / 128. Context 131072: transformers' Gemma3TextConfig
    # (models/gemma3/configuration_gemma3.py), max_position_embeddings.
    HybridSpec("gemma-3-12b", repeat_pattern((S, S, S, S, S, F), 48), sliding_window=1024, num_kv_heads=8,
               head_dim=256, max_model_len=131072),
    HybridSpec("gemma-3-27b", repeat_pattern((S, S, S, S, S, F), 62), sliding_window=1024, num_kv_heads=16,
               head_dim=128, max_model_len=131072),
    # gpt-oss-120b: transformers' GptOssConfig defaults (models/gpt_oss/configuration_gpt_oss.py): 36 layers,
    # sliding then full in turn, sliding_window 128, num_key_value_heads 8, head_dim 64,
    # max_position_embeddings 131072 (the same numbers as openai/gpt-oss-120b's config.json, quoted in
    # github.com/alvarobartt/hf-mem/issues/60). gpt-oss-20b: openai/gpt-oss-20b's config.json as quoted in
    # github.com/ParagEkbote/hf-model-inspector, model_inspection_report.md: 24 layers, the rest the same.
    HybridSpec("gpt-oss-120b", repeat_pattern((S, F), 36), sliding_window=128, num_kv_heads=8, head_dim=64,
               max_model_len=131072),
    HybridSpec("gpt-oss-20b", repeat_pattern((S, F), 24), sliding_window=128, num_kv_heads=8, head_dim=64,
               max_model_len=131072),
    # mistralai/Ministral-8B-Instruct-2410's config.json as quoted in
    # github.com/abhibambhaniya/GenZ-LLM-Analyzer, GenZ/Models/Model_sets/mistral.py: 36 layers, 32 heads of
    # hidden 4096 (head_dim 4096 / 32 = 128), 8 KV heads, sliding_window 32768. The pattern, "1 full attention
    # layer followed by 3 sliding window attention layers", and the 128K context: transformers'
    # docs/source/en/model_doc/ministral.md, and the model card ("Context Length 128k", "Attention Pattern
    # Ragged (128k,32k,32k,32k)"). The order within the pattern changes no byte count here.
    HybridSpec("ministral-8b", repeat_pattern((F, S, S, S), 36), sliding_window=32768, num_kv_heads=8,
               head_dim=128, max_model_len=131072),
)}
del S, F


def window_blocks_held(seq_len: int, window: int | None, block_size: int, num_new_tokens: int = 1) -> int:
    """Blocks one layer's table holds (the null block not counted) for a sequence of ``seq_len`` tokens while
    the step that writes its last ``num_new_tokens`` runs: ``ceil(seq_len / block_size)``, less, for a
    sliding ``window`` (``None``: full attention), the leading blocks vLLM 0.32.0 has given back (module
    docstring). ``num_new_tokens`` is 1 for a decode step, ``seq_len`` for a whole prompt in one step."""
    seq_len = as_int("seq_len", seq_len, minimum=1, maximum=MAX_SEQ_LEN)
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_SEQ_LEN)
    num_new_tokens = as_int("num_new_tokens", num_new_tokens, minimum=0, maximum=seq_len)
    blocks = ceil_div(seq_len, block_size)  # every block up to the last token
    if window is None:
        return blocks
    window = as_int("window", window, minimum=1)
    computed = seq_len - num_new_tokens  # tokens in the cache before the step
    skipped = max(0, computed - window + 1)  # before the window of the token at position `computed`
    return blocks - skipped // block_size  # only blocks wholly behind the window go back


@dataclass(frozen=True)
class SequenceKV:
    """One sequence's KV-cache bytes three ways: ``uniform``, every layer keeps every token's block (one
    table for all layers); ``per_layer``, a sliding layer keeps only the blocks its window still reads;
    ``grouped``, the same in vLLM's KV-cache groups, where a block has room for the largest group's layers,
    so a group with fewer layers (padded) pays for its missing ones."""

    uniform: int
    per_layer: int
    grouped: int

    @property
    def saving(self) -> Fraction:
        """The share of ``uniform`` that window layers give back: ``1 - per_layer / uniform``."""
        return 1 - Fraction(self.per_layer, self.uniform)

    @property
    def grouped_saving(self) -> Fraction:
        """The share of ``uniform`` that vLLM's groups save: ``1 - grouped / uniform``, below 0 where the
        padding costs more than the windows give back (Gemma 3 27B below its window: ``1 - 70 / 62``)."""
        return 1 - Fraction(self.grouped, self.uniform)


def sequence_kv_bytes(spec: HybridSpec, seq_len: int, block_size: int, *, num_new_tokens: int = 1,
                      dtype_bytes: int = 2) -> SequenceKV:
    """The KV bytes one sequence of ``seq_len`` tokens holds while the step that writes its last
    ``num_new_tokens`` runs, uniform, per layer and in vLLM's groups (``SequenceKV``)."""
    if not isinstance(spec, HybridSpec):
        raise ValueError(f"spec must be a HybridSpec (HYBRID_PRESETS holds some), got {type(spec).__name__}")
    seq_len = as_int("seq_len", seq_len, minimum=1, maximum=spec.max_model_len)
    block_bytes = spec.layer_bytes_per_token(dtype_bytes) * as_int("block_size", block_size, minimum=1)

    def held(window: int | None) -> int:  # blocks of one layer (or one group's table)
        return window_blocks_held(seq_len, window, block_size, num_new_tokens)

    uniform = spec.num_layers * held(None)
    per_layer = sum(held(spec.sliding_window if kind == SLIDING else None) for kind in spec.layer_types)
    groups = kv_groups(spec.layer_types, spec.sliding_window, spec.num_layers)
    grouped = layers_per_group(groups) * sum(held(group.window) for group in groups)
    return SequenceKV(uniform * block_bytes, per_layer * block_bytes, grouped * block_bytes)
