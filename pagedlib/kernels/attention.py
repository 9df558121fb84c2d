"""Attention through block tables (notebook 04): the article's per-token oracle ``reference_paged_attention``,
the vectorized decode ``paged_attention``, ``paged_prefill_attention``, the SDPA baseline
``contiguous_attention`` and the float64 ``paged_attention_oracle``. GQA: query head ``h`` uses KV head
``h // (q_heads // kv_heads)``. Inputs are only read; slots that hold no token (NaN included) never reach a
result."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedlib.core.fp8 import per_head
from pagedlib.kernels import _checks
from pagedlib.kernels._checks import check_paged_inputs, check_scales
from pagedlib.util import as_int, ceil_div

#: ``assert_close(a, b, **TOLERANCES[dtype])`` between two outputs: the article's absolute tolerances plus
#: about one unit in the last place (a bf16 output above 1 has an ulp of 0.0078, more than 5e-3 alone).
TOLERANCES = {torch.float32: {"atol": 1e-5, "rtol": 1.3e-6}, torch.float16: {"atol": 1e-3, "rtol": 1e-3},
              torch.bfloat16: {"atol": 5e-3, "rtol": 1.6e-2}}
#: Limits of ``rel_error(out, paged_attention_oracle(...))`` for a kernel's output of each dtype.
REL_ERROR_LIMITS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
GPU_CHUNK_BYTES = 64 * 2**20  # paged_attention's default chunk_bytes off the CPU


def softmax_scale(head_dim: int, scale: object = None) -> float:
    """``head_dim ** -0.5``, or ``scale`` checked to be a finite number > 0."""
    if scale is None:
        return head_dim**-0.5
    return _checks.check_number("scale", scale)


def kv_bytes(seq_lens: torch.Tensor | list[int], kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step must read, ``2 * sum(seq_lens) * kv_heads * head_dim * itemsize``."""
    lens = seq_lens
    if isinstance(seq_lens, torch.Tensor):
        lens = seq_lens.tolist()
    tokens = sum(as_int(f"seq_lens[{i}]", n, minimum=0) for i, n in enumerate(lens))
    kv_heads = as_int("kv_heads", kv_heads, minimum=1)
    head_dim = as_int("head_dim", head_dim, minimum=1)
    return 2 * tokens * kv_heads * head_dim * dtype.itemsize


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64, compared with ``REL_ERROR_LIMITS``."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def reference_paged_attention(cache, seq_id, q: torch.Tensor) -> torch.Tensor:
    """Decode attention for one sequence of a ``PagedKVCache``, every layer, the slow and obvious way:
    ``q`` ``[num_layers, 1, q_heads, head_dim]`` (the newest position's query) -> the same shape."""
    _checks.check_reference(cache, seq_id, q)
    _, num_layers, _, kv_heads, head_dim = cache.k.shape       # [num_blocks, L, block_size, kv_heads, D]
    seq_len = cache.seq_lens[seq_id]
    blocks = cache.tables[seq_id]

    # 1. gather, one token at a time: position p lives in block blocks[p // block_size], slot p % block_size
    k_full = cache.k.new_empty(num_layers, seq_len, kv_heads, head_dim)      # [L, seq_len, kv_heads, D]
    v_full = torch.empty_like(k_full)
    for pos in range(seq_len):
        block = blocks[pos // cache.block_size]
        offset = pos % cache.block_size
        k_full[:, pos] = cache.k[block, :, offset]                             # [L, kv_heads, D]
        v_full[:, pos] = cache.v[block, :, offset]

    # 2. GQA: repeat every KV head for the `group` query heads that share it
    group = q.shape[2] // kv_heads
    k_exp = k_full.repeat_interleave(group, dim=2)                             # [L, seq_len, q_heads, D]
    v_exp = v_full.repeat_interleave(group, dim=2)

    # 3. attention, accumulated in (at least) float32 as real kernels do, rounded once at the end
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("lqhd,lkhd->lhqk", q.to(acc), k_exp.to(acc)) * softmax_scale(head_dim)
    probs = torch.softmax(scores, dim=-1)                                      # [L, q_heads, 1, seq_len]
    return torch.einsum("lhqk,lkhd->lqhd", probs, v_exp.to(acc)).to(q.dtype)  # [L, 1, q_heads, D]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float | None = None, *, chunk_bytes: float | None = None,
                    k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """One decode step of one layer for a batch of sequences of different lengths.

    Args:
        q: ``[batch, q_heads, head_dim]``, the query of each sequence's newest position.
        k_cache, v_cache: ``[num_blocks, block_size, kv_heads, head_dim]`` (e.g. ``cache.layer(l)``).
        block_tables, seq_lens: int32 ``[batch, max_blocks]`` padded with -1, int32 ``[batch]`` (>= 1).
        scale: softmax scale; default ``head_dim ** -0.5``.
        chunk_bytes: bound on each chunk's gathered K+V copy (``plan_chunks``); default by device.
        k_scale, v_scale: an fp8 cache's scales, a float or ``[kv_heads]`` (``pagedlib.core.fp8``).
    Returns:
        ``[batch, q_heads, head_dim]``, like ``q``.
    """
    _, _, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)
    scale = softmax_scale(head_dim, scale)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    budget = default_chunk_bytes(q.device)
    if chunk_bytes is not None:
        budget = _checks.check_number("chunk_bytes", chunk_bytes, zero_ok=True)
    lens = seq_lens.tolist()
    bytes_per_token = 2 * kv_heads * head_dim * q.element_size()              # K and V, in q's dtype
    out = torch.empty_like(q)                                                  # [batch, q_heads, D]
    for chunk in plan_chunks(lens, block_size, bytes_per_token, budget):
        rows = slice(chunk.start, chunk.stop)
        out[rows] = attend_chunk(q[rows], k_cache, v_cache, block_tables[rows], seq_lens[rows], lens[rows],
                                 scale, k_scale=k_scale, v_scale=v_scale)
    return out


