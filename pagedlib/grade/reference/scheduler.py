"""pagedlib's answer to task ``scheduler``: its own ``Scheduler`` over a ``PagedKVCache`` (whole prompts, no
prefix caching, no watermark), each step planned by ``schedule`` and run by ``update``."""

from pagedlib.grade.tasks.scheduler import PagedlibScheduler as Scheduler

__all__ = ["Scheduler"]
