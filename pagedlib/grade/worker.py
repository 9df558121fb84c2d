"""The grader's child process: the reader's code runs here, never in the grader, under a memory limit.

Each job is ``{"task": name, "path": file, "check": index}``; the answer is ``run_check``'s result. The
module is loaded once per task and file (and again when the file changes). ``PAGEDLIB_GRADE_MEMORY_MB``
caps the process's address space, so an allocation past it fails with ``MemoryError`` in the reader's
code instead of taking the machine's memory.
"""

from __future__ import annotations

import os
import resource
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis.configuration import set_hypothesis_home_dir

from pagedlib.child import serve
from pagedlib.grade.framework import OUT_OF_MEMORY, load, run_check
from pagedlib.grade.tasks import TASKS

_loaded: dict[tuple[str, str], tuple[float, ModuleType | str]] = {}


def limit_memory(megabytes: int) -> None:
    """Cap this process's address space at ``megabytes`` (never above the cap it already has)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = megabytes * 2**20
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def module_of(task: str, path: str) -> ModuleType | str:
    """The reader's module, or the error that loading it raised (a string every check then reports)."""
    stamp = Path(path).stat().st_mtime
    kept = _loaded.get((task, path))
    if kept is None or kept[0] != stamp:
        try:
            kept = (stamp, load(path, task))
        except MemoryError:
            kept = (stamp, f"{OUT_OF_MEMORY} (while loading it)")
        except BaseException as error:        # SyntaxError, an import that fails, a SystemExit...
            line = getattr(error, "lineno", None)
            at = f" (line {line})" if line else ""
            kept = (stamp, f"could not load {Path(path).name}{at}: {type(error).__name__}: {error}")
        _loaded[(task, path)] = kept
    return kept[1]


def handle(job: dict[str, Any]) -> dict[str, Any]:
    task = TASKS[job["task"]]
    check = task.checks[job["check"]]
    module = module_of(task.name, job["path"])
    if isinstance(module, str):
        return {"ok": False, "kind": "load", "message": module}
    return run_check(check, module, job["path"])


if __name__ == "__main__":
    # hypothesis keeps a cache of its own (even with no example database): never beside the reader's files
    set_hypothesis_home_dir(tempfile.mkdtemp(prefix="pagedlib-grade-"))
    limit_memory(int(os.environ.get("PAGEDLIB_GRADE_MEMORY_MB", "4096")))
    serve(handle)
