"""``python -m pagedlib.bench trace FILE``: a Mooncake-format trace replayed through a device tier and,
with ``--host-blocks``, a host tier behind it (notebook 13): how many prompt blocks each tier finds, against
an infinite cache's ceiling. The course ships Mooncake's conversation trace (``MOONCAKE_TRACE``)."""

from __future__ import annotations

import argparse
import sys

from pagedlib.bench.timing import (
    check_fits,
    non_negative_int,
    positive_int,
    print_table,
    writable_path,
    write_json,
)
from pagedlib.kv_transfer.policies import POLICIES
from pagedlib.sim.trace import MOONCAKE_TRACE, WRITES, TraceError, read_trace, replay

COLUMNS = ["requests", "blocks", "hit_rate", "device_hit_rate", "host_hit_rate", "ceiling", "saved_tokens",
           "tokens"]
PROGRESS_FROM = 1000  # requests: a shorter replay takes well under a second and shows no bar
BLOCK_BYTES = 40  # a tier's memory per block before it holds any: a free-slot list entry and its int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE",
                   help=f"a trace, one JSON object a line (Mooncake's format); the course ships one: "
                        f"{MOONCAKE_TRACE}")
    p.add_argument("--blocks", type=positive_int, required=True, help="device tier size in blocks (LRU)")
    p.add_argument("--host-blocks", type=non_negative_int, default=0,
                   help="host tier size in blocks (default 0: no host tier)")
    p.add_argument("--policy", choices=tuple(POLICIES), default=None,
                   help="the host tier's eviction (default lru)")
    p.add_argument("--write", choices=WRITES, default=None,
                   help="through: the host gets every block the device computes or loads (vLLM's offloading "
                        "connector); victim: only the blocks the device evicts (default through)")
    p.add_argument("--limit", type=positive_int, default=None, help="replay the first LIMIT requests only")
    p.add_argument("--json", metavar="OUT", type=writable_path,
                   help="also write the figures and settings as JSON")
    p.set_defaults(parser=p)


def main(args: argparse.Namespace) -> int:
    if not args.host_blocks and (args.policy or args.write):
        args.parser.error("--policy and --write choose how the host tier works: give --host-blocks too")
    args.policy, args.write = args.policy or "lru", args.write or "through"
    # like bench alloc's sizes, the tiers are bounded by the machine's memory: a usage error, not a
    # MemoryError or an OverflowError once the trace is read
    check_fits(BLOCK_BYTES * (args.blocks + args.host_blocks),
               f"--blocks {args.blocks} and --host-blocks {args.host_blocks}", "cpu", args.parser.error)
    try:
        requests = read_trace(args.file, limit=args.limit)
    except TraceError as error:  # the file and line at fault, no traceback
        print(f"{args.parser.prog}: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # unreadable: permissions, a device
        print(f"{args.parser.prog}: error: {args.file}: {error.strerror or error}", file=sys.stderr)
        return 2
    result = replay(requests, args.blocks, args.host_blocks, policy=args.policy, write=args.write,
                    progress=len(requests) > PROGRESS_FROM)
    summary = result.summary()
    host = (f"; host {args.host_blocks} blocks ({args.policy}, write-{args.write})" if args.host_blocks
            else "; no host tier")
    print_table([summary], COLUMNS, title=f"{args.file}: device {args.blocks} blocks (LRU){host}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("command", "parser")}
        write_json(args.json, {"settings": settings, "summary": summary})
    return 0
