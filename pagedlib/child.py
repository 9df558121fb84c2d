"""Every Python child process pagedlib starts goes through here: the vLLM worker (``vllm.bridge``), vLLM's
offloading manager (``vllm.offload``), the disaggregated decode engine (``disagg``), vLLM's attention
benchmark (``bench.vllm_attention``) and the PTX compiler (``teach.ptx``).

The parent's side: ``with Child("pagedlib.disagg", timeout=300) as child: answer = child.ask(payload)``, or
``run_child(module, payload, timeout)`` for one job. The child's side: a module whose ``__main__`` block
calls ``serve(handler)``; ``handler(payload)`` returns the answer (anything JSON can hold).

The protocol: the child is ``[sys.executable, "-m", module]`` with ``PYTHONPATH`` starting at this pagedlib's
folder (the child imports the same pagedlib wherever it starts) and the caller's variables merged in. Each
job is one JSON line on the child's stdin, ``{"id": n, "job": payload}``; each answer one JSON line on its
stdout, ``{"id": n, "answer": ...}`` or ``{"id": n, "error": "Type: message"}`` (the child goes on). An
answer for an earlier job (one whose caller was interrupted) is dropped, never returned for another.
``serve`` sends fd 1 to stderr and writes the answers to a copy of the original stdout, so nothing the
child prints (Python, C libraries, its own children) reaches the answers; a line that is no answer is
skipped. The child's stderr goes to a temporary file, quoted when it fails.

The guarantees: a job that outlives its timeout stops the child (terminate, then kill, then wait) and raises
``TimeoutError`` naming the module and the seconds; a child that exits before it answers raises
``ChildError`` (a ``RuntimeError``) naming the module, its exit code and the tail of its stderr; a job the
handler raised on raises ``ChildError`` with the handler's error; leaving a ``with`` block, normally or by
an exception (a Ctrl-C included), leaves no process behind. Nothing here imports more than the standard
library, so the caller's process stays free of what the children import.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)   # the folder holding this pagedlib
STDERR_TAIL = 3000                                   # characters of the child's stderr quoted in an error


class ChildError(RuntimeError):
    """A child that failed: ``error`` is the handler's error if it answered one (the child goes on), else
    None and ``exit_code`` says how it ended; ``stderr`` is the tail of its stderr."""

    def __init__(self, message: str, *, module: str, exit_code: int | None = None, error: str | None = None,
                 stderr: str = "") -> None:
        super().__init__(message)
        self.module, self.exit_code, self.error, self.stderr = module, exit_code, error, stderr


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: this process's with ``env`` merged in, ``PYTHONPATH`` made of this
    pagedlib's folder, then ``env``'s ``PYTHONPATH``, then this process's."""
    extra = dict(env or {})
    parts: list[str] = []
    for paths in (ROOT, extra.pop("PYTHONPATH", ""), os.environ.get("PYTHONPATH", "")):
        parts += [p for p in paths.split(os.pathsep) if p and p not in parts]
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(parts)}


