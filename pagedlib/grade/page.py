"""The track as one page (the website's "Build it yourself"): every task, its notebook, the file to write,
the checks that grade it and the skeleton it starts from, read from the tasks themselves."""

from __future__ import annotations

from pagedlib.grade.runner import PACKAGE
from pagedlib.grade.tasks import TASKS


def markdown(chapters: dict[str, str] | None = None) -> str:
    """The page; ``chapters`` maps a notebook's number to the page it links (``"01"`` to
    ``"01_memory_sizing.ipynb"``), else notebooks are named by number only."""
    chapters = chapters or {}
    lines = ["# Build it yourself", "",
             "Each notebook from 01 to 13 ends with a task: you write one piece of the course yourself, in a "
             "short Python file under `notebooks/tasks/`, and the course's own checks grade it: hypothesis "
             "properties over many generated cases (a failure shows the smallest input, the expected value "
             "and yours), the float64 oracle for attention, and decisions equal to `pagedlib`'s step by "
             "step. Your code runs in a separate process with a time limit per check and a memory limit.", "",
             "```bash",
             "python -m pagedlib.grade                # every task: not started, failing which check, passed",
             "python -m pagedlib.grade kv_bytes       # grade notebooks/tasks/kv_bytes.py",
             "python -m pagedlib.grade kv_bytes --reference  # pagedlib's own answer, the same checks",
             "python -m pagedlib.grade kv_bytes --impl my_try.py",
             "```", "",
             "In a notebook, `from pagedlib.grade import grade; grade(\"kv_bytes\")` shows the same report. "
             "The files are yours: nothing in `make test` or `make execute` writes to them, and `git status` "
             "shows your work.", ""]
    for task in TASKS.values():
        page = chapters.get(task.notebook)
        where = f"[notebook {task.notebook}](<{page}>)" if page else f"notebook {task.notebook}"
        lines += [f"## `{task.name}`: {task.title}", "",
                  f"From {where}. Write `notebooks/tasks/{task.file}`, then run "
                  f"`python -m pagedlib.grade {task.name}`. The checks:", ""]
        lines += [f"- {check.name}" for check in task.checks]
        skeleton = (PACKAGE / "skeletons" / task.file).read_text()
        lines += ["", "The file you start from:", "", "```python", skeleton.rstrip(), "```", ""]
    return "\n".join(lines)
