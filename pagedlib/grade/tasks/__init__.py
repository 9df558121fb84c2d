"""The tasks, in the course's order: ``TASKS[name]`` is a ``Task`` (``framework``), defined in the module of
the same name here, whose ``file`` the reader writes."""

from __future__ import annotations

import importlib
from pathlib import Path

from pagedlib.grade.framework import Task

ORDER = ["kv_bytes", "allocator", "slots", "paged_attention", "decode_kernel", "sharing", "scheduler",
         "token_budget", "fp8", "radix", "eviction"]

TASKS: dict[str, Task] = {}
for _name in ORDER:
    if (Path(__file__).parent / f"{_name}.py").exists():
        TASKS[_name] = importlib.import_module(f"pagedlib.grade.tasks.{_name}").TASK
