"""Notebook 01's memory calculator: :func:`memory_report`, a pure function of its settings (the same table on
every run), and :class:`MemoryCalculator`, which wires it to ipywidgets controls."""

from __future__ import annotations

import html
from dataclasses import dataclass

from pagedlib.teach import sizing
from pagedlib.teach.sizing import DTYPE_BYTES, PRESETS, ModelSpec, format_bytes
from pagedlib.util import as_int

# the controls' ranges: "requests that fit" (up to ~9 million) stays exact and takes about a second
MAX_TOKENS_LIMIT, MAX_SEQS_LIMIT = 1 << 20, 4096
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class MemoryReport:
    """What one setting costs for ``num_seqs`` requests of the seeded synthetic stream (bytes)."""

    spec: ModelSpec
    dtype: str
    max_tokens: int
    block_size: int
    num_seqs: int
    contiguous_bytes: int
    paged_bytes: int
    used_bytes: int
    table_entries: int
    paged_fit: int  # requests that fit in contiguous_bytes when each holds only whole blocks
    seed: int = 0

    def rows(self) -> list[tuple[str, str]]:
        used, n, table = self.used_bytes, self.num_seqs, self.table_entries
        per_token = sizing.kv_bytes_per_token(self.spec, DTYPE_BYTES[self.dtype])
        return [
            ("KV bytes per token", format_bytes(per_token)),
            (f"contiguous: {n} x {self.max_tokens} reserved slots", format_bytes(self.contiguous_bytes)),
            (f"paged: whole blocks of {self.block_size}", format_bytes(self.paged_bytes)),
            ("tokens actually stored", format_bytes(used)),
            ("utilization, contiguous / paged", f"{used / self.contiguous_bytes:.1%} / "
                                                f"{used / self.paged_bytes:.1%}"),
            ("block-table entries (int32)", f"{table:,} ({format_bytes(4 * table)})"),
            (f"requests that fit in {format_bytes(self.contiguous_bytes)}, paged vs reserved",
             f"{self.paged_fit:,} vs {n} ({self.paged_fit / n:.1f}x)"),
        ]

    def html(self) -> str:
        cells = "".join(f"<tr><td style='text-align:left;padding-right:1em'>{html.escape(k)}</td><td "
                        f"style='text-align:right'><b>{html.escape(v)}</b></td></tr>" for k, v in self.rows())
        title = f"{self.spec.name}, {self.dtype}, {self.num_seqs} requests (synthetic, seed {self.seed})"
        return f"<div class='pt-calc'><div><b>{html.escape(title)}</b></div><table>{cells}</table></div>"


def memory_report(preset: str = "llama-3-8b", dtype: str = "fp16", max_tokens: int = 4096,
                  block_size: int = 16, num_seqs: int = 256, seed: int = 0) -> MemoryReport:
    """Size a cache for ``num_seqs`` synthetic requests (``sizing.synthetic_seq_lens``) under both schemes."""
    max_tokens, block_size, num_seqs = _check_settings(preset, dtype, max_tokens, block_size, num_seqs)
    spec, nbytes = PRESETS[preset], DTYPE_BYTES[dtype]
    lens = sizing.synthetic_seq_lens(num_seqs, max_tokens=max_tokens, seed=seed)
    contiguous = sizing.contiguous_kv_bytes(spec, max_tokens, num_seqs, nbytes)
    return MemoryReport(spec, dtype, max_tokens, block_size, num_seqs, contiguous_bytes=contiguous,
                        paged_bytes=sizing.paged_kv_bytes(spec, lens, block_size, nbytes),
                        used_bytes=sum(lens) * sizing.kv_bytes_per_token(spec, nbytes),
                        table_entries=sizing.block_table_entries(lens, block_size), seed=seed,
                        paged_fit=_paged_fit(spec, contiguous, max_tokens, block_size, nbytes, seed))


def _paged_fit(spec: ModelSpec, budget: int, max_tokens: int, block_size: int, nbytes: int, seed: int) -> int:
    """Requests of the seeded stream that paging admits in ``budget`` bytes (read 65,536 at a time)."""
    fit = 0
    for lens in sizing.synthetic_seq_len_chunks(1 << 16, max_tokens=max_tokens, seed=seed):  # endless
        n = sizing.max_sequences(spec, budget, lens, block_size=block_size, dtype_bytes=nbytes)
        if n < len(lens):
            return fit + n
        fit, budget = fit + n, budget - sizing.paged_kv_bytes(spec, lens, block_size, nbytes)


class MemoryCalculator:
    """ipywidgets front end for :func:`memory_report`: change a control and the table updates."""

    def __init__(self, **settings: object) -> None:
        import ipywidgets as w
        r = memory_report(**settings)  # a ValueError naming a bad setting, not a control that clamps it
        kw = {"style": {"description_width": "110px"}}
        self.preset, self.dtype, self.max_tokens, self.block_size, self.num_seqs = controls = [
            w.Dropdown(options=list(PRESETS), value=r.spec.name, description="model", **kw),
            w.Dropdown(options=list(DTYPE_BYTES), value=r.dtype, description="dtype", **kw),
            w.BoundedIntText(r.max_tokens, min=1, max=MAX_TOKENS_LIMIT, description="max tokens", **kw),
            w.Dropdown(options=sorted({*BLOCK_SIZES, r.block_size}), value=r.block_size,
                       description="block size", **kw),
            w.BoundedIntText(r.num_seqs, min=1, max=MAX_SEQS_LIMIT, description="sequences", **kw),
        ]
        self.output = w.HTML()
        for c in controls:
            c.observe(lambda _change: self.update(), names="value")
        self.widget = w.HBox([w.VBox(controls), self.output])
        self.update()

    def update(self) -> None:
        self.output.value = memory_report(self.preset.value, self.dtype.value, self.max_tokens.value,
                                          self.block_size.value, self.num_seqs.value).html()

    def _repr_mimebundle_(self, **kwargs: object) -> dict:  # a notebook shows the widget
        return self.widget._repr_mimebundle_(**kwargs)


def _check_settings(preset, dtype, max_tokens, block_size, num_seqs) -> tuple[int, int, int]:
    for name, value, options in (("preset", preset, PRESETS), ("dtype", dtype, DTYPE_BYTES)):
        if value not in options:
            raise ValueError(f"{name} must be one of {sorted(options)}, got {value!r}")
    max_tokens = as_int("max_tokens", max_tokens, minimum=1, maximum=MAX_TOKENS_LIMIT)
    num_seqs = as_int("num_seqs", num_seqs, minimum=1, maximum=MAX_SEQS_LIMIT)
    return max_tokens, as_int("block_size", block_size, minimum=1, maximum=MAX_TOKENS_LIMIT), num_seqs
