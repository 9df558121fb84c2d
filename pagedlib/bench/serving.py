"""``python -m pagedlib.bench serving``: every reservation policy on one workload and budget (notebook 07)."""

from __future__ import annotations

import argparse

from pagedlib.bench.timing import (
    non_negative_int,
    positive_float,
    positive_int,
    print_table,
    writable_path,
    write_json,
)
from pagedlib.sim.budgets import POLICIES
from pagedlib.sim.simulate import CATEGORIES, new_scheduler, simulate
from pagedlib.sim.workloads import alpaca_like, shared_prompt_like, sharegpt_like

COLUMNS = ["policy", "kv_util", *CATEGORIES, "mean_running", "saturated_running", "peak_running",
           "preemptions", "recomputed", "steps", "latency", "leaked"]

WORKLOADS = {"sharegpt": sharegpt_like, "alpaca": alpaca_like, "shared": shared_prompt_like}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="sharegpt")
    p.add_argument("--num-requests", type=positive_int, default=1000)
    p.add_argument("--rate", type=positive_float, default=1.0,
                   help="arrivals per step (Poisson); inf: all at once")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--budget-blocks", type=positive_int, default=983,
                   help="KV budget in blocks (983 x 16 = 15.7K slots: the paper's OPT-13B on one A100-40GB)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="add a row: paged with prefix caching (needs --workload shared)")
    p.add_argument("--json", metavar="FILE", type=writable_path,
                   help="also write the rows and settings as JSON")
    p.set_defaults(parser=p)  # main() refuses flags that do not fit together with a usage error


def main(args: argparse.Namespace) -> int:
    if args.enable_prefix_caching and args.workload != "shared":
        args.parser.error("--enable-prefix-caching needs --workload shared (requests with token ids)")
    runs = [(policy, False) for policy in args.policies] + [("paged", True)] * args.enable_prefix_caching
    try:  # every run checked (workload, budget, block size) before any work
        requests = WORKLOADS[args.workload](args.num_requests, args.seed, rate=args.rate)
        for policy, caching in runs:
            new_scheduler(requests, policy, args.budget_blocks, args.block_size,
                          max_num_seqs=args.max_num_seqs, enable_prefix_caching=caching)
    except ValueError as e:
        args.parser.error(str(e))
    rows = [{**simulate(requests, policy, args.budget_blocks, args.block_size, max_num_seqs=args.max_num_seqs,
                        enable_prefix_caching=caching, progress=True).row(), "prefix_caching": caching}
            for policy, caching in runs]
    title = (f"{args.workload}-like, {args.num_requests} requests, rate {args.rate}/step, seed {args.seed}; "
             f"budget {args.budget_blocks} blocks x {args.block_size} tokens")
    extra = ["prefix_caching", "hit_rate", "prefill", "cached"] if args.enable_prefix_caching else []
    print_table(rows, COLUMNS + extra, title=title)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("command", "parser")}
        write_json(args.json, {"settings": settings, "rows": rows})
    return 0
