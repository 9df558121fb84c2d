"""The cheat sheet (``notebooks/cheatsheet.md``): the committed page is what ``render()`` writes, each
worked example recomputed here from first principles (the models' config numbers, datasheet figures, torch's
own fp8 casts) is the number on the page, and the vLLM defaults it states are the installed vLLM's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedlib.sim import disagg
from pagedlib.teach import cheatsheet
from pagedlib.vllm.bridge import VLLM_VERSION, vllm_available

PAGE = cheatsheet.PAGE.read_text(encoding="utf-8")
KiB, MiB = 2**10, 2**20
LLAMA_3_8B_FP16 = 2 * 32 * 8 * 128 * 2  # K and V x layers x KV heads x head_dim x bytes (its config.json)


def section(title: str) -> str:
    """The text of the page's entry whose heading starts with ``title``."""
    start = PAGE.index(f"## {title}")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:end if end > 0 else None]


def test_the_committed_page_is_what_render_writes():
    assert PAGE == cheatsheet.render(), "run: python -m pagedlib.teach.cheatsheet"
    assert cheatsheet.main(["--check"]) == 0


def test_check_fails_on_a_stale_page_and_writing_mends_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cheatsheet, "PAGE", tmp_path / "cheatsheet.md")
    assert cheatsheet.main(["--check"]) == 1  # no page yet
    (tmp_path / "cheatsheet.md").write_text(PAGE.replace("128 KiB", "127 KiB"))
    assert cheatsheet.main(["--check"]) == 1 and "out of date" in capsys.readouterr().err
    assert cheatsheet.main([]) == 0 and cheatsheet.main(["--check"]) == 0
    assert cheatsheet.main(["--bad"]) == 2


def test_kv_bytes_per_token_and_per_sequence():
    text = section("KV bytes")
    assert f"{LLAMA_3_8B_FP16:,} B = {LLAMA_3_8B_FP16 // KiB} KiB a token" in text
    assert f"4,096 tokens: {4096 * LLAMA_3_8B_FP16 // MiB} MiB" in text
    llama_2 = 2 * 32 * 32 * 128 * 2
    assert f"needs {llama_2 // KiB} KiB a token, {llama_2 // LLAMA_3_8B_FP16} times more" in text
    assert "32 query heads / 8 KV heads = 4" in text


