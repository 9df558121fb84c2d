"""Build it yourself: the course's tasks and the grader that checks a reader's code with the course's own
checks (hypothesis properties, the float64 oracle, decisions equal to pagedlib's).

``grade("kv_bytes")`` grades the reader's ``notebooks/tasks/kv_bytes.py``; ``grade(task, impl=path)`` any
file; ``grade(task, reference=True)`` pagedlib's own answer; ``progress()`` every task's status. The same
from a shell: ``python -m pagedlib.grade [TASK] [--impl PATH | --reference] [--list]``. The reader's code
runs in a child process with a time limit per check and a memory limit.

- ``framework``  what a task and a check are; how a check runs and what its failure says
- ``tasks``      one module per task, in the course's order, each with its checks
- ``skeletons``  the files a reader starts from (copied to ``notebooks/tasks/``); ``reference`` pagedlib's
  answers, behind the same signatures
- ``runner``     the grader's side: files, the child, the reports; ``worker`` the child's side
"""

from pagedlib.grade.runner import Progress, Report, grade, progress
from pagedlib.grade.tasks import TASKS

__all__ = ["TASKS", "Progress", "Report", "grade", "progress"]