class Child:
    """``python -m module`` answering jobs, one JSON line each (module docstring). ``timeout``: the seconds
    a job may take by default; ``env``: more environment variables for the child."""

    def __init__(self, module: str, *, env: dict[str, str] | None = None, timeout: float = 600.0) -> None:
        self.module, self.timeout = module, float(timeout)
        self.name = f"python -m {module}"
        self.jobs = 0                                        # the last job's id
        self._stderr = tempfile.TemporaryFile()
        self._stderr_tail = ""                               # kept when the file is closed
        self._inbox: queue.Queue[bytes | None] = queue.Queue()     # lines for the child; None: end its input
        self._outbox: queue.Queue[bytes | None] = queue.Queue()    # its stdout's lines; None: it ended
        self._noise = ""                                     # stdout lines that were no answer (the last)
        self.process = subprocess.Popen([sys.executable, "-m", module], env=child_env(env),
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        for pump in (self._pump_in, self._pump_out):       # threads: no read or write ever blocks the caller
            threading.Thread(target=pump, daemon=True, name=f"{self.name} {pump.__name__}").start()

    def _pump_in(self) -> None:
        stdin = self.process.stdin
        try:
            while (line := self._inbox.get()) is not None:
                stdin.write(line)
                stdin.flush()
        except OSError:                      # the child is gone: its end is reported by the answer it lacks
            pass
        finally:
            try:
                stdin.close()
            except OSError:
                pass

    def _pump_out(self) -> None:
        with self.process.stdout as stdout:
            for line in stdout:
                self._outbox.put(line)
        self._outbox.put(None)

    def send(self, payload: Any) -> int:
        """Hand the child one job without waiting; returns its id. ``ChildError`` if the child has stopped."""
        if self.process.poll() is not None or self._stderr.closed:
            raise self._failed(f"has stopped (closed, timed out or exited with {self.process.returncode}): "
                               f"start a new one")
        line = (json.dumps({"id": self.jobs + 1, "job": payload}) + "\n").encode()
        self.jobs += 1
        self._inbox.put(line)
        return self.jobs

    def end_input(self) -> None:
        """Close the child's stdin once the jobs sent are written: ``serve`` returns, the child exits."""
        self._inbox.put(None)

    def ask(self, payload: Any, timeout: float | None = None) -> Any:
        """Send one job and wait for its answer (``answer``)."""
        return self.answer(self.send(payload), timeout)

    def answer(self, job: int, timeout: float | None = None) -> Any:
        """The answer to job ``job``, waiting ``timeout`` seconds at most (default: the child's); answers to
        earlier jobs are dropped. ``TimeoutError`` (the child stopped) or ``ChildError``."""
        seconds = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + seconds
        while True:
            try:
                line = self._outbox.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                self.close(grace=0)
                raise TimeoutError(f"{self.name} did not answer job {job} within {seconds:g} s: the child "
                                   f"was stopped") from None
            if line is None:
                self._outbox.put(None)                       # every later wait sees the end too
                raise self._exited(job)
            reply = _reply_of(line)
            if reply is None:                                # something printed: kept for the error
                self._noise = (self._noise + "\n" + line.decode(errors="replace")).strip()[-300:]
            elif reply["id"] == job and "error" in reply:
                raise ChildError(f"{self.name} failed job {job}: {reply['error']}\n{self.stderr_tail()}",
                                 module=self.module, error=str(reply["error"]), stderr=self.stderr_tail())
            elif reply["id"] == job:
                return reply["answer"]

    def _exited(self, job: int) -> ChildError:
        """The error of a child whose stdout ended before it answered ``job`` (it is waited for)."""
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:                    # it closed its stdout and went on: stopped
            _stop(self.process)
        noise = f"; it printed instead: {self._noise!r}" if self._noise else ""
        return self._failed(f"exited with {self.process.returncode} without answering job {job}{noise}")

    def _failed(self, what: str) -> ChildError:
        code = self.process.returncode
        signal = f" (signal {-code})" if code is not None and code < 0 else ""
        tail = self.stderr_tail()
        return ChildError(f"{self.name} {what}{signal}; its stderr ends:\n{tail}", module=self.module,
                          exit_code=code, stderr=tail)

    def stderr_tail(self) -> str:
        """The last ``STDERR_TAIL`` characters of the child's stderr."""
        if self._stderr.closed:
            return self._stderr_tail
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - STDERR_TAIL)
        if hasattr(os, "pread"):             # the child shares the file's offset: leave it where it is
            data = os.pread(fd, size - start, start)
        else:
            self._stderr.seek(start)
            data = self._stderr.read()
        return data.decode(errors="replace").strip() or "(nothing on stderr)"

    def close(self, grace: float = 10.0) -> None:
        """Stop the child: it exits by itself once its input ends (within ``grace`` seconds), else it is
        terminated, then killed; it is always waited for. Closing again does nothing."""
        self.end_input()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _stop(self.process)
        except BaseException:                # a Ctrl-C while waiting: the child is stopped all the same
            _stop(self.process)
            raise
        finally:
            if not self._stderr.closed and self.process.returncode is not None:
                self._stderr_tail = self.stderr_tail()
                self._stderr.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, error: object, *rest: object) -> None:
        self.close(grace=0 if error is not None else 10.0)   # an interrupted block stops the child at once


def _stop(process: subprocess.Popen) -> None:
    """Terminate ``process``, kill it if it is still there 5 s later, and wait for it."""
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _reply_of(line: bytes) -> dict[str, Any] | None:
    """The answer a stdout line holds, or None for a line that is none (something the child printed)."""
    try:
        reply = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(reply, dict) and "id" in reply and ("answer" in reply or "error" in reply)
    return reply if ok else None


def run_child(module: str, payload: Any, timeout: float, env: dict[str, str] | None = None) -> Any:
    """One job in a new child (``python -m module``), which then exits: its answer, or ``TimeoutError`` or
    ``ChildError`` (no process is left behind either way)."""
    with Child(module, env=env, timeout=timeout) as child:
        job = child.send(payload)
        child.end_input()
        return child.answer(job)


# ---- the child's side ------------------------------------------------------------------------------------

def serve(handler: Callable[[Any], Any]) -> None:
    """Answer jobs until stdin ends: ``handler(payload)`` per job line, its answer (or its error, with the
    traceback on stderr) one line on the original stdout; fd 1 goes to stderr first, so whatever the handler
    or a library prints never reaches the answers."""
    sys.stdout.flush()
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    answers.write("\n")                  # ends a line printed without a newline before serve started
    answers.flush()
    for line in sys.stdin:
        if line.strip():
            reply = _answer(handler, line)
            sys.stdout.flush()
            answers.write(reply + "\n")
            answers.flush()


def _answer(handler: Callable[[Any], Any], line: str) -> str:
    """The answer line to one job line: the handler's answer, or its error (the traceback printed on stderr;
    a line that is no job is an error too, with no id)."""
    request: Any = None
    try:
        request = json.loads(line)
        return json.dumps({"id": request["id"], "answer": handler(request["job"])})
    except Exception as error:           # the parent raises it, quoting the stderr this traceback goes to
        traceback.print_exc()
        job = request.get("id") if isinstance(request, dict) else None
        return json.dumps({"id": job, "error": f"{type(error).__name__}: {error}"})
