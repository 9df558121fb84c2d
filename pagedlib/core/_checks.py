"""The core's argument checks, run before anything changes (metadata only: no device sync): the cache's
and a ``Request``'s, with the errors they raise and the text those show."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Iterable, Mapping, Sequence

import numpy as np
import torch

from pagedlib.core.groups import FULL, SLIDING, KVGroup, kv_groups
from pagedlib.util import as_int, refuse

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # the formats an fp8 cache stores (core/fp8.py)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, *FP8_DTYPES)  # f64: oracles
KV_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what an fp8 cache quantizes
BOOKKEEPING_BYTES_PER_BLOCK = 100  # Python per block: free-stack entry, reference count (measured peak)
MAX_CACHE_BYTES = 2**37  # a larger cache (pools + bookkeeping) is a typo: 128 GiB, about one H200's memory


class UnknownSequenceError(KeyError):
    """A sequence id that the cache does not hold (a ``KeyError``; ``args[0]`` is the id)."""

    def __init__(self, seq_id: Hashable, live: Iterable[Hashable] = ()) -> None:
        self.seq_id, self.live = seq_id, tuple(live)[:9]  # enough to show 8 and say whether there are more
        super().__init__(seq_id, self.live)

    def __str__(self) -> str:  # KeyError would print only repr(args)
        shown = ", ".join(repr(s) for s in self.live[:8]) + (", ..." if len(self.live) > 8 else "")
        return f"unknown sequence id {self.seq_id!r} (live sequences: [{shown}])"


class InvariantError(AssertionError):
    """``pagedlib.testing.check_invariants`` found the bookkeeping inconsistent (a bug, never bad input)."""


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than a call needs. Nothing was changed (``args`` survive pickle)."""

    def __init__(self, needed: int, free: int, what: str = "") -> None:
        super().__init__(needed, free, what)
        self.needed = needed
        self.free = free
        self.what = what

    def __str__(self) -> str:
        where = ""
        if self.what:
            where = f" for {self.what}"
        return f"out of KV blocks{where}: {self.needed} needed, {self.free} free"


def what_for(seq_ids: Sequence[Hashable], counts: Sequence[int]) -> str:
    """What ``reserve`` wanted blocks for, as ``OutOfBlocksError`` names it."""
    if len(seq_ids) != 1:
        return f"a batch of {len(seq_ids)} sequences"
    if counts[0] == 1:
        return f"sequence {seq_ids[0]!r}"
    return f"{counts[0]} tokens of sequence {seq_ids[0]!r}"


def new_cache(sizes: tuple, dtype: object, device: object, free_order: object, fill: object,
              prefix: object, kind: object = "hash") -> tuple[tuple[int, ...], list[int]]:
    sizes = tuple(as_int(n, x, minimum=1, maximum=2**31 - 1 if n == "num_blocks" else None)  # int32 tables
                  for n, x in zip(("num_blocks", "num_layers", "block_size", "kv_heads", "head_dim"), sizes))
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in SUPPORTED_DTYPES]}, got {dtype!r}")
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        raise ValueError(f"fill must be a real number, got {fill!r} ({type(fill).__name__})")
    if math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max:
        raise ValueError(f"fill must be representable in {dtype} (|fill| <= {torch.finfo(dtype).max:g}), "
                         f"got {fill!r}")
    if not isinstance(prefix, bool):
        raise ValueError(f"enable_prefix_caching must be a bool, got {prefix!r}")
    if not isinstance(kind, str) or kind not in ("hash", "radix"):
        raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {kind!r}")
    order = [as_int(f"free_order[{i}]", b, minimum=0, maximum=sizes[0] - 1)
             for i, b in enumerate([] if free_order is None else free_order)]
    if len(set(order)) != len(order):
        raise ValueError(f"free_order must not repeat a block id, got {order}")
    try:
        torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}") from e
    pools, book = 2 * math.prod(sizes) * dtype.itemsize, sizes[0] * BOOKKEEPING_BYTES_PER_BLOCK
    if pools + book > MAX_CACHE_BYTES:
        raise ValueError(f"num_blocks={sizes[0]} asks for {pools:,} bytes ({pools / 2**30:,.1f} GiB) of "
                         f"K and V pools {list(sizes)} and {book:,} bytes of bookkeeping, more than the "
                         f"{MAX_CACHE_BYTES / 2**30:.0f} GiB a cache may hold")
    return sizes, order


