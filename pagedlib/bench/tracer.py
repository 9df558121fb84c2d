"""``python -m pagedlib.bench tracer``: how long one click of the tracer widget takes to re-render.

Each click goes through the widget's own button handler: a real ``PagedKVCache`` call, a snapshot for
the history (Back / Forward), then the whole view rendered to HTML. The last row renders the largest view
the tracer allows (``MAX_SLOTS`` slots, all filled), the worst case of a click. (In a browser, the kernel
round trip comes on top.)
"""

from __future__ import annotations

import argparse

from pagedlib.bench.timing import environment, positive_int, print_table, time_fn, writable_path, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=positive_int, default=200, help="timed clicks per control")
    parser.add_argument("--json", metavar="FILE", type=writable_path, help="also write the results as JSON")


def main(args: argparse.Namespace) -> int:
    from pagedlib.teach.tracer import BlockTableTracer
    from pagedlib.teach.tracer_view import MAX_SLOTS, render_html

    tracer = BlockTableTracer()  # the default pool: 12 blocks x 4 slots
    tracer.add_sequence()

    def append_click() -> None:
        if tracer.cache.seq_lens[tracer.selected] == 12 * 4:  # the pool is full: start over
            tracer.reset_button.click()
            tracer.add_sequence()
        tracer.append_button.click()

    looked_up = BlockTableTracer.article_trace()
    looked_up.position.value = 5
    largest = BlockTableTracer(num_blocks=MAX_SLOTS // 4, block_size=4)
    largest.append(largest.add_sequence(), MAX_SLOTS)
    controls = {
        "append token": (append_click, tracer),
        "look up position": (looked_up.lookup_button.click, looked_up),
        "render the view to HTML": (lambda: render_html(looked_up.cache, selected=0, lookup=(0, 5)),
                                    looked_up),
        f"render the largest view ({MAX_SLOTS} slots)": (lambda: render_html(largest.cache, selected=0),
                                                         largest),
    }
    rows = []
    for name, (fn, shown) in controls.items():
        t = time_fn(fn, repeats=args.repeats, warmup=5)
        rows.append({"control": name, "median_ms": t.median * 1e3, "max_ms": max(t.samples) * 1e3,
                     "html_kib": len(shown.html()) / 1024})
    print_table(rows, ["control", "median_ms", "max_ms", "html_kib"], title="Tracer clicks")
    if args.json:
        write_json(args.json, {"benchmark": "tracer", "environment": environment(), "rows": rows})
    return 0
