"""Build the course website from the committed, executed notebooks: ``python site/build.py [OUT]``.

Every ``notebooks/[0-9]*.ipynb`` becomes a chapter, in file-name order, and a row of the landing page's
chapter table (its title is the notebook's first ``# `` heading); then the build-it-yourself track's page
(``tasks``, made from ``pagedlib.grade``'s tasks), ``notebooks/cheatsheet.md`` and ``notebooks/glossary.md``,
in that order. The sources are staged in ``OUT-src``
(the notebooks copied, never re-executed), then Sphinx writes HTML to ``OUT`` (default ``build/site``,
git-ignored like ``build/site-src``); open ``OUT/index.html``.

The script deletes and rebuilds ``OUT`` and ``OUT-src`` only if it made them: it leaves a marker file in
every folder it creates, and refuses (exit 2) a folder that holds anything else. A notebook it cannot read
stops the build (exit 1) with the file's name, before any folder is touched."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                     # the pagedlib beside this site, installed or not
from pagedlib.grade.page import markdown as tasks_page  # noqa: E402

SITE, NOTEBOOKS = ROOT / "site", ROOT / "notebooks"
# Written into every folder this script creates; a folder without it is never deleted.
MARKER = ".made-by-site-build"
WIDGET = "application/vnd.jupyter.widget-view+json"
# A widget output needs a kernel; a static page has none (and the notebooks store no widget state).
LIVE_ONLY = ("<p style='border-left:4px solid #4C72B0;background:#F4F6FA;padding:6px 10px'>"
             "<b>Live widget.</b> This cell's output is an interactive widget driven by Python: it runs in "
             "JupyterLab (<code>make lab</code>), not on this static page.</p>")


def fail(message: str, exit_code: int) -> NoReturn:
    """Stop the build with one line on stderr (no traceback) and ``exit_code``."""
    print(f"site/build.py: error: {message}", file=sys.stderr)
    raise SystemExit(exit_code)


def read_notebook(path: Path) -> dict:
    """The notebook at ``path``; a file that is not a notebook stops the build with its name."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        fail(f"{path}: not a readable notebook ({error})", 1)
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        fail(f"{path}: not a notebook (no list of 'cells')", 1)
    for number, cell in enumerate(nb["cells"]):
        if not isinstance(cell, dict) or not isinstance(cell.get("cell_type"), str):
            fail(f"{path}: cell {number} has no 'cell_type'", 1)
        source = cell.get("source")
        if not isinstance(source, (str, list)) or not all(isinstance(line, str) for line in source):
            fail(f"{path}: cell {number} has no text 'source'", 1)
        outputs = cell.get("outputs", [] if cell["cell_type"] != "code" else None)
        if not isinstance(outputs, list) or not all(isinstance(output, dict) for output in outputs):
            fail(f"{path}: cell {number} has 'outputs' that are not a list of objects (a code cell needs "
                 f"its list, empty or not)", 1)
    return nb


def read_chapters(notebooks: Path) -> list[tuple[Path, dict]]:
    """Every ``[0-9]*.ipynb`` of ``notebooks`` with its content, in file-name order; none is an error."""
    paths = sorted(notebooks.glob("[0-9]*.ipynb"))
    if not paths:
        fail(f"no chapters: {notebooks} holds no notebook named [0-9]*.ipynb", 1)
    chapters = []
    for path in paths:
        nb = read_notebook(path)
        try:
            title(nb)
        except ValueError as error:
            fail(f"{path}: {error}", 1)
        chapters.append((path, nb))
    return chapters


def check_outside_sources(folder: Path) -> None:
    """Refuse (exit 2) an output folder inside ``site/`` or ``notebooks/``: the next build would copy it as a
    source, and Sphinx would read it."""
    for sources in (SITE, NOTEBOOKS):
        if folder == sources or sources in folder.parents:
            fail(f"refusing to build into {folder}: it is inside {sources}, which the build reads; give a "
                 f"folder elsewhere (default build/site)", 2)


def check_replaceable(folder: Path) -> None:
    """Refuse (exit 2) to replace ``folder`` unless it is absent, empty, or made by this script: the
    output folder is a command-line argument, and ``python site/build.py notebooks`` must not delete the
    notebooks."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        fail(f"refusing to replace {folder}: it is not a folder made by site/build.py", 2)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MARKER).is_file():
        fail(f"refusing to delete {folder}: it holds files and was not made by site/build.py (it has no "
             f"{MARKER}); give a new or empty folder, or delete it yourself", 2)


def fresh_folder(folder: Path) -> None:
    """Delete ``folder`` (checked by ``check_replaceable``) and create it empty, with the marker."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / MARKER).write_text("made by site/build.py, which deletes this folder on its next build\n")