def seq(cache, seq_id: Hashable, name: str = "seq_id", new: bool = False) -> None:
    """A live ``seq_id`` (``new``: a fresh one, not ``None``), never a tensor."""
    if new and seq_id is None:
        raise ValueError(f"{name} must not be None (block_owners() uses None for a free block)")
    if isinstance(seq_id, torch.Tensor):  # hashed by identity: an equal tensor would never find it again
        raise ValueError(f"{name} must not be a torch.Tensor (tensors hash by identity); pass int({name})")
    if new and seq_id in cache.manager.seq_lens:  # also the TypeError of an unhashable id
        raise ValueError(f"{name} {seq_id!r} already exists")
    if not new and seq_id not in cache.manager.seq_lens:
        raise UnknownSequenceError(seq_id, cache.manager.seq_lens)


def token_ids(cache, name: str, token_ids: Sequence[int] | None, n: int | None = None) -> list[int] | None:
    """``n`` token ids (``None``: any number) as ints from a list, tuple, range or 1-d tensor, or ``None``."""
    if token_ids is None:
        if cache.manager.prefix_cache is not None and n:
            raise ValueError(f"{name} is required when prefix caching is on (blocks are found by them)")
        return None
    if isinstance(token_ids, (str, bytes, set, frozenset, Mapping)) or not hasattr(token_ids, "__len__"):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(token_ids).__name__}")
    values = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    ids = [as_int(f"{name}[{i}]", t, minimum=0) for i, t in enumerate(values)]
    if n is not None and len(ids) != n:
        raise ValueError(f"{name} must hold {n} token ids, one per token of K/V, got {len(ids)}")
    return ids


def live_ids(cache, seq_ids: Iterable[Hashable] | torch.Tensor, distinct: bool = False) -> list[Hashable]:
    """``seq_ids`` as a list (read once: generators work; a 1-d tensor gives its values), all live."""
    if isinstance(seq_ids, (set, frozenset, str, bytes)) or (
            isinstance(seq_ids, torch.Tensor) and seq_ids.dim() != 1):
        raise ValueError(f"seq_ids must be an ordered sequence of ids (list, tuple, 1-d tensor), "
                         f"got {type(seq_ids).__name__}")
    ids = seq_ids.tolist() if isinstance(seq_ids, torch.Tensor) else list(seq_ids)
    for s in ids:
        seq(cache, s)
    if distinct and len(set(ids)) != len(ids):
        dup = next(s for i, s in enumerate(ids) if s in ids[:i])
        raise ValueError(f"seq_ids must be distinct: {dup!r} appears more than once")
    return ids


