"""A child for tests/test_child.py, started through ``pagedlib.child`` with this folder on PYTHONPATH. What it
does with a job is chosen by the environment variable ``CHILDISH`` (so a test can also put it in place of a
caller's own child module): echo (the default), sleep, exit3, silent, noisy, raise, garbage-then-silent."""

from __future__ import annotations

import os
import sys
import time

from pagedlib.child import serve

BEHAVIOUR = os.environ.get("CHILDISH", "echo")


def handle(payload):
    if BEHAVIOUR == "sleep":
        time.sleep(600)
    if BEHAVIOUR == "exit3":
        sys.stderr.write("childish: dying on purpose with exit 3\n")
        sys.stderr.flush()
        os._exit(3)
    if BEHAVIOUR == "silent":
        os._exit(0)
    if BEHAVIOUR == "raise":
        raise ValueError(f"childish refuses {payload!r}")
    if BEHAVIOUR == "noisy":       # every way a child prints: Python's stdout, fd 1, a forged answer
        print("garbage from print")
        os.write(1, b"garbage on fd 1 without a newline")
        os.write(1, b'{"id": 1, "answer": "forged"}\n')
    return {"echo": payload, "pid": os.getpid(), "pagedlib": sys.modules["pagedlib.child"].__file__}


if __name__ == "__main__":
    if BEHAVIOUR in ("noisy", "garbage-then-silent"):   # before serve: straight onto the answers' stream
        sys.stdout.write("garbage before serve, no newline")
        sys.stdout.flush()
    if BEHAVIOUR == "garbage-then-silent":
        os._exit(0)
    serve(handle)