def title(nb: dict) -> str:
    """The notebook's first ``# `` heading."""
    for cell in nb["cells"]:
        for line in "".join(cell["source"]).splitlines() if cell["cell_type"] == "markdown" else []:
            if line.startswith("# "):
                return line[2:].strip()
    raise ValueError("a chapter needs a '# ' title in a markdown cell")


def static_outputs(nb: dict) -> dict:
    """``nb`` with each widget output replaced by a note that the widget runs in JupyterLab."""
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if WIDGET in out.get("data", {}):
                out["data"] = {"text/html": LIVE_ONLY, "text/plain": "live widget (JupyterLab)"}
    return nb


def stage(src: Path, notebooks: list[tuple[Path, dict]]) -> list[tuple[str, str]]:
    """Copy the site sources and every chapter into the fresh folder ``src``; return ``(page name, title)``
    per chapter."""
    shutil.copytree(SITE, src, ignore=shutil.ignore_patterns("build.py", "__pycache__"), dirs_exist_ok=True)
    if (NOTEBOOKS / "images").is_dir():
        shutil.copytree(NOTEBOOKS / "images", src / "images")  # the notebooks link images/...
    shutil.copy(NOTEBOOKS / "glossary.md", src / "glossary.md")  # every chapter links glossary.md
    shutil.copy(NOTEBOOKS / "cheatsheet.md", src / "cheatsheet.md")  # it links the chapters and the glossary
    chapters = []
    for path, nb in notebooks:
        (src / path.name).write_text(json.dumps(static_outputs(nb), ensure_ascii=False))
        chapters.append((path.stem, title(nb)))
    pages = {name[:2]: f"{name}.ipynb" for name, _ in chapters}
    (src / "tasks.md").write_text(tasks_page(pages))         # the build-it-yourself track, from its tasks
    return chapters


def chapter_table(chapters: list[tuple[str, str]]) -> str:
    """The landing page's chapter table and the (hidden) toctree that orders the pages."""
    rows = [f"| {name[:2]} | [{_escape(t.split('·', 1)[-1].strip())}](<{name}.ipynb>) |"
            for name, t in chapters]
    toc = "\n".join([*(name for name, _ in chapters), "tasks", "cheatsheet", "glossary"])
    return "\n".join(["| # | chapter |", "|---|---|", *rows, "", "```{toctree}", ":hidden:",
                      ":maxdepth: 1", "", toc, "```"])


def _escape(text: str) -> str:
    """A title as the text of a markdown link in a table cell: brackets and bars kept literal."""
    for char, escaped in (("\\", "\\\\"), ("[", "\\["), ("]", "\\]"), ("|", "&#124;")):
        text = text.replace(char, escaped)
    return text


def main(out: Path) -> None:
    if out.is_symlink():  # before resolve(), which would build into the link's target
        fail(f"refusing to build into {out}: it is a symbolic link", 2)
    out = out.resolve()
    src = out.with_name(out.name + "-src")
    executed = out.parent / "jupyter_execute"  # where myst-nb writes beside the output; removed if new
    executed_before = executed.exists()
    # Everything is checked before anything is deleted or written.
    notebooks = read_chapters(NOTEBOOKS)
    for folder in (out, src):
        check_outside_sources(folder)
        check_replaceable(folder)
    fresh_folder(src)
    chapters = stage(src, notebooks)
    index = src / "index.md"
    index.write_text(index.read_text().replace("{chapters}", chapter_table(chapters)))
    fresh_folder(out)
    # -W: a warning (a broken link, a missing image) fails the build; -q: only warnings are printed
    sphinx = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going", "-E",
                             str(src), str(out)])
    if not executed_before:
        shutil.rmtree(executed, ignore_errors=True)
    if sphinx.returncode != 0:
        fail(f"Sphinx could not build {src} into {out} (its messages are above)", 1)
    print(f"site: {len(chapters)} chapters -> {out / 'index.html'}")


if __name__ == "__main__":
    if len(sys.argv) > 2:
        fail("usage: python site/build.py [OUT] (one output folder, default build/site)", 2)
    if len(sys.argv) == 2:
        main(Path(sys.argv[1]))
    else:
        main(ROOT / "build" / "site")