def appended(cache, k: object, v: object, tokens: object, n: int | None = None,
             dims: str = "[num_layers, n, kv_heads, head_dim]", one: bool = False) -> list[int] | None:
    """K and V ``[num_layers, n, kv_heads, head_dim]`` (``n=None``: as ``k`` says; ``one``: a single token,
    ``[num_layers, kv_heads, head_dim]``): dense, the pools' dtype and device, no view of them; their ids."""
    if one:
        dims = "[num_layers, kv_heads, head_dim]"
    L, H, D = cache.num_layers, cache.kv_heads, cache.head_dim
    shape = (L, H, D) if one else (L, n, H, D)
    for name, t in zip(("k_vec", "v_vec") if one else ("k", "v"), (k, v)):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_nested:
            raise ValueError(f"{name} must be a dense torch.Tensor, got "
                             f"{f'layout {t.layout}' if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dim() != len(shape) or [g if d is None else d for d, g in zip(shape, t.shape)] != list(t.shape):
            want = ", ".join("n" if d is None else str(d) for d in shape)
            raise ValueError(f"{name} must have shape {dims} = [{want}], got {list(t.shape)}")
        fp8 = cache.dtype in FP8_DTYPES  # takes fp32/fp16/bf16 values and quantizes them on write
        if (t.dtype not in KV_INPUT_DTYPES if fp8 else t.dtype != cache.dtype) or t.device != cache.device:
            want = "float32, float16 or bfloat16" if fp8 else cache.dtype
            raise ValueError(f"{name} must have dtype {want} on device {cache.pool.device}, "
                             f"got {t.dtype} on {t.device}")
        if t.numel() and t.untyped_storage().data_ptr() in (cache.k.data_ptr(), cache.v.data_ptr()):
            raise ValueError(f"{name} must not be a view of the cache's own pools (pass a .clone())")
        shape = shape if one else (L, t.shape[1], H, D)  # v has as many tokens as k
    tokens = [as_int("token_id", tokens, minimum=0)] if one and tokens is not None else tokens
    return token_ids(cache, "token_id" if one else "token_ids", tokens, 1 if one else k.shape[1])


def chunks(cache, seq_ids: object, chunks: object) -> tuple[list, list[list[int]]]:
    """``reserving``'s arguments: distinct live sequences and one list of token ids (any length) for each."""
    ids = live_ids(cache, seq_ids, distinct=True)
    if isinstance(chunks, (str, bytes)) or not hasattr(chunks, "__len__") or len(chunks) != len(ids):
        raise ValueError(f"chunks must hold {len(ids)} lists of token ids, one per sequence, "
                         f"got {type(chunks).__name__}")
    if any(chunk is None for chunk in chunks):
        raise ValueError("chunks must hold lists of token ids, got None")
    return ids, [token_ids(cache, f"chunks[{i}]", chunk) for i, chunk in enumerate(chunks)]


def request_fields(request: object) -> None:
    """A new ``Request``'s fields, checked and made plain in place: ints, ``prompt_tokens`` a tuple."""
    request.req_id = as_int("req_id", request.req_id, minimum=0)
    request.arrival = as_int("arrival", request.arrival, minimum=0)
    request.prompt_len = as_int("prompt_len", request.prompt_len, minimum=1)
    request.output_len = as_int("output_len", request.output_len, minimum=1)
    if request.prompt_tokens is not None:
        tokens = tuple(as_int("prompt_tokens[i]", t, minimum=0) for t in request.prompt_tokens)
        if len(tokens) != request.prompt_len:
            raise ValueError(f"prompt_tokens must hold prompt_len = {request.prompt_len} ids, "
                             f"got {len(tokens)}")
        request.prompt_tokens = tokens


def page(tokens: Sequence[int], block_size: int) -> None:
    """A prefix cache's one block of token ids."""
    if len(tokens) != block_size:
        raise ValueError(f"tokens must hold block_size={block_size} token ids, got {len(tokens)}")


def position(cache, seq_id: Hashable, pos: object) -> int:
    """Token ``pos`` of live sequence ``seq_id``: ``0 <= pos < seq_len``."""
    seq(cache, seq_id)
    length = cache.seq_lens[seq_id]
    return index("pos", pos, 0, length, f" for sequence {seq_id!r} of length {length}")


def block_id(cache, block_id: object) -> int:
    return as_int("block_id", block_id, minimum=0, maximum=cache.num_blocks - 1)


def index(name: str, i: object, lo: int, hi: int, where: str = "") -> int:
    i = as_int(name, i)
    if not lo <= i < hi:
        raise IndexError(f"{name} must be in [{lo}, {hi}){where}, got {i}")
    return i


def width(tables: list[list[int]], width: object) -> int:
    longest = max(map(len, tables), default=0)
    width = longest if width is None else as_int("width", width)
    refuse((width < longest, f"width must be >= {longest} (the longest table), got {width}"))
    return width


# fp8 scales and inputs (core/fp8.py exports check_scale and check_scales: the kernels use them too)

def check_scale(name: str, scale: object, kv_heads: int | None = None,
                device: torch.device | str | None = None) -> float | torch.Tensor:
    """``scale`` as the functions here take it: a float from ``None`` (1.0), a number, a numpy scalar, a
    0-d tensor or array; a float32 ``[kv_heads]`` tensor on ``device`` from a 1-D tensor or array. Every
    value must be finite and > 0; a bool is refused (not taken as 1.0). ``ValueError`` naming ``name``."""
    if scale is None:
        return 1.0
    if isinstance(scale, float) and 0 < scale < math.inf:  # the common case: no tensor made
        return scale
    values = scale_values(name, scale, kv_heads)            # a checked tensor, [] or [kv_heads]
    if values.dim() == 0:
        return float(values)
    return values.to(device=device, dtype=torch.float32, copy=True)  # its own: the caller may change theirs


def check_scales(k_scale: object, v_scale: object, dtype: torch.dtype, kv_heads: int,
                 device: torch.device | str) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """A cache's ``(k_scale, v_scale)`` as ``check_scale`` returns them; a cache not in fp8 takes none."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and dtype not in FP8_DTYPES:
            raise ValueError(f"{name} needs a float8 dtype, got dtype {dtype}")
    k_scale = check_scale("k_scale", k_scale, kv_heads, device)
    v_scale = check_scale("v_scale", v_scale, kv_heads, device)
    return k_scale, v_scale


def scale_values(name: str, scale: object, kv_heads: int | None) -> torch.Tensor:
    """The values of a scale as a tensor (0-d or ``[kv_heads]``, where they were), each finite and > 0."""
    heads = "kv_heads"
    if kv_heads is not None:
        heads = f"kv_heads={kv_heads}"
    must = f"{name} must be None, a finite number > 0 or a tensor of {heads} of them"
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor, np.ndarray)):
        raise ValueError(f"{must}, got {scale!r} ({type(scale).__name__})")
    try:
        values = torch.as_tensor(scale).detach()
    except (TypeError, RuntimeError):  # a numpy array of objects or strings
        raise ValueError(f"{must}, got {scale!r}") from None
    if values.dtype == torch.bool or values.is_complex() or values.dim() > 1:
        raise ValueError(f"{must}, got a {values.dtype} tensor of shape {list(values.shape)}")
    if values.dim() == 1 and len(values) == 0:
        raise ValueError(f"{must}, got an empty tensor")
    if values.dim() == 1 and kv_heads is not None and len(values) != kv_heads:
        raise ValueError(f"{must}, got a tensor of shape {list(values.shape)}")
    smallest, largest = torch.aminmax(values)  # one pass (NaN propagates into both, then fails both tests)
    if not (float(smallest) > 0 and float(largest) < math.inf):
        raise ValueError(f"{must}, got {scale!r}")
    return values


def check_fp8_input(x: object, scale: object, dtype: torch.dtype | None = None) -> float | torch.Tensor:
    """``quantize``'s and ``dequantize``'s arguments: ``x`` a tensor, ``dtype`` (if given) an fp8 format,
    ``scale`` checked (a per-head one must match ``x``'s ``kv_heads``; it is moved to ``x``'s device)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor [..., kv_heads, head_dim], got {type(x).__name__}")
    if dtype is not None and dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    if x.dim() >= 2:
        return check_scale("scale", scale, x.shape[-2], x.device)
    scale = check_scale("scale", scale, None, x.device)
    if isinstance(scale, torch.Tensor):
        raise ValueError(f"a per-head scale needs x of shape [..., kv_heads, head_dim], got {list(x.shape)}")
    return scale


def groups(groups: object, num_layers: int) -> tuple:
    """A cache's KV-cache ``groups`` as a tuple: ``None`` (one full-attention group of every layer), or
    ``KVGroup``s (kind ``full_attention`` with no window, or ``sliding_attention`` with a window >= 1) whose
    layers cover ``range(num_layers)``, each layer once."""
    if groups is None:
        return kv_groups(None, None, num_layers)
    if isinstance(groups, (str, bytes, KVGroup)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(f"groups must be None or a non-empty sequence of KVGroup, got {groups!r}")
    seen: list[int] = []
    for g, group in enumerate(groups):
        if not isinstance(group, KVGroup):
            raise ValueError(f"groups[{g}] must be a KVGroup, got {type(group).__name__}")
        if group.kind == FULL and group.window is not None:
            raise ValueError(f"groups[{g}] is full attention and must have window None, got {group.window!r}")
        if group.kind == SLIDING:
            as_int(f"groups[{g}].window", group.window, minimum=1)
        elif group.kind != FULL:
            raise ValueError(f"groups[{g}].kind must be {FULL!r} or {SLIDING!r}, got {group.kind!r}")
        if not group.layers:
            raise ValueError(f"groups[{g}] must hold at least one layer")
        seen += [as_int(f"groups[{g}].layers[{i}]", layer, minimum=0, maximum=num_layers - 1)
                 for i, layer in enumerate(group.layers)]
    if sorted(seen) != list(range(num_layers)):
        raise ValueError(f"groups must hold every layer of num_layers={num_layers} exactly once, got layers "
                         f"{sorted(seen)}")
    return tuple(groups)
