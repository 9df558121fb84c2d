"""A small KV-cache memory calculator widget for notebook 01.

The numbers come from :mod:`pagedlib.sizing`; this module only wires them to controls. The report is a
pure function of the inputs (:func:`memory_report`), so its default output is the same on every run.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from pagedlib.checks import as_int
from pagedlib.teach.sizing import (
    DTYPE_BYTES,
    PRESETS,
    ModelSpec,
    block_table_entries,
    contiguous_kv_bytes,
    contiguous_utilization,
    format_bytes,
    kv_bytes_per_token,
    max_sequences,
    paged_kv_bytes,
    paged_utilization,
    synthetic_seq_len_chunks,
    synthetic_seq_lens,
)

#: The calculator's ranges (the widget's controls offer the same): up to 1M-token reservations and 4,096
#: requests, so "requests that fit" (up to ~9 million of them) is computed exactly in about a second.
MAX_TOKENS_LIMIT = 1 << 20
MAX_SEQS_LIMIT = 4096
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class MemoryReport:
    """What one calculator setting costs, for a seeded synthetic workload of ``num_seqs`` requests."""

    spec: ModelSpec
    dtype: str
    max_tokens: int
    block_size: int
    num_seqs: int
    bytes_per_token: int
    contiguous_bytes: int
    paged_bytes: int
    used_bytes: int
    contiguous_util: float
    paged_util: float
    table_entries: int
    paged_fit: int
    seed: int = 0

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, in reading order."""
        return [
            ("KV bytes per token", format_bytes(self.bytes_per_token)),
            (f"contiguous: {self.num_seqs} x {self.max_tokens} reserved slots",
             format_bytes(self.contiguous_bytes)),
            (f"paged: whole blocks of {self.block_size}", format_bytes(self.paged_bytes)),
            ("tokens actually stored", format_bytes(self.used_bytes)),
            ("utilization, contiguous / paged", f"{self.contiguous_util:.1%} / {self.paged_util:.1%}"),
            ("block-table entries (int32)",
             f"{self.table_entries:,} ({format_bytes(4 * self.table_entries)})"),
            (f"requests that fit in {format_bytes(self.contiguous_bytes)}, paged vs reserved",
             f"{self.paged_fit:,} vs {self.num_seqs} ({self.paged_fit / self.num_seqs:.1f}x)"),
        ]

    def text(self) -> str:
        head = f"{self.spec.name}, {self.dtype}, {self.num_seqs} requests (synthetic, seed {self.seed})"
        rows = self.rows()
        width = max(len(k) for k, _ in rows)
        return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])

    def html(self) -> str:
        cells = "".join(
            f"<tr><td style='text-align:left;padding-right:1em'>{html.escape(k)}</td>"
            f"<td style='text-align:right'><b>{html.escape(v)}</b></td></tr>"
            for k, v in self.rows()
        )
        title = html.escape(f"{self.spec.name}, {self.dtype}, {self.num_seqs} requests")
        return f"<div class='pt-calc'><div><b>{title}</b></div><table>{cells}</table></div>"


def memory_report(
    preset: str = "llama-3-8b", dtype: str = "fp16", max_tokens: int = 4096, block_size: int = 16,
    num_seqs: int = 256, seed: int = 0,
) -> MemoryReport:
    """Size a cache for ``num_seqs`` synthetic requests (lengths from
    :func:`pagedlib.teach.sizing.synthetic_seq_lens`, clipped to ``max_tokens``) under both schemes.

    ``paged_fit`` answers: in the bytes that reserving ``max_tokens`` for each of the ``num_seqs``
    requests takes, how many requests of the same seeded stream fit when each holds only whole blocks?
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    max_tokens = as_int("max_tokens", max_tokens, minimum=1, maximum=MAX_TOKENS_LIMIT)
    num_seqs = as_int("num_seqs", num_seqs, minimum=1, maximum=MAX_SEQS_LIMIT)
    block_size = as_int("block_size", block_size, minimum=1, maximum=MAX_TOKENS_LIMIT)
    spec, nbytes = PRESETS[preset], DTYPE_BYTES[dtype]
    lens = synthetic_seq_lens(num_seqs, max_tokens=max_tokens, seed=seed)
    per_token = kv_bytes_per_token(spec, nbytes)
    contiguous = contiguous_kv_bytes(spec, max_tokens, num_seqs, nbytes)
    return MemoryReport(
        spec=spec, dtype=dtype, max_tokens=max_tokens, block_size=block_size, num_seqs=num_seqs,
        bytes_per_token=per_token,
        contiguous_bytes=contiguous,
        paged_bytes=paged_kv_bytes(spec, lens, block_size, nbytes),
        used_bytes=sum(lens) * per_token,
        contiguous_util=contiguous_utilization(lens, max_tokens),
        paged_util=paged_utilization(lens, block_size),
        table_entries=block_table_entries(lens, block_size),
        paged_fit=_paged_fit(spec, contiguous, max_tokens, block_size, nbytes, seed),
        seed=seed,
    )


def _paged_fit(spec: ModelSpec, budget: int, max_tokens: int, block_size: int, nbytes: int, seed: int) -> int:
    """Requests of the seeded stream that paging admits in ``budget`` bytes, read 65,536 at a time so
    that memory stays small however many fit."""
    fit = 0
    for lens in synthetic_seq_len_chunks(1 << 16, max_tokens=max_tokens, seed=seed):
        n = max_sequences(spec, budget, lens, block_size=block_size, dtype_bytes=nbytes)
        fit += n
        if n < len(lens):
            return fit
        budget -= paged_kv_bytes(spec, lens, block_size, nbytes)
    raise AssertionError("unreachable: the stream is endless")


class MemoryCalculator:
    """ipywidgets front end for :func:`memory_report`: change a control and the table updates."""

    def __init__(self, **defaults: object) -> None:
        import ipywidgets as w

        r = memory_report(**defaults)  # a ValueError naming a bad setting, not a control that clamps it
        style = {"description_width": "110px"}
        self.preset = w.Dropdown(options=list(PRESETS), value=r.spec.name, description="model", style=style)
        self.dtype = w.Dropdown(options=list(DTYPE_BYTES), value=r.dtype, description="dtype", style=style)
        self.max_tokens = w.BoundedIntText(value=r.max_tokens, min=1, max=MAX_TOKENS_LIMIT,
                                           description="max tokens", style=style)
        self.block_size = w.Dropdown(options=sorted({*BLOCK_SIZES, r.block_size}), value=r.block_size,
                                     description="block size", style=style)
        self.num_seqs = w.BoundedIntText(value=r.num_seqs, min=1, max=MAX_SEQS_LIMIT,
                                         description="sequences", style=style)
        self.output = w.HTML()
        controls = [self.preset, self.dtype, self.max_tokens, self.block_size, self.num_seqs]
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.HBox([w.VBox(controls), self.output])
        self.update()

    def report(self) -> MemoryReport:
        return memory_report(self.preset.value, self.dtype.value, self.max_tokens.value,
                             self.block_size.value, self.num_seqs.value)

    def update(self) -> None:
        self.output.value = self.report().html()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
