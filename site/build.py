"""Build the course website from the committed, executed notebooks: ``python site/build.py [OUT]``.

Every ``notebooks/[0-9]*.ipynb`` becomes a chapter, in file-name order, and a row of the landing page's
chapter table (its title is the notebook's first ``# `` heading); ``notebooks/glossary.md`` is the last
page. The sources are staged in ``OUT-src`` (the notebooks copied, never re-executed), then Sphinx writes
HTML to ``OUT`` (default
``build/site``, git-ignored like ``build/site-src``); open ``OUT/index.html``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE, NOTEBOOKS = ROOT / "site", ROOT / "notebooks"
WIDGET = "application/vnd.jupyter.widget-view+json"
# A widget output needs a kernel; a static page has none (and the notebooks store no widget state).
LIVE_ONLY = ("<p style='border-left:4px solid #4C72B0;background:#F4F6FA;padding:6px 10px'>"
             "<b>Live widget.</b> This cell's output is an interactive widget driven by Python: it runs in "
             "JupyterLab (<code>make lab</code>), not on this static page.</p>")


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


def stage(src: Path) -> list[tuple[str, str]]:
    """Copy the site sources and every chapter into ``src``; return ``(page name, title)`` per chapter."""
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(SITE, src, ignore=shutil.ignore_patterns("build.py", "__pycache__"))
    if (NOTEBOOKS / "images").is_dir():
        shutil.copytree(NOTEBOOKS / "images", src / "images")  # the notebooks link images/...
    shutil.copy(NOTEBOOKS / "glossary.md", src / "glossary.md")  # every chapter links glossary.md
    chapters = []
    for path in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        nb = json.loads(path.read_text())
        (src / path.name).write_text(json.dumps(static_outputs(nb), ensure_ascii=False))
        chapters.append((path.stem, title(nb)))
    return chapters


def chapter_table(chapters: list[tuple[str, str]]) -> str:
    """The landing page's chapter table and the (hidden) toctree that orders the pages."""
    rows = [f"| {name[:2]} | [{t.split('·', 1)[-1].strip().replace('|', '&#124;')}]({name}.ipynb) |"
            for name, t in chapters]
    toc = "\n".join([*(name for name, _ in chapters), "glossary"])
    return "\n".join(["| # | chapter |", "|---|---|", *rows, "", "```{toctree}", ":hidden:",
                      ":maxdepth: 1", "", toc, "```"])


def main(out: Path) -> None:
    src = out.with_name(out.name + "-src")
    chapters = stage(src)
    index = src / "index.md"
    index.write_text(index.read_text().replace("{chapters}", chapter_table(chapters)))
    shutil.rmtree(out, ignore_errors=True)
    # -W: a warning (a broken link, a missing image) fails the build; -q: only warnings are printed
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going", "-E",
                    str(src), str(out)], check=True)
    print(f"site: {len(chapters)} chapters -> {out / 'index.html'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "build" / "site")
