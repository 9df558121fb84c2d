"""Every benchmark command refuses a bad flag with a usage error (exit 2) before doing any work."""

from __future__ import annotations

import pytest

from pagedlib.bench.__main__ import main

BAD_RUN_OPTIONS = [
    ["--repeats", "0"],
    ["--repeats", "two"],
    ["--threads", "-1"],
    ["--threads", "0"],
    ["--device", "tpu"],
    ["--json", "/nonexistent-folder/out.json"],
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
