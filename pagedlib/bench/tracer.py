"""``python -m pagedlib.bench tracer``: how long one click of the tracer widget takes to re-render.

Each click goes through the widget's own button handler: a real ``PagedKVCache`` call, then the
whole view rendered to HTML. (In a browser, the kernel round trip comes on top: ~50 ms measured in
headless Chromium on a 2-core machine.)
"""

from __future__ import annotations

import argparse

from pagedlib.bench.timing import environment, print_table, time_fn, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=200, help="timed clicks per control")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def main(args: argparse.Namespace) -> int:
    from pagedlib.tracer import BlockTableTracer, render_html

    rows = []

    def fresh() -> BlockTableTracer:
        t = BlockTableTracer()
        t.add_sequence()
        return t

    # Append token: a fresh 12-block pool would fill up, so free and start over when it is nearly full
    tracer = fresh()

    def append_click() -> None:
        if tracer.cache.num_free_blocks == 0 and tracer.cache.seq_lens[tracer.selected] % 4 == 0:
            tracer.free_button.click()
            tracer.add_sequence()
        tracer.append_button.click()

    lookup_tracer = BlockTableTracer.article_trace()
    lookup_tracer.position.value = 5
    controls = {
        "append token": append_click,
        "look up position": lookup_tracer.lookup_button.click,
        "render the view to HTML": lambda: render_html(lookup_tracer.cache, selected=0, lookup=(0, 5)),
    }
    for name, fn in controls.items():
        t = time_fn(fn, repeats=args.repeats, warmup=5)
        rows.append({"control": name, "median_ms": t.median * 1e3, "max_ms": max(t.samples) * 1e3})
    geometry = f"{tracer.cache.num_blocks} blocks x {tracer.cache.block_size} slots"
    print_table(rows, ["control", "median_ms", "max_ms"], title=f"Tracer clicks, default pool ({geometry})")
    if args.json:
        write_json(args.json, {"benchmark": "tracer", "environment": environment(), "rows": rows})
    return 0