def test_blocks_and_the_tail():
    text = section("Blocks")
    blocks = -(-1000 // 16)
    assert f"{blocks} blocks, {blocks * 16:,} slots, {blocks * 16 - 1000} of them empty" in text
    mean = sum((-n) % 16 for n in range(16)) / 16  # empty slots of the last block, over every remainder
    assert f"At most 15 and on average {mean} slots" in text
    assert f"{mean * LLAMA_3_8B_FP16 / KiB:.0f} KiB a sequence" in text


def test_the_sliding_window_bounds():
    def touched(w, b):  # the most blocks w consecutive positions meet, over every offset in a block
        return max((start + w - 1) // b - start // b + 1 for start in range(b))

    text = section("Sliding window")
    assert f"touches at most {touched(4096, 16)} blocks and a request holds at most {4096 // 16 + 1}," in text
    assert f"{(4096 // 16 + 1) * 16 * LLAMA_3_8B_FP16 // MiB} MiB" in text  # Mistral-7B: Llama-3-8B's shape
    assert f"touches at most {touched(17, 16)}, holds at most {math.ceil(17 / 16) + 1}." in text


def test_the_hybrid_rule():
    text = section("Hybrid models")
    skipped = (300 - 64 + 1) // 16                  # blocks wholly before the window of the token at 300
    decode = math.ceil(301 / 16) - skipped
    prompt = math.ceil(300 / 16)
    assert f"holds {prompt} blocks in the step that computes it, {decode} during the next" in text
    assert f"wastes {1 / 2 * (1 - 4096 / 8192):.2%}" in text                      # vLLM RFC #11382: 25%
    assert f"`L` = 131,072) {3 / 4 * (1 - 32768 / 131072):.2%}." in text         # and 56.25%


def test_the_split_k_rule():
    text = section("Split-K")
    assert f"batch 1 at 32,768 tokens, {math.ceil(2 * 132 / 8)} splits" in text  # two waves of 132 SMs
    assert "batch 64 at 32,768 tokens, 1;" in text
    assert f"batch 1 at 2,000 tokens, {2000 // 256} (2,000 // 256)" in text


def test_fp8_bytes_and_rounding():
    text = section("FP8")
    assert f"{LLAMA_3_8B_FP16 // 2 // KiB} KiB a token" in text
    assert "at most 6.25% off, finite range to 448," in text
    assert "at most 12.5% off, finite range to 57,344," in text
    x = torch.tensor(0.1)
    e4m3, e5m2 = x.to(torch.float8_e4m3fn).item(), x.to(torch.float8_e5m2).item()  # torch's own casts
    assert (e4m3, e5m2) == (0.1015625, 0.09375)
    assert f"e4m3 gives back {e4m3} (+{e4m3 / 0.1 - 1:.2%}), e5m2 {e5m2} ({e5m2 / 0.1 - 1:.2%})" in text
    scale = torch.tensor(7.89) / 448
    back = ((torch.tensor(0.3) / scale).to(torch.float8_e4m3fn).float() * scale).item()
    assert f"scale 7.89 / 448 = {scale.item():.4f}" in text and f"comes back as {back:.4f}" in text


def test_load_against_recompute():
    text = section("Load K/V")
    bandwidth = 32e9 * 16 * 128 / 130 / 8  # PCIe 5.0 x16, one direction
    load = 4096 * LLAMA_3_8B_FP16 / bandwidth
    again = (2 * 8.03e9 * 4096 + 2 * 32 * (32 * 128) * 4096**2) / 989e12  # weights + causal attention
    assert f"loads in {load * 1e3:.1f} ms and is recomputed in {again * 1e3:.1f} ms" in text
    for b in (16, 4):
        per_token = 32 * 10e-6 / b + LLAMA_3_8B_FP16 / bandwidth
        crossover = (per_token * 989e12 - 2 * 8.03e9) / (2 * 32 * 32 * 128)
        assert f"{crossover:,.0f}" in text
    assert "`n*` = 0." in text  # with no cost per copy, loading 128 KiB beats 2 x 8.03e9 FLOPs a token


def test_goodput_is_the_highest_rate_that_meets_both_objectives():
    text = section("Goodput")
    cost = disagg.step_cost()
    for ttft, itl in ((1.0, 0.05), (0.3, 0.012)):
        rate = disagg.goodput(disagg.disaggregated, 4000, 200, cost=cost, ttft_slo=ttft, itl_slo=itl)
        assert f"one decode GPU {rate:.1f} requests/s" in text
        met = disagg.disaggregated(cost, 4000, 200, rate)
        assert met.ttft <= ttft and met.itl <= itl
        missed = disagg.disaggregated(cost, 4000, 200, rate * 1.002)
        assert missed is None or missed.ttft > ttft or missed.itl > itl


# --- vLLM's defaults, read from the installed vLLM ----------------------------------------------------

READ_VLLM = textwrap.dedent("""
    import dataclasses, json, types
    import vllm, vllm.config.cache, vllm.engine.arg_utils as arg_utils
    from vllm.config import CacheConfig, SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import cpu
    from vllm.usage.usage_lib import UsageContext

    def default(cls, name):
        value = next(f.default for f in dataclasses.fields(cls) if f.name == name)
        return getattr(value, "default", value)  # pydantic keeps some defaults in a FieldInfo

    def batch(gib, name, is_cpu=False):
        arg_utils.current_platform = types.SimpleNamespace(
            get_device_total_memory=lambda: gib * 2**30, get_device_name=lambda: name,
            is_tpu=lambda: False, is_cpu=lambda: is_cpu)
        tokens, _ = EngineArgs.get_batch_defaults(world_size=1)
        return [tokens[UsageContext.LLM_CLASS], tokens[UsageContext.OPENAI_API_SERVER]]

    cache_source = open(vllm.config.cache.__file__).read()
    print(json.dumps({
        "version": vllm.__version__,
        "BLOCK_SIZE": CacheConfig.DEFAULT_BLOCK_SIZE,
        "ENABLE_PREFIX_CACHING": default(CacheConfig, "enable_prefix_caching"),
        "ENABLE_CHUNKED_PREFILL": default(SchedulerConfig, "enable_chunked_prefill"),
        "MAX_NUM_BATCHED_TOKENS": SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "GPU_MEMORY_UTILIZATION": default(CacheConfig, "gpu_memory_utilization"),
        "KV_CACHE_DTYPE": default(EngineArgs, "kv_cache_dtype"),
        "WATERMARK": default(SchedulerConfig, "watermark"),
        "engine_args": [default(EngineArgs, name) for name in (
            "block_size", "enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens",
            "gpu_memory_utilization", "watermark")],
        "by_device": [batch(192, "nvidia b200"), batch(80, "nvidia h100 80gb hbm3"),
                      batch(80, "nvidia a100-sxm4-80gb"), batch(0, "cpu", is_cpu=True)],
        "cpu_source": open(cpu.__file__).read(),
        "fp8_is_e4m3": "fp8 (=fp8_e4m3)" in cache_source,
    }))
""")


@pytest.fixture(scope="module")
def installed():
    """The defaults of the installed vLLM, read in a child process: importing vLLM here takes seconds and
    would switch Triton out of its interpreter."""
    ok, why = vllm_available()
    if not ok:
        pytest.skip(why)
    result = subprocess.run([sys.executable, "-c", READ_VLLM], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_pinned_version_is_the_pages():
    assert cheatsheet.VLLM_VERSION == VLLM_VERSION
    assert f"## vLLM {VLLM_VERSION}'s defaults" in PAGE


def test_vllms_defaults_are_the_installed_ones(installed):
    assert installed["version"].startswith(cheatsheet.VLLM_VERSION)
    for name in ("BLOCK_SIZE", "ENABLE_PREFIX_CACHING", "ENABLE_CHUNKED_PREFILL", "MAX_NUM_BATCHED_TOKENS",
                 "GPU_MEMORY_UTILIZATION", "KV_CACHE_DTYPE", "WATERMARK"):
        assert getattr(cheatsheet, name) == installed[name], name
    # EngineArgs passes these on as they are, or leaves them None for the config (or the model) to set
    assert installed["engine_args"] == [None, None, None, None, cheatsheet.GPU_MEMORY_UTILIZATION,
                                        cheatsheet.WATERMARK]
    assert installed["by_device"] == [list(v) for v in cheatsheet.MAX_NUM_BATCHED_TOKENS_BY_DEVICE.values()]
    assert ("elif not cache_config.user_specified_block_size:\n"
            f"            cache_config.block_size = {cheatsheet.CPU_BLOCK_SIZE}\n") in installed["cpu_source"]
    assert installed["fp8_is_e4m3"]


def test_the_page_states_vllms_defaults():
    text = section("vLLM")
    on = {True: "on", False: "off"}
    for row in (f"| `block_size` | {cheatsheet.BLOCK_SIZE} tokens |",
                f"| `enable_prefix_caching` | {on[cheatsheet.ENABLE_PREFIX_CACHING]} |",
                f"| `enable_chunked_prefill` | {on[cheatsheet.ENABLE_CHUNKED_PREFILL]} |",
                f"| `max_num_batched_tokens` | {cheatsheet.MAX_NUM_BATCHED_TOKENS:,} tokens a step |",
                f"| `gpu_memory_utilization` | {cheatsheet.GPU_MEMORY_UTILIZATION} |",
                f'| `kv_cache_dtype` | `"{cheatsheet.KV_CACHE_DTYPE}"` |',
                f"| `watermark` | {cheatsheet.WATERMARK} |"):
        assert row in text, row
    for where, (llm, server) in cheatsheet.MAX_NUM_BATCHED_TOKENS_BY_DEVICE.items():
        assert f"{where}: {llm:,} / {server:,}" in text
    assert f"takes {cheatsheet.CPU_BLOCK_SIZE} when none is given" in text
