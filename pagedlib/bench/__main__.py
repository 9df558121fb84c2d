"""Command line: ``python -m pagedlib.bench SUBCOMMAND [options]``.

Subcommands live in their own modules (``pagedlib/bench/<name>.py``), each exposing
``add_arguments(parser)`` and ``main(args) -> int``.
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
    "gpu": "the fused Triton kernel against SDPA, torch gather and FlexAttention on a CUDA GPU (notebook 05)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlib.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    modules = {}
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            modules[name] = importlib.import_module(f"pagedlib.bench.{name}")
        except ModuleNotFoundError as e:  # a subcommand not written yet
            if e.name != f"pagedlib.bench.{name}":
                raise
            continue
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command not in modules:
        parser.error(f"subcommand {args.command!r} is not available in this version")
    return int(modules[args.command].main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
