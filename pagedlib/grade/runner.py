"""The grader's side: which file is graded, the child that runs it, and the report a reader reads.

The reader's code runs in a child (``worker``): a check that outlives its time is stopped and reported as
"did not finish", a process that dies (a crash, the memory limit) is reported as such, and the grader goes
on with a new child. Nothing here writes a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedlib.child import Child, ChildError
from pagedlib.grade.framework import Task
from pagedlib.grade.tasks import TASKS

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent.parent                 # the repository holding pagedlib (an editable install)
READER = ROOT / "notebooks" / "tasks"        # the reader's files
MEMORY_MB = 4096                             # the child's address space (torch alone maps about 1 GiB)
# the child's environment: the memory cap; kernels in Triton's interpreter, on the CPU tensors the checks
# build, even where CUDA is (compiled Triton cannot read them); one thread, since the checks' tensors are
# tiny and several threads on a busy machine made them 5-10x slower (a softmax of a few numbers took 11 ms)
CHILD_ENV = {"PAGEDLIB_GRADE_MEMORY_MB": str(MEMORY_MB), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


def task_of(name: str) -> Task:
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {name!r}")
    return TASKS[name]


def file_of(task: Task, impl: str | os.PathLike | None = None, reference: bool = False) -> Path:
    """The file graded: ``impl`` if given, pagedlib's own answer for ``reference``, else the reader's."""
    if impl is not None and reference:
        raise ValueError("give impl or reference=True, not both")
    if reference:
        return PACKAGE / "reference" / task.file
    path = Path(impl) if impl is not None else READER / task.file
    if not path.is_file():
        skeleton = PACKAGE / "skeletons" / task.file
        where = "impl" if impl is not None else f"the reader's file (copy {skeleton} there)"
        raise FileNotFoundError(f"{where}: no file at {path}")
    return path.resolve()


def label(path: Path) -> str:
    """``path`` as a report names it: relative to the repository when inside it (no machine's folders)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


@dataclass
class Result:
    check: str
    hint: str
    ok: bool
    kind: str = ""
    message: str = ""
    case: str | None = None


@dataclass
class Report:
    """One task graded: ``results`` per check, in order; ``passed`` when every check passed."""

    task: Task
    file: str
    results: list[Result]

    @property
    def passed(self) -> bool:
        return all(r.ok for r in self.results)

    @property
    def status(self) -> str:
        """``passed``, ``not started`` (every check met ``NotImplementedError``) or the first failing
        check."""
        if self.passed:
            return "passed"
        if all(r.kind == "todo" for r in self.results):
            return "not started"
        first = next(r for r in self.results if not r.ok)
        return f"failing: {first.check}"

    def __str__(self) -> str:
        done = sum(r.ok for r in self.results)
        lines = [f"{self.task.name} (notebook {self.task.notebook}): {self.task.title}",
                 f"file: {self.file}    {done} of {len(self.results)} checks pass", ""]
        for r in self.results:
            lines.append(f"  {'pass' if r.ok else 'FAIL'}  {r.check}")
            if not r.ok:
                lines += ["        " + line for line in r.message.splitlines()]
                if r.case:
                    lines += ["        " + line for line in r.case.splitlines()]
                lines.append(f"        reread: {r.hint}")
        return "\n".join(lines)

    __repr__ = __str__


def run_task(task: Task, path: Path, child: list[Child | None],
             time_limit: float | None = None) -> list[Result]:
    """Every check of ``task`` on ``path``, in ``child[0]`` (replaced when it stops); ``time_limit`` caps
    each check's seconds."""
    results: list[Result] = []
    stopped = ""
    for index, check in enumerate(task.checks):
        if stopped:
            results.append(Result(check.name, check.hint, False, "skipped", f"not run: {stopped}"))
            continue
        if child[0] is None:
            child[0] = Child("pagedlib.grade.worker", env=CHILD_ENV)
        seconds = check.seconds if time_limit is None else min(check.seconds, time_limit)
        try:
            answer: dict[str, Any] = child[0].ask({"task": task.name, "path": str(path), "check": index},
                                                  timeout=seconds)
        except TimeoutError:
            answer = {"ok": False, "kind": "time",
                      "message": f"did not finish within {seconds:g} s (an endless loop?); it was stopped"}
            stopped = "an earlier check did not finish"
        except ChildError as error:
            code = error.exit_code
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            answer = {"ok": False, "kind": "crash", "message": f"the process running your code died ({how}) "
                      f"during this check: a crash, or memory past the {MEMORY_MB} MiB it may map"}
            stopped = "an earlier check crashed the process"
        if answer.get("kind") in ("time", "crash", "memory") and child[0] is not None:
            child[0].close(grace=0)
            child[0] = None
        results.append(Result(check.name, check.hint, answer["ok"], answer.get("kind", ""),
                              answer.get("message", ""), answer.get("case")))
    return results


@contextmanager
def grading_child() -> Iterator[list[Child | None]]:
    """The holder ``run_task`` starts its child in (and replaces it in); the child is stopped on leaving,
    an interrupt included."""
    child: list[Child | None] = [None]
    try:
        yield child
    finally:
        if child[0] is not None:
            child[0].close(grace=0)


def grade(task: str, impl: str | os.PathLike | None = None, *, reference: bool = False,
          time_limit: float | None = None) -> Report:
    """Grade ``task``: the reader's file ``notebooks/tasks/<file>``, the file ``impl``, or with
    ``reference=True`` pagedlib's own implementation, through the same checks; ``time_limit``: at most
    these seconds per check (each check has its own limit)."""
    chosen = task_of(task)
    path = file_of(chosen, impl, reference)
    with grading_child() as child:
        return Report(chosen, label(path), run_task(chosen, path, child, time_limit))


@dataclass
class Progress:
    """Every task's status; ``passed`` when all pass."""

    reports: list[tuple[Task, str, str]]          # (task, file, status)

    @property
    def passed(self) -> bool:
        return all(status == "passed" for _, _, status in self.reports)

    def __str__(self) -> str:
        rows = [("task", "notebook", "file", "status")]
        rows += [(t.name, t.notebook, file, status) for t, file, status in self.reports]
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(width[i]) for i in range(3)) + "  " + r[3] for r in rows]
        done = sum(status == "passed" for _, _, status in self.reports)
        return "\n".join(lines + [f"{done} of {len(self.reports)} tasks pass"])

    __repr__ = __str__


def progress(*, reference: bool = False) -> Progress:
    """Every task graded on the reader's files (or pagedlib's, ``reference=True``), one child for all."""
    rows = []
    with grading_child() as child:
        for task in TASKS.values():
            try:
                path = file_of(task, reference=reference)
            except FileNotFoundError:
                rows.append((task, f"notebooks/tasks/{task.file}", "no file"))
                continue
            report = Report(task, label(path), run_task(task, path, child))
            rows.append((task, report.file, report.status))
    return Progress(rows)
