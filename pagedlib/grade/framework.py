"""What a task is made of, and how one check runs against a reader's module.

A ``Task`` is one idea of the course to build: the file the reader writes (``notebooks/tasks/<file>``), the
notebook section it comes from, and its ``Check``\\ s. A check is a function of the reader's module that
returns when the module does what the course says and raises ``Failed`` (or any ``AssertionError``) when it
does not. Checks over many generated inputs are hypothesis properties (``cases``): hypothesis shrinks a
failure to its smallest input, and that input is what the reader sees, with the expected value beside the
value their code gave.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, Phase, settings

OUT_OF_MEMORY = "ran out of memory: the grader lets your code's process map {} MiB".format(
    os.environ.get("PAGEDLIB_GRADE_MEMORY_MB", "4096"))


class Failed(AssertionError):
    """A check's finding: ``what`` went wrong, on ``case`` (the input), ``expected`` against ``got``."""

    def __init__(self, what: str, *, expected: Any = None, got: Any = None, case: Any = None) -> None:
        self.what, self.expected, self.got, self.case = what, expected, got, case
        lines = [what]
        if case is not None:
            lines.append(f"input:    {_short(case)}")
        if expected is not None or got is not None:
            lines += [f"expected: {_short(expected)}", f"got:      {_short(got)}"]
        super().__init__("\n".join(lines))


def expect_equal(what: str, expected: Any, got: Any, case: Any = None) -> None:
    """``Failed`` unless ``got == expected``."""
    if not _equal(expected, got):
        raise Failed(what, expected=expected, got=got, case=case)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:                      # an answer that cannot even be compared is a wrong answer
        return False


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def cases(n: int = 100) -> settings:
    """Hypothesis settings for a check's property: ``n`` generated inputs, the same ones on every run (a grade
    is a fact about the code, not about a seed), no deadline (the reader's code may be slow), no example
    database (nothing is written beside the reader's files), and one failure reported: the first found,
    shrunk (two failures of different kinds, say a ``Failed`` and an error the reader's code raised, would
    otherwise come back as an ``ExceptionGroup`` whose message shows neither). While ``run_check`` probes a
    check (``_probe``), one input and no shrinking."""
    quick = {"max_examples": 1, "phases": [Phase.explicit, Phase.generate]} if _probe["on"] else {}
    _probe["used"] = True
    return settings(**{"max_examples": n, **quick}, derandomize=True, database=None, deadline=None,
                    print_blob=False, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))


# A skeleton raises NotImplementedError for every input, and hypothesis would spend seconds shrinking that
# one failure; so a check runs first with one input per property (``on``), and again in full unless that
# run was a skeleton's, or was already the whole check (``used``: no property asked for its settings).
_probe = {"on": False, "used": False}


@dataclass(frozen=True)
class Check:
    """One property of a task, named in plain words; ``hint`` names what to reread when it fails;
    ``seconds``: how long it may run before the reader's code is taken to hang."""

    name: str
    run: Callable[[ModuleType], None]
    hint: str
    seconds: float = 30.0


@dataclass(frozen=True)
class Task:
    """One piece to build: ``name`` (what the grader is called with), the ``notebook`` it belongs to, the
    ``file`` the reader writes, a one-line ``title`` and the ``checks``, in the order they are graded."""

    name: str
    notebook: str
    file: str
    title: str
    checks: tuple[Check, ...] = field(default_factory=tuple)


def load(path: str | Path, name: str) -> ModuleType:
    """The module in ``path``, loaded afresh under a private name (a reader's edits are always seen)."""
    spec = importlib.util.spec_from_file_location(f"pagedlib_grade_{name}", str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def run_check(check: Check, module: ModuleType, path: str) -> dict[str, Any]:
    """Run one check; the result a report shows: ``ok``, and for a failure ``kind`` (``"todo"``: the
    reader's code raised ``NotImplementedError``; ``"wrong"``: a check's finding; ``"error"``: their code
    raised; ``"memory"``: it ran out of the memory limit) with a ``message`` and, from hypothesis, the
    smallest ``case`` that fails."""
    _probe.update(on=True, used=False)
    try:
        first = _attempt(check, module, path)
    finally:
        _probe["on"] = False
    if first.get("kind") in ("todo", "memory") or not _probe["used"]:
        return first
    return _attempt(check, module, path)


def _attempt(check: Check, module: ModuleType, path: str) -> dict[str, Any]:
    try:
        check.run(module)
    except NotImplementedError:
        return {"ok": False, "kind": "todo", "message": "not written yet: it raises NotImplementedError"}
    except MemoryError:
        return {"ok": False, "kind": "memory", "message": OUT_OF_MEMORY}
    except Exception as error:
        if any(_out_of_memory(e) for e in _chain(error)):      # hypothesis may wrap it in an error of its own
            return {"ok": False, "kind": "memory", "message": OUT_OF_MEMORY}
        return _failure(error, path)
    return {"ok": True}


def _failure(error: Exception, path: str) -> dict[str, Any]:
    """A check's finding (an ``AssertionError``), or an error the reader's code raised, with its line."""
    if isinstance(error, AssertionError):
        return {"ok": False, "kind": "wrong", "message": str(error) or type(error).__name__,
                "case": _falsifying(error)}
    return {"ok": False, "kind": "error", "case": _falsifying(error),
            "message": f"raised {type(error).__name__}: {error}{_where(error, path)}"}


def _chain(error: BaseException) -> list[BaseException]:
    """``error``, its causes and contexts, and the errors of a group, each once."""
    seen: dict[int, BaseException] = {}
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen[id(e)] = e
            todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return list(seen.values())


def _out_of_memory(error: BaseException) -> bool:
    """A ``MemoryError``, or torch's report of an allocation the limit refused (a RuntimeError)."""
    text = str(error)
    return isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text))


def _falsifying(error: BaseException) -> str | None:
    """The smallest input hypothesis found, from the notes it adds to the error it re-raises."""
    notes = [n for n in getattr(error, "__notes__", ()) if n.startswith("Falsifying example")]
    return notes[0] if notes else None


def _where(error: BaseException, path: str) -> str:
    """`` (line N of the reader's file: code)`` for the deepest frame in the reader's file, if any."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == Path(path)]
    if not frames:
        return ""
    frame = frames[-1]
    return f"\n  at line {frame.lineno} of {Path(path).name}: {frame.line}"
