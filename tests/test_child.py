"""``pagedlib.child``: every Python child process pagedlib starts, and the guarantees each caller gets.

The children are ``tests/childish.py`` (what it does is chosen by ``CHILDISH``), started with this folder on
PYTHONPATH through the helper's ``env``; the callers' tests put it in place of their own child module. The
process table (``/proc``) says whether a child outlived its error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import pagedlib.child
from pagedlib.child import ROOT, Child, ChildError, child_env, run_child

TESTS = str(Path(__file__).resolve().parent)
PROC = os.path.isdir("/proc/self")


def childish(behaviour: str = "echo") -> dict[str, str]:
    return {"PYTHONPATH": TESTS, "CHILDISH": behaviour}


def gone(pid: int) -> bool:
    """No process ``pid`` in the process table (a child waited for leaves none, not even a zombie)."""
    return not PROC or not os.path.exists(f"/proc/{pid}")


def children_running(fragment: bytes) -> list[int]:
    """Ids of this process's children whose command line holds ``fragment``, from the process table."""
    found = []
    for entry in os.listdir("/proc") if PROC else []:
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except (OSError, ValueError):                          # not a process, or it ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and fragment in cmdline:
            found.append(int(entry))
    return found


@pytest.fixture
def as_caller(monkeypatch):
    """Make ``tests/childish.py`` importable by a caller's child and choose what it does."""
    def use(behaviour: str) -> None:
        paths = (TESTS, os.environ.get("PYTHONPATH"))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
        monkeypatch.setenv("CHILDISH", behaviour)
    return use


# ---- the helper ------------------------------------------------------------------------------------------

def test_a_child_answers_with_this_pagedlib_wherever_it_starts(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)                  # not the checkout: only PYTHONPATH finds this pagedlib
    answer = run_child("childish", {"a": [1, 2]}, timeout=60, env=childish())
    assert answer["echo"] == {"a": [1, 2]} and gone(answer["pid"])
    assert answer["pagedlib"] == pagedlib.child.__file__