def attend_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 seq_lens: torch.Tensor, lens: list[int], scale: float, window: int | None = None,
                 k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``paged_attention`` for a chunk of ``c`` sequences (checked inputs; ``lens`` is ``seq_lens`` as a
    list; ``window``: see ``sliding_window_attention``). ``q`` ``[c, q_heads, head_dim]`` -> the same."""
    c, q_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    n = max(lens)                                       # every sequence is padded to the longest
    n_blocks = ceil_div(n, block_size)

    # 1. gather whole blocks, in float32 (an fp8 cache times its scales, checked by the caller). Table
    #    entries past a sequence's last block (-1 padding) become block 0: gathered like the others, then
    #    masked.
    used = torch.arange(n_blocks, device=q.device) * block_size < seq_lens[:, None]  # [c, n_blocks]
    ids = torch.where(used, tables[:, :n_blocks], 0).long()                        # [c, n_blocks]
    k = _gather(k_cache, ids, n).float() * per_head(k_scale)                       # [c, n, kv_heads, D]
    v = _gather(v_cache, ids, n).float() * per_head(v_scale)
    k = k.transpose(1, 2)                                                          # [c, kv_heads, n, D]
    v = v.transpose(1, 2)

    # 2. scores with grouped heads: the `group` query heads of a KV head are rows of one matrix
    qg = q.reshape(c, kv_heads, q_heads // kv_heads, head_dim).float() * scale    # [c, kv_heads, group, D]
    scores = torch.matmul(qg, k.transpose(2, 3))                                   # [c, kv_heads, group, n]

    # 3. mask positions at or past each length: replace the score (a NaN key gives a NaN score) and zero
    #    the V row (0 * NaN is NaN). A chunk of equal lengths has nothing to mask.
    if min(lens) < n or window is not None:
        pos = torch.arange(n, device=q.device)                                     # [n]
        ends = seq_lens[:, None]                                                   # [c, 1]
        invalid = pos >= ends                                                      # [c, n]
        if window is not None:
            invalid = invalid | (pos < ends - window)
        scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
        v = v.masked_fill(invalid[:, None, :, None], 0.0)

    # 4. softmax, then the second matmul
    out = torch.matmul(torch.softmax(scores, dim=-1), v)                           # [c, kv_heads, group, D]
    return out.reshape(c, q_heads, head_dim).to(q.dtype)


def _gather(cache: torch.Tensor, ids: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Blocks ``ids`` (int64 ``[c, n_blocks]``) of ``cache``, one ``index_select``: ``[c, n_tokens, ...]``."""
    c, n_blocks = ids.shape
    blocks = cache.index_select(0, ids.reshape(-1))               # [c * n_blocks, block_size, kv_heads, D]
    return blocks.view(c, n_blocks * cache.shape[1], *cache.shape[2:])[:, :n_tokens]


def default_chunk_bytes(device: torch.device) -> int:
    """0 on a CPU (one sequence per chunk: its copy is still in the processor's cache for the matmuls, and
    nothing is padded); ``GPU_CHUNK_BYTES`` (64 MiB) elsewhere: few launches, bounded memory."""
    if device.type == "cpu":
        return 0
    return GPU_CHUNK_BYTES


