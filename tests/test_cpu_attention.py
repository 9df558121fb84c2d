"""The fused CPU kernel (``attention="cpu"``, ``pagedlib/kernels/cpu_varlen.c``): equal to the float64 oracle
and to SDPA on mixed batches of every dtype, head size, group and block size it compiles apart; the same
result on any number of threads; its build found in the cache folder, rebuilt when the file there is
damaged, refused with a clear error without a compiler; a block table naming a block outside the pool is
refused, never read. (``test_varlen_attention.py`` runs it through the shared cases too, and
``test_engine_oracle.py`` checks the engine's tokens with it against transformers.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import check, varlen_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlib.kernels import cpu_varlen
from pagedlib.kernels.attention import TOLERANCES
from pagedlib.kernels.cpu_varlen import attend_cpu, paged_attention_varlen_cpu
from pagedlib.kernels.varlen import paged_attention_varlen

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """The kernel built once for the module; without a compiler the module is skipped, except in CI."""
    available, why = cpu_varlen.cpu_kernel_available()
    if not available:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the CPU kernel: {why}")
        pytest.skip(why)


@st.composite
def batches(draw):
    n = draw(st.integers(1, 5))
    return {"cached": draw(st.lists(st.integers(0, 70), min_size=n, max_size=n)),
            "new": draw(st.lists(st.one_of(st.just(1), st.integers(1, 40)), min_size=n, max_size=n)),
            "block_size": draw(st.sampled_from([1, 3, 4, 16, 32])), "kv_heads": draw(st.integers(1, 3)),
            "group": draw(st.sampled_from([1, 2, 3, 4, 7, 16, 32])),
            # 32, 64, 128: the kernel's compiled-apart head sizes; the others take its general loop
            "head_dim": draw(st.sampled_from([8, 32, 64, 80, 128, 256])),
            "dtype": draw(st.sampled_from(DTYPES)), "share": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16))}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_the_kernel_equals_the_oracle_and_sdpa_on_mixed_batches(case):
    """Decodes, chunks after cached tokens and whole prompts mixed; NaN in every unused slot; groups whose
    rows (token x query head) split across the kernel's tiles of 16 rows mid-token (3, 7) or mid-group
    (32)."""
    cache, args = varlen_case(**case, device="cpu")
    check(paged_attention_varlen_cpu(*args), cache, args)


def test_the_result_is_the_same_on_one_thread_and_on_several():
    """Work items never share a row: the threads change who computes a row, not how."""
    _, args = varlen_case([9, 0, 40, 3, 17], [1, 30, 1, 12, 1], block_size=4, group=4, head_dim=64,
                          device="cpu")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention_varlen_cpu(*args)
        torch.set_num_threads(3)
        several = paged_attention_varlen_cpu(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)


def test_it_agrees_with_the_gather_path_on_a_long_decode_batch():
    cache, args = varlen_case([300, 1, 129, 64], [1, 1, 1, 1], block_size=16, group=4, head_dim=128,
                              device="cpu")
    out = paged_attention_varlen_cpu(*args)
    torch.testing.assert_close(out, paged_attention_varlen(*args), **TOLERANCES[torch.float32])
    check(out, cache, args)


def test_a_table_naming_a_block_outside_the_pool_is_refused_not_read():
    """``attend_cpu`` (the engine's unchecked path) still never reads outside the pool: the kernel checks
    each block id it walks to."""
    _, (q, k, v, tables, lens, qsl) = varlen_case([5, 6], [1, 1], block_size=4, device="cpu")
    for bad in (k.shape[0], 10**6, -1):
        broken = tables.clone()
        broken[1, 0] = bad
        with pytest.raises(ValueError, match=f"block_tables names a block outside the pool of {k.shape[0]}"):
            attend_cpu(q, k, v, broken, lens, qsl, 0.25)


def test_its_own_limits_are_refused_with_a_message():
    _, (q, k, v, *rest) = varlen_case([5], [2], block_size=4, head_dim=16, device="cpu")
    wide = torch.zeros(*k.shape[:3], 272)
    with pytest.raises(ValueError, match="head_dim must be at most 256 for the CPU kernel, got 272"):
        paged_attention_varlen_cpu(torch.zeros(2, 4, 272), wide, wide, *rest)
    odd = torch.zeros(*k.shape, 2)[..., 0]                      # head_dim's stride is 2
    with pytest.raises(ValueError, match="k_cache's head_dim must be contiguous"):
        paged_attention_varlen_cpu(q, odd, v, *rest)


def test_the_engine_refuses_cpu_attention_for_a_head_dim_the_kernel_does_not_take():
    from helpers import tiny_hf_model

    from pagedlib.engine import Engine

    hf = tiny_hf_model("Llama", num_attention_heads=1, num_key_value_heads=1, hidden_size=528,
                       intermediate_size=8, num_hidden_layers=1)
    with pytest.raises(ValueError, match="at most 256 for the CPU kernel, the model has 528"):
        Engine.from_hf(hf, 8, 16, attention="cpu")


def test_the_build_is_found_in_the_cache_folder_and_not_compiled_again(monkeypatch):
    first = cpu_varlen.build()
    assert first.exists() and first.parent == cpu_varlen._cache_folder()
    monkeypatch.setattr(cpu_varlen, "_compile", lambda *a: pytest.fail("compiled although cached"))
    assert cpu_varlen.build() == first
    assert "-O3" in cpu_varlen.kernel_info()["flags"]


def _fresh_process(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a new Python whose kernel is not loaded yet (``env`` added to this one's)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=300)


ATTEND = ("import sys, torch; sys.path.insert(0, 'tests'); from helpers import varlen_case; "
          "from pagedlib.kernels.cpu_varlen import paged_attention_varlen_cpu; "
          "from pagedlib.kernels.varlen import paged_attention_varlen as torch_path; "
          "_, a = varlen_case([5, 9], [1, 3], block_size=4, device='cpu'); "
          "torch.testing.assert_close(paged_attention_varlen_cpu(*a), torch_path(*a)); print('ok')")


def test_a_damaged_library_in_the_cache_folder_is_built_again(tmp_path):
    done = _fresh_process(ATTEND, PAGEDLIB_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    (built,) = tmp_path.glob("cpu_varlen-*.so")
    built.write_bytes(b"not a shared library")
    again = _fresh_process(ATTEND, PAGEDLIB_CACHE_DIR=str(tmp_path))
    assert again.returncode == 0 and again.stdout.strip() == "ok", again.stderr
    assert built.read_bytes()[:4] == b"\x7fELF" or sys.platform != "linux"


ENGINE = ("import sys; sys.path.insert(0, 'tests'); from helpers import tiny_hf_model; "
          "from pagedlib.engine import Engine; Engine.from_hf(tiny_hf_model(), 8, 16, attention='cpu')")


@pytest.mark.parametrize("cc, message", [
    ("/nonexistent/cc", "needs a C compiler: none of ['/nonexistent/cc'] is on the PATH"),
    ("false", "could not build its C kernel with"),           # a "compiler" that always fails
])
def test_without_a_working_compiler_the_engine_refuses_cpu_attention_by_name(tmp_path, cc, message):
    done = _fresh_process(ENGINE, PAGEDLIB_CACHE_DIR=str(tmp_path), CC=cc)
    assert done.returncode != 0
    assert "RuntimeError: attention='cpu' " in done.stderr and message in done.stderr, done.stderr[-2000:]
    assert "attention='torch' needs none" in done.stderr or cc == "false"
    assert not list(tmp_path.glob("*.so"))                      # nothing half-built is left behind


def test_a_block_size_beyond_the_kernels_stack_is_refused_by_the_engine_and_the_kernel():
    from helpers import tiny_hf_model

    from pagedlib.engine import Engine

    with pytest.raises(ValueError, match="block_size must be at most 1024 for the CPU kernel, got 2048"):
        Engine.from_hf(tiny_hf_model(), 4, 2048, attention="cpu")
    big = torch.zeros(1, 1025, 2, 16)                           # one block of 1,025 slots
    args = (torch.zeros(2, 4, 16), big, big, torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([7], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_size must be at most 1024 for the CPU kernel, got 1025"):
        paged_attention_varlen_cpu(*args)
