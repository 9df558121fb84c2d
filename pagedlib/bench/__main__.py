"""Command line: ``python -m pagedlib.bench SUBCOMMAND [options]``.

Each subcommand is a module ``pagedlib/bench/<name>.py`` exposing ``add_arguments(parser)`` and
``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "alloc": "allocator write throughput: append_token vs append_tokens vs append_batch (notebook 02)",
    "attention": "paged vs reference vs contiguous attention, decode and prefill (notebook 04)",
    "tracer": "how long a click of the block-table tracer widget takes to re-render (notebook 03)",
    "generate": "greedy generation end to end: the engine vs transformers' generate, generate_batch (08)",
    "serve": "online serving in real time: Poisson or Mooncake arrivals, TTFT, ITL, goodput; engine vs vLLM",
    "serving": "every reservation policy vs paging on one workload and KV budget (notebook 07)",
    "trace": "a Mooncake-format request trace replayed through a device tier and a host tier (notebook 13)",
    "gpu": "the fused Triton kernel against SDPA and the torch gather path on a CUDA GPU (notebook 05)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlib.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {name: importlib.import_module(f"pagedlib.bench.{name}") for name in SUBCOMMANDS}
    for name, help_text in SUBCOMMANDS.items():
        modules[name].add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return int(modules[args.command].main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
