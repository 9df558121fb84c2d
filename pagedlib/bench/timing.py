"""Timing and reporting helpers shared by every benchmark.

Ratios follow one convention everywhere: ``speedup = baseline_time / time``, "x faster than the baseline"
(> 1 is faster), as computed by ``speedup``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

#: dtype names the benchmark commands accept (``--dtype``), and the torch dtypes they stand for.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                  "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Timing:
    """Repeated wall-clock measurements of one callable, in seconds."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float | None:
        """Interquartile range relative to the median: a quick look at how noisy the run was; None (a blank
        cell) under four samples, too few for quartiles (the slow per-token reference is timed thrice)."""
        if len(self.samples) < 4:
            return None
        q = statistics.quantiles(self.samples, n=4)
        return (q[2] - q[0]) / self.median


def speedup(baseline_seconds: float, seconds: float) -> float:
    """How many times faster than the baseline (> 1: faster; 0.5: twice as slow)."""
    return baseline_seconds / seconds


def time_once(fn: Callable[[], Any], device: torch.device | str | None = None) -> float:
    """Seconds of one call of ``fn``; CUDA work is synchronised before and after it."""
    cuda = device is not None and torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def time_fn(fn: Callable[[], Any], *, repeats: int = 20, warmup: int = 3, min_time: float = 0.0,
            device: torch.device | str | None = None) -> Timing:
    """Call ``fn`` ``warmup`` times, then time ``repeats`` calls (more if ``min_time`` seconds are not yet
    spent) with ``time_once``."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - start < min_time:
        samples.append(time_once(fn, device))
    return Timing(tuple(samples))


def default_device(device: str | None) -> str:
    """``device``, or ``"cuda"`` when there is one and ``"cpu"`` otherwise."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(threads)`` (unless None or 0), restoring the old count afterwards."""
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1, else a usage error (exit 2) before any work."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (a seed), else a usage error (exit 2)."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """argparse ``type=``: a number > 0 (``inf`` allowed), else a usage error (exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """argparse ``type=``: comma-separated integers >= 1 (``1,4,16``)."""
    return [positive_int(part) for part in text.split(",")]


def memory_bytes(device: str) -> int:
    """The memory a benchmark on ``device`` can fill: the GPU's, or the machine's RAM."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): let the allocator decide
        return 2**63


def check_fits(nbytes: int, what: str, device: str, usage_error: Callable[[str], Any]) -> None:
    """A usage error (exit 2) before anything is allocated if ``what`` needs more than ``device`` has:
    a typo such as ``--context 2000000000`` should not end in a ``MemoryError`` minutes later."""
    available = memory_bytes(device)
    if nbytes > available:
        usage_error(f"{what} needs about {nbytes / 2**30:,.1f} GiB, more than the {available / 2**30:,.1f} "
                    f"GiB of {device} memory")


def writable_path(text: str) -> str:
    """argparse ``type=``: a regular file the run can write, checked by opening it before the run (a file
    created by the check is removed again)."""
    import os

    if not text:
        raise argparse.ArgumentTypeError("an empty path: name the file to write")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {folder!r} is not a writable folder")
    existed = os.path.exists(text)
    if existed and not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: not a regular file")
    try:
        open(text, "a").close()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {error.strerror}") from None
    if not existed:
        os.remove(text)
    return text


def thread_count(text: str) -> int:
    """argparse ``type=``: torch threads, from 1 to the CPUs this machine has."""
    import os

    threads = _int_at_least(text, 1)
    cpus = os.cpu_count() or 1
    if threads > cpus:
        raise argparse.ArgumentTypeError(f"{threads} threads: this machine has {cpus} CPUs")
    return threads


def device_name(text: str) -> str:
    """argparse ``type=``: ``cpu``, or ``cuda``/``cuda:N`` where CUDA is available."""
    if text == "cpu":
        return text
    if text.split(":")[0] != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device (use cpu)")
    return text


def add_run_arguments(p: argparse.ArgumentParser, *, repeats: int, repeats_help: str) -> None:
    """The options every CPU benchmark shares: ``--device``, ``--repeats``, ``--threads``, ``--json``."""
    p.add_argument("--device", type=device_name, default=None,
                   help="cpu or cuda (default: cuda if available)")
    p.add_argument("--repeats", type=positive_int, default=repeats, help=repeats_help)
    p.add_argument("--threads", type=thread_count, default=None,
                   help="torch CPU threads during the run (default: torch's own choice); 1 gives steadier "
                        "numbers on a busy machine")
    p.add_argument("--json", metavar="FILE", type=writable_path,
                   help="also write rows and environment as JSON")


def environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What a benchmark figure depends on: device, library versions, threads, the libraries preloaded
    (``LD_PRELOAD``: vLLM's CPU guide recommends tcmalloc) and the load when it is read."""
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform(),
                            "processor": platform.processor() or platform.machine(),
                            "torch_threads": torch.get_num_threads(), "device": str(device),
                            "ld_preload": os.environ.get("LD_PRELOAD", "")}
    if hasattr(os, "getloadavg"):        # not on Windows
        info["load_average"] = os.getloadavg()
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, sm_count=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is Linux-only
        info["triton"] = None
    return info


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return "" if v is None else str(v)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: str | None = None) -> str:
    """Format ``rows`` as an aligned text table (also returned), printing it."""
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = [title] if title else []
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)
    text = "\n".join(lines)
    print(text)
    return text


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as a markdown table (numbers formatted as ``print_table`` does)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write a benchmark result (rows plus environment) as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def default(o: Any) -> Any:
        if isinstance(o, Timing):
            return asdict(o)
        if isinstance(o, torch.dtype):
            return str(o).replace("torch.", "")
        return str(o)

    path.write_text(json.dumps(payload, indent=2, default=default) + "\n")