def plan_chunks(seq_lens: list[int], block_size: int, bytes_per_token: int,
                chunk_bytes: float) -> list[range]:
    """Cut a batch into chunks of consecutive sequences for ``paged_attention``. A chunk's copy is padded to
    its longest sequence; a sequence joins the chunk while that copy stays within ``chunk_bytes`` and within
    twice the blocks the chunk's sequences hold (so even ``math.inf`` pads no more than they need)."""
    if not seq_lens:
        return []
    chunks = []
    start = 0  # the open chunk's first sequence
    width = 0  # its padded tokens per sequence
    own = 0    # the tokens its sequences' blocks hold
    for i, n in enumerate(seq_lens):
        padded = ceil_div(n, block_size) * block_size
        copy = (i + 1 - start) * max(width, padded)     # tokens of the chunk's copy with sequence i in it
        if i > start and (copy * bytes_per_token > chunk_bytes or copy > 2 * (own + padded)):
            chunks.append(range(start, i))
            start = i
            width = 0
            own = 0
        width = max(width, padded)
        own += padded
    chunks.append(range(start, len(seq_lens)))
    return chunks


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_len: int,
                            scale: float | None = None, *, k_scale: float | torch.Tensor = 1.0,
                            v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Causal attention for the last ``n`` positions of one sequence whose K/V are in the cache: ``q``
    ``[n, q_heads, head_dim]`` -> the same shape. ``block_table``: int32 ``[max_blocks]`` (padding allowed);
    ``seq_len``: tokens stored, the queries' own included (``n == seq_len``: a prompt's prefill; ``n <
    seq_len``: a chunk after earlier tokens, query ``i`` at position ``seq_len - n + i``)."""
    seq_len = _checks.check_prefill(q, k_cache, v_cache, block_table, seq_len)
    scale = softmax_scale(q.shape[2], scale)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    n = q.shape[0]
    ids = block_table[None, : ceil_div(seq_len, k_cache.shape[1])].long()     # [1, n_blocks]
    k = (_gather(k_cache, ids, seq_len).float() * per_head(k_scale)).to(q.dtype)  # [1, len, kv_heads, D]
    v = (_gather(v_cache, ids, seq_len).float() * per_head(v_scale)).to(q.dtype)
    # 4-D [1, heads, tokens, D] views: SDPA's fused CPU kernel takes 4-D inputs only
    k = k.transpose(1, 2)                                                      # [1, kv_heads, len, D]
    v = v.transpose(1, 2)
    qh = q.transpose(0, 1)[None]                                               # [1, q_heads, n, D]
    if n == seq_len:  # a whole prompt: SDPA's own causal mask
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:             # a chunk after earlier tokens: query i at position seq_len - n + i
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]   # [n, 1]
        mask = torch.arange(seq_len, device=q.device) <= q_pos                  # [n, seq_len]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)                                              # [n, q_heads, D]


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                         causal: bool = False) -> torch.Tensor:
    """The baseline: SDPA on contiguous K/V, grouped heads without repeating K/V (``enable_gqa``). ``q``
    ``[batch, q_heads, q_len, head_dim]``, ``k``, ``v`` ``[batch, kv_heads, kv_len, head_dim]``; ``causal``
    masks future keys (prefill, ``q_len == kv_len``). Returns ``q``'s shape."""
    _checks.check_contiguous(q, k, v)
    scale = softmax_scale(q.shape[3], scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)


def paged_attention_oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, *, k_scale: float | torch.Tensor = 1.0,
                           v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """What ``paged_attention`` computes, in float64, one sequence at a time, reading only the slots that
    hold tokens. Returns float64 ``[batch, q_heads, head_dim]``, unrounded, so no error hides in it."""
    batch, q_heads, kv_heads, head_dim, block_size = check_paged_inputs(q, k_cache, v_cache, block_tables,
                                                                        seq_lens)
    scale = softmax_scale(head_dim, scale)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    out = torch.empty(batch, q_heads, head_dim, dtype=torch.float64, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n, device=q.device)                                 # [n]
        block = block_tables[b].long()[pos // block_size]                      # [n] block of each token
        offset = pos % block_size                                              # [n]
        k = k_cache[block, offset].double() * per_head(k_scale)                # [n, kv_heads, D]
        v = v_cache[block, offset].double() * per_head(v_scale)
        qb = q[b].double().reshape(kv_heads, q_heads // kv_heads, head_dim)    # [kv_heads, group, D]
        scores = torch.einsum("hgd,nhd->hgn", qb, k) * scale                   # [kv_heads, group, n]
        out[b] = torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(q_heads, head_dim)
    return out


def sliding_window_mask(q_len: int, kv_len: int, window: int, device: torch.device | str | None = None
                        ) -> torch.Tensor:
    """bool ``[q_len, kv_len]``, SDPA's ``attn_mask`` (True: attend): the queries are the last ``q_len``
    of ``kv_len`` positions, and query ``i`` at ``p = kv_len - q_len + i`` sees key ``j`` iff
    ``p - window < j <= p``."""
    q_len, kv_len, window = _checks.check_window(q_len, kv_len, window)
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]   # [q_len, 1]
    k_pos = torch.arange(kv_len, device=device)[None, :]                   # [1, kv_len]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def sliding_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int,
                             scale: float | None = None, *, k_scale: float | torch.Tensor = 1.0,
                             v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """One decode step in which each sequence's newest token sees only its last ``window`` positions;
    ``paged_attention``'s arguments, the tables and lengths describing the blocks and tokens still held
    (``attend_chunk`` masks the positions before the window as it masks those past the length)."""
    head_dim = check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens)[3]
    window = as_int("window", window, minimum=1)
    scale = softmax_scale(head_dim, scale)
    k_scale, v_scale = check_scales(k_cache, k_scale, v_scale)
    return attend_chunk(q, k_cache, v_cache, block_tables, seq_lens, seq_lens.tolist(), scale, window,
                        k_scale, v_scale)