def test_the_environment_merges_and_puts_this_pagedlib_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/callers")
    env = child_env({"PYTHONPATH": "/extra", "X_CHILD": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [ROOT, "/extra", "/callers"] and env["X_CHILD"] == "1"
    assert env["PATH"] == os.environ["PATH"]


def test_a_job_past_its_timeout_stops_the_child():
    child = Child("childish", env=childish("sleep"), timeout=60)
    with pytest.raises(TimeoutError, match=r"python -m childish did not answer job 1 within 1.5 s"):
        child.ask("wake up", timeout=1.5)
    assert child.process.returncode is not None and gone(child.process.pid)
    with pytest.raises(ChildError, match="has stopped"):
        child.send("again")
    child.close()                                             # closing again is fine


def test_a_child_that_dies_names_its_exit_code_and_quotes_its_stderr():
    with pytest.raises(RuntimeError, match="python -m childish exited with 3 without answering") as error:
        run_child("childish", [1], timeout=60, env=childish("exit3"))
    assert "childish: dying on purpose with exit 3" in str(error.value)
    assert isinstance(error.value, ChildError) and error.value.exit_code == 3


def test_what_a_child_prints_never_corrupts_its_answer():
    """Python's print, a raw write to fd 1 and a forged answer line in the handler go to stderr; a line
    without a newline printed before ``serve`` started is ended and skipped."""
    with Child("childish", env=childish("noisy"), timeout=60) as child:
        for payload in ({"x": 1}, "two"):
            assert child.ask(payload)["echo"] == payload
        assert "garbage from print" in child.stderr_tail() and '"forged"' in child.stderr_tail()


def test_a_child_that_answers_nothing_is_an_error_quoting_what_it_printed():
    with pytest.raises(RuntimeError, match="exited with 0 without answering job 1"):
        run_child("childish", [1], timeout=60, env=childish("silent"))
    with pytest.raises(RuntimeError, match="exited with 0 .*printed instead: 'garbage before serve"):
        run_child("childish", [1], timeout=60, env=childish("garbage-then-silent"))


def test_an_error_in_the_handler_is_raised_and_the_child_goes_on():
    with Child("childish", env=childish("raise"), timeout=60) as child:
        for number in (1, 2):
            with pytest.raises(ChildError, match=f"job {number}: ValueError: childish refuses") as error:
                child.ask(number)
            assert "Traceback" in error.value.stderr and child.process.poll() is None


def test_a_line_that_is_no_job_does_not_kill_the_child():
    """A line of another protocol (a JSON list, as the old offload child read) is answered with an error
    without an id, which no caller waits for; the child goes on."""
    with Child("childish", env=childish(), timeout=60) as child:
        child._inbox.put(b"[1, 2]\n")
        assert child.ask("after")["echo"] == "after"
        assert "TypeError" in child.stderr_tail() or "KeyError" in child.stderr_tail()


def test_an_answer_left_by_an_interrupted_job_is_dropped():
    with Child("childish", env=childish(), timeout=60) as child:
        child.send("first, never read")
        assert child.ask("second")["echo"] == "second"
        assert child.ask("third")["echo"] == "third"
    assert child.process.returncode == 0                       # it ended by itself when its input did


def test_a_keyboard_interrupt_in_the_with_block_stops_the_child():
    with pytest.raises(KeyboardInterrupt), Child("childish", env=childish("sleep"), timeout=600) as child:
        child.send("busy")
        raise KeyboardInterrupt
    assert child.process.returncode is not None and gone(child.process.pid)
    assert children_running(b"childish") == []


# ---- every caller ----------------------------------------------------------------------------------------

def test_decode_in_child_times_out_and_leaves_no_process(tmp_path):
    from pagedlib.disagg import decode_in_child

    with pytest.raises(TimeoutError, match=r"python -m pagedlib.disagg did not answer .* within 0.5 s"):
        decode_in_child(tmp_path, [[1, 2, 3]], 2, timeout=0.5)
    assert children_running(b"pagedlib.disagg") == []


def test_a_decode_process_that_dies_is_a_runtime_error(monkeypatch, tmp_path, as_caller):
    from pagedlib import disagg

    as_caller("exit3")
    monkeypatch.setattr(disagg, "CHILD_MODULE", "childish")
    with pytest.raises(RuntimeError, match="the decode process failed: python -m childish exited with 3"):
        disagg.decode_in_child(tmp_path, [[1, 2, 3]], 2)


def test_a_silent_offload_child_is_a_runtime_error_and_a_slow_one_times_out(monkeypatch, as_caller):
    from pagedlib.vllm import bridge, offload

    monkeypatch.setattr(bridge, "vllm_available", lambda: (True, ""))
    monkeypatch.setattr(offload, "CHILD_MODULE", "childish")
    as_caller("silent")
    with pytest.raises(RuntimeError, match="python -m childish exited with 0 without answering"):
        offload.vllm_manager_hits([[1]], 4)
    as_caller("sleep")
    with pytest.raises(TimeoutError, match="within 0.5 s"):
        offload.vllm_manager_runs([([[1]], 4, "lru")], timeout=0.5)
    assert children_running(b"childish") == []


def test_the_hybrid_manager_child_that_dies_is_silent_or_slow_is_an_error_and_leaves_no_process(
        monkeypatch, as_caller):
    """Notebook 15's oracle (vLLM's KVCacheManager over KV-cache groups) starts through the same helper."""
    from pagedlib.core.groups import FULL, SLIDING, KVGroup
    from pagedlib.vllm import bridge, hybrid

    monkeypatch.setattr(bridge, "vllm_available", lambda: (True, ""))
    monkeypatch.setattr(hybrid, "CHILD_MODULE", "childish")
    run = dict(groups=(KVGroup(FULL, None, (1,)), KVGroup(SLIDING, 4, (0,))),
               ops=[hybrid.Add("a", [1, 2, 3])], block_size=2, num_blocks=8)
    as_caller("exit3")
    with pytest.raises(RuntimeError, match="python -m childish exited with 3") as error:
        hybrid.vllm_hybrid_run(**run)
    assert "dying on purpose" in str(error.value)
    as_caller("silent")
    with pytest.raises(RuntimeError, match="python -m childish exited with 0 without answering"):
        hybrid.vllm_hybrid_run(**run)
    as_caller("sleep")
    with pytest.raises(TimeoutError, match="within 0.5 s"):
        hybrid.vllm_hybrid_runs([run], timeout=0.5)
    assert children_running(b"childish") == []


def test_a_vllm_attention_process_that_dies_is_reported_with_its_last_words(monkeypatch, as_caller):
    from pagedlib.bench import attention

    as_caller("exit3")
    monkeypatch.setattr(attention, "VLLM_CHILD", "childish")
    with pytest.raises(RuntimeError, match="the vLLM attention process failed: python -m childish exited "
                                           "with 3") as error:
        attention.vllm_rows([attention.AttentionConfig()], repeats=1, threads=1)
    assert "dying on purpose" in str(error.value)


def test_a_ptx_compiler_that_answers_nothing_is_a_runtime_error(monkeypatch, as_caller):
    pytest.importorskip("triton")
    from pagedlib.teach import ptx

    as_caller("silent")
    monkeypatch.setattr(ptx, "CHILD_MODULE", "childish")
    with pytest.raises(RuntimeError, match="GPU target failed: python -m childish exited with 0"):
        ptx.compile_for_gpu_many([{"arch": 80}])


@pytest.mark.skipif(sys.platform == "win32", reason="the process table is read from /proc")
def test_children_running_sees_a_live_child():
    """The process-table check the tests above rely on finds a child while it runs."""
    with Child("childish", env=childish("sleep"), timeout=60) as child:
        assert child.process.pid in children_running(b"childish") or not PROC
    assert children_running(b"childish") == []
