"""Every benchmark command refuses a bad flag with a usage error (exit 2) before doing any work."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagedlib.bench.__main__ import main

BAD_RUN_OPTIONS = [
    ["--repeats", "0"],
    ["--repeats", "two"],
    ["--threads", "-1"],
    ["--threads", "0"],
    ["--device", "tpu"],
    ["--json", "/nonexistent-folder/out.json"],
    ["--threads", "100000"],                 # issue 37, defect 14: bounded by the CPU count
    ["--json", ""],                          # defect 30: nothing would be written
    ["--json", "/dev/full"],                 # defect 29: not a regular file
    ["--json", "/proc/x.json"],              # defect 29: /proc takes no new file, even from root
]


@pytest.mark.parametrize("command", ["alloc", "attention", "generate"])
@pytest.mark.parametrize("flags", BAD_RUN_OPTIONS, ids=lambda f: " ".join(f))
def test_shared_run_options_are_checked_before_the_run(command, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flags[0]}" in err and "usage:" in err


def test_cuda_is_refused_where_there_is_none(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    with pytest.raises(SystemExit) as exit_info:
        main(["alloc", "--device", "cuda"])
    assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--repeats", "0"], ["--json", "/nonexistent-folder/x.json"]])
def test_tracer_bench_flags(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["tracer", *flags])
    assert exit_info.value.code == 2


BAD_ALLOC_SIZES = [
    ["--batches", "a,b"],
    ["--batches", "0"],
    ["--batches", "4,,16"],
    ["--block-size", "0"],
    ["--prompt", "-5"],
    ["--layers", "0"],
    ["--kv-heads", "-1"],
    ["--head-dim", "0"],
    ["--head-dim", "1.5"],
]


@pytest.mark.parametrize("flags", BAD_ALLOC_SIZES, ids=lambda f: " ".join(f))
def test_alloc_sizes_are_checked_before_the_run(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["alloc", *flags])
    assert exit_info.value.code == 2
    assert f"argument {flags[0]}: expected an integer" in capsys.readouterr().err


LIMIT = 2 * 2**30  # address space of a probe: a few times what importing torch and pagedlib takes


@pytest.mark.skipif(sys.platform != "linux", reason="resource.RLIMIT_AS is Linux's")
@pytest.mark.parametrize("argv", [
    ["alloc", "--head-dim", "1000000000"],
    ["alloc", "--batches", "1", "--repeats", "1", "--prompt", "10000000000"],
    ["attention", "--context", "2000000000"],
    ["attention", "--contexts", "128,2000000000"],
    ["attention", "--block-sizes", "1,1000000000", "--batch", "1000"],
], ids=lambda argv: " ".join(argv))
def test_a_run_larger_than_the_machine_is_a_usage_error_before_any_allocation(argv):
    """In a subprocess whose address space is capped at 2 GiB: refused from the flags, nothing allocated."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({LIMIT}, {LIMIT}))
        from pagedlib.bench.__main__ import main
        sys.exit(main({argv!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "GiB, more than the" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "1000000000"], "exceeds the model's 4096 positions"),
    (["--num-requests", "100000", "--max-prompt", "2000", "--hidden", "8192", "--heads", "64",
      "--kv-heads", "64"], "needs about"),
])
def test_generate_sizes_are_checked_before_the_run(flags, message, capsys):
    """Issue 37, defect 13: a huge run of ``bench generate`` is a usage error before any work."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
