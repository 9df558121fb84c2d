"""Benchmarks: ``python -m pagedlib.bench {alloc,attention,tracer,generate,serving,trace,gpu} ...``.

Speed is measured here, never asserted in tests. Each subcommand prints a table and can write JSON
(``--json FILE``; ``gpu`` always writes its files to ``--out-dir``) with the machine and library
versions, so figures can be compared across runs. Ratios are speedups: baseline time / time.
"""

from pagedlib.bench.timing import Timing, environment, print_table, time_fn, write_json

__all__ = ["Timing", "environment", "print_table", "time_fn", "write_json"]
