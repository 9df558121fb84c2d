"""``python -m pagedlib.grade``: every task's status; ``TASK`` grades the reader's file, ``--impl PATH`` any
file, ``--reference`` pagedlib's own; ``--list`` names the tasks. Exit status 0 when every check passes, 1
when one fails, 2 for a usage error."""

from __future__ import annotations

import argparse
import sys

from pagedlib.grade.runner import READER, file_of, grade, label, progress, task_of
from pagedlib.grade.tasks import TASKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlib.grade", description=__doc__.split(";")[0])
    parser.add_argument("task", nargs="?", help=f"one of: {', '.join(TASKS)}")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--impl", metavar="PATH", help="grade this file instead of the reader's")
    source.add_argument("--reference", action="store_true", help="grade pagedlib's own implementation")
    parser.add_argument("--list", action="store_true", help="name the tasks, their notebooks and files")
    args = parser.parse_args(argv)
    if args.list:
        for task in TASKS.values():
            print(f"{task.name:14} notebook {task.notebook}  {label(READER / task.file):32} {task.title}")
        return 0
    if args.task is None:
        if args.impl:
            parser.error("--impl needs a TASK")
        result = progress(reference=args.reference)
    else:
        try:
            task_of(args.task)
            file_of(TASKS[args.task], args.impl, args.reference)
        except (ValueError, FileNotFoundError) as error:
            parser.error(str(error))
        result = grade(args.task, args.impl, reference=args.reference)
    print(result)
    return 0 if result.passed else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:               # `python -m pagedlib.grade | head`: the reader has seen enough
        sys.stderr.close()
        sys.exit(1)
