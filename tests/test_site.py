"""The course website (``make site``): built from the committed notebooks, then read like a reader would.

The module builds the site once into a temporary folder with ``site/build.py`` (what ``make site`` runs),
checks every internal link and fragment in the HTML, then serves the folder on 127.0.0.1 and opens every
page in headless Chromium (the setup of ``test_browser.py``): no console error, no failed request, no
request that leaves the local server (each is aborted and reported), every image decoded with a nonzero
size, the math typeset, search answering, and the tracer players of notebooks 03 and 06 stepping through
their frames with no kernel. A screenshot of each page is saved under ``test-artifacts/site/``.
The ``Player`` itself (pure HTML) and the tracer's ``frames`` are checked without a browser first."""

from __future__ import annotations

import functools
import html
import http.server
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from test_browser import CHROMIUM, CHROMIUM_FLAGS, _require_browser

from pagedlib.teach.player import Player
from pagedlib.teach.tracer import SCENARIO, BlockTableTracer

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "test-artifacts" / "site"
CHAPTERS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9]*.ipynb"))


# --- the player and the tracer's frames, no browser -------------------------------------------------

def test_tracer_frames_are_the_views_back_and_forward_show():
    tracer = BlockTableTracer()
    tracer.play_to(len(SCENARIO))
    frames = tracer.frames()
    assert len(frames) == len(SCENARIO) + 1
    for k in range(len(SCENARIO), -1, -1):  # Back from the last step to the empty pool
        assert frames[k] == tracer.html(), f"frame {k} differs from the view at step {k}"
        if k:
            tracer.back()
    assert tracer.frames() == frames, "walking the history must not change it"
    assert "Scenario ready" in frames[0] and f"Scenario step {len(SCENARIO)}/" in frames[-1]


def test_player_shows_its_start_frame_without_script_and_the_rest_hidden():
    player = Player(["<b>zero</b>", "<b>one</b>", "<b>two</b>"], ["a", "b", "c"], start=1)
    page = player.html()
    # only the start frame is in the page: a renderer that drops the script and the styles (GitHub's)
    # shows one frame, not every frame's text one after the other
    assert re.findall(r"<div class='pl-frame'[^>]*>", page) == ["<div class='pl-frame'>"]
    before_script = page[:page.index("<script>")]
    assert "<b>one</b>" in before_script and "<b>zero</b>" not in before_script
    assert '["<b>zero<\\/b>", null, "<b>two<\\/b>"]' in page, "the other frames live in the script"
    bar = page[:page.index("<div class='pl-frame'")]
    assert bar.count(" disabled") == 4, "the controls stay disabled until the script runs"
    assert "<span class='pl-label'>b</span>" in page and '["a", "b", "c"]' in page
    assert repr(player) == "Player(3 frames)" and player._repr_html_() == page
    assert Player(["x"]).labels == ["frame 0 of 0"]
    label = Player(["x"], ["</script><script>alert(1)"]).html()
    assert label.count("</script>") == 1, "a label cannot close the player's script"


@pytest.mark.parametrize("kwargs, message", [
    ({"frames": []}, "frames must be a non-empty sequence of HTML strings"),
    ({"frames": "<b>x</b>"}, "frames must be a non-empty sequence"),
    ({"frames": [1, 2]}, "frames must be a non-empty sequence"),
    ({"frames": ["a"], "labels": ["a", "b"]}, "labels must be a sequence of strings, one per frame (1)"),
    ({"frames": ["a"], "labels": "a"}, "labels must be a sequence of strings"),
    ({"frames": ["a", "b"], "start": 2}, "start must be <= 1, got 2"),
    ({"frames": ["a"], "start": True}, "start must be an int, got a bool"),
    ({"frames": ["a"], "interval_ms": 0}, "interval_ms must be >= 50, got 0"),
])
def test_player_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Player(**kwargs)


# --- the builder refuses before it deletes or writes anything ---------------------------------------

def _build(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """``python site/build.py ARGS`` of the checkout (or copy of one) at ``repo``."""
    return subprocess.run([sys.executable, str(repo / "site" / "build.py"), *args], capture_output=True,
                          text=True, cwd=repo, timeout=120)


def _repo_copy(tmp_path: Path, notebooks: dict[str, str] | None) -> Path:
    """A copy of ``site/`` beside a ``notebooks/`` folder holding ``notebooks`` (name -> file text;
    ``None``: no notebooks folder at all)."""
    repo = tmp_path / "repo"
    (repo / "site").mkdir(parents=True)
    (repo / "site" / "build.py").write_text((ROOT / "site" / "build.py").read_text())
    if notebooks is not None:
        (repo / "notebooks").mkdir()
        for name, text in notebooks.items():
            (repo / "notebooks" / name).write_text(text)
    return repo


@pytest.mark.parametrize("victim", ["out", "out-src"])
def test_builder_refuses_to_delete_a_folder_it_did_not_make(tmp_path, victim):
    (tmp_path / victim).mkdir()
    (tmp_path / victim / "thesis.ipynb").write_text("{}")
    result = _build(ROOT, str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert f"refusing to delete {tmp_path / victim}" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / victim / "thesis.ipynb").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [victim], "nothing else was created"


def test_builder_refuses_a_file_as_its_output_folder(tmp_path):
    (tmp_path / "out").write_text("mine")
    result = _build(ROOT, str(tmp_path / "out"))
    assert result.returncode == 2 and f"refusing to replace {tmp_path / 'out'}" in result.stderr
    assert (tmp_path / "out").read_text() == "mine"


TITLED = json.dumps({"cells": [{"cell_type": "markdown", "source": ["# 01 · A title"], "metadata": {}}]})


@pytest.mark.parametrize("text, message", [
    ("{", "not a readable notebook"),
    ("{}", "not a notebook (no list of 'cells')"),
    ("[1, 2]", "not a notebook (no list of 'cells')"),
    (json.dumps({"cells": [3]}), "cell 0 has no 'cell_type'"),
    (json.dumps({"cells": [{"cell_type": "code", "source": [1]}]}), "cell 0 has no text 'source'"),
    (json.dumps({"cells": [{"cell_type": "code", "source": "", "outputs": [1]}]}), "cell 0 has 'outputs'"),
    (json.dumps({"cells": [{"cell_type": "code", "source": ""}]}), "a code cell needs its list"),
    (json.dumps({"cells": [{"cell_type": "markdown", "source": "no"}]}), "a chapter needs a '# ' title"),
], ids=["json", "no-cells", "a-list", "cell", "source", "outputs", "no-outputs", "title"])
def test_builder_names_the_notebook_it_cannot_read(tmp_path, text, message):
    repo = _repo_copy(tmp_path, {"01_good.ipynb": TITLED, "02_bad.ipynb": text})
    result = _build(repo, str(tmp_path / "out"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{repo / 'notebooks' / '02_bad.ipynb'}: " in result.stderr and message in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out-src").exists()


@pytest.mark.parametrize("inside", ["site/out", "notebooks/out", "site"])
def test_builder_refuses_an_output_folder_inside_its_sources(tmp_path, inside):
    """Issue 37, defect 15: ``site/out`` was built, then copied as a source by every later build."""
    repo = _repo_copy(tmp_path, {"01_good.ipynb": TITLED})
    result = _build(repo, str(repo / inside))
    assert result.returncode == 2 and "which the build reads" in result.stderr, result.stderr
    assert sorted(p.name for p in (repo / "site").iterdir()) == ["build.py"]


def test_builder_refuses_a_symbolic_link_as_its_output(tmp_path):
    """Defect 31: the link was resolved first, and the build went into its target."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    result = _build(ROOT, str(tmp_path / "link"))
    assert result.returncode == 2 and "symbolic link" in result.stderr
    assert list((tmp_path / "target").iterdir()) == []


def test_the_chapter_table_keeps_odd_names_and_titles_literal():
    """Defect 32: a file name with a space, a title with brackets or a bar, each a working row."""
    sys.path.insert(0, str(ROOT / "site"))
    try:
        import build
    finally:
        sys.path.pop(0)
    table = build.chapter_table([("13 a b", "13 · Beyond [one] pool | more")])
    assert "| 13 | [Beyond \\[one\\] pool &#124; more](<13 a b.ipynb>) |" in table


@pytest.mark.parametrize("notebooks", [None, {}, {"notes.ipynb": TITLED}],
                         ids=["no-folder", "empty", "unnumbered"])
def test_builder_with_no_chapters_is_an_error(tmp_path, notebooks):
    repo = _repo_copy(tmp_path, notebooks)
    result = _build(repo, str(tmp_path / "out"))
    assert result.returncode == 1 and "no chapters" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


# --- the built site --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built by ``site/build.py`` from the committed notebooks (~15 s) into the folder of an
    earlier build: the builder replaces a folder it made (it left its marker there)."""
    out = tmp_path_factory.mktemp("site") / "html"
    out.mkdir()
    (out / ".made-by-site-build").write_text("")
    (out / "stale.html").write_text("from an earlier build")
    result = _build(ROOT, str(out))
    assert result.returncode == 0, result.stderr
    assert not (out / "stale.html").exists(), "the earlier build's pages are gone"
    assert not (out.parent / "jupyter_execute").exists(), "defect 33: myst-nb's folder beside it is removed"
    return out


class _Links(HTMLParser):
    """Every ``href``/``src`` of a page and every ``id`` it defines."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src") and value:
                self.refs.append(value)
            if name == "id" and value:
                self.ids.add(value)


def _parse(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def test_every_notebook_is_a_chapter_with_its_title_in_the_table(site):
    # the table's text as a reader sees it: entities decoded, Sphinx's curly apostrophes made straight
    index = html.unescape((site / "index.html").read_text(encoding="utf-8")).replace("\u2019", "'")
    for name in CHAPTERS:
        assert (site / f"{name}.html").is_file(), f"no page for {name}"
        nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
        title = next(line[2:] for c in nb["cells"] for line in "".join(c["source"]).splitlines()
                     if c["cell_type"] == "markdown" and line.startswith("# "))
        heading = re.escape(title.split("·", 1)[-1].strip())
        row = rf'href="{name}.html"[^>]*>(<span[^>]*>)?{heading}<'
        assert re.search(row, index), f"{name} missing from the chapter table"


ARTICLE = "How to Implement Paged Attention in PyTorch and vLLM"
ARTICLE_URL = "https://swarnava.dev/blogs/implement-paged-attention-pytorch"


def test_every_chapter_links_the_glossary_first_and_the_article_where_it_names_it():
    for name in CHAPTERS:
        cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
        markdown = ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
        assert "](glossary.md)" in markdown[0], f"{name}: its first markdown cell must link the glossary"
        for text in markdown:
            if ARTICLE in text:
                assert ARTICLE_URL in text, f"{name} names the source article without linking it"
    glossary = (ROOT / "notebooks" / "glossary.md").read_text()
    assert ARTICLE_URL in glossary


def test_the_glossary_is_a_page_of_the_site(site):
    assert (site / "glossary.html").is_file()
    page = html.unescape((site / "glossary.html").read_text(encoding="utf-8"))
    for term in ("Block table", "Copy-on-write", "Prefix caching", "Warp", "Varlen", "LoRA"):
        assert term in page, f"the glossary page lacks {term}"
    for name in ["index", *CHAPTERS]:
        refs = _parse(site / f"{name}.html").refs
        assert any(ref.split("#")[0] == "glossary.html" for ref in refs), f"{name}.html does not link it"


def test_the_cheat_sheet_is_a_page_of_the_site_before_the_glossary(site):
    assert (site / "cheatsheet.html").is_file()
    page = html.unescape((site / "cheatsheet.html").read_text(encoding="utf-8"))
    for entry in ("KV bytes per token", "Sliding window", "Split-K", "FP8", "Goodput", "vLLM 0.32.0"):
        assert entry in page, f"the cheat sheet page lacks {entry}"
    refs = [ref.split("#")[0] for ref in _parse(site / "cheatsheet.html").refs]
    assert "glossary.html" in refs and "01_memory_sizing.html" in refs, "it links the glossary and chapters"
    index = (site / "index.html").read_text(encoding="utf-8")
    assert index.index('href="cheatsheet.html"') < index.rindex('href="glossary.html"'), "the toctree order"


def test_the_build_it_yourself_page_shows_every_task_and_links_its_chapter(site):
    from pagedlib.grade import TASKS

    page = html.unescape((site / "tasks.html").read_text(encoding="utf-8"))
    for curly, plain in (("\u2019", "'"), ("\u2026", "..."), ("\u201c", '"'), ("\u201d", '"')):
        page = page.replace(curly, plain)                     # Sphinx's smart quotes and ellipses
    refs = {ref.split("#")[0] for ref in _parse(site / "tasks.html").refs}
    for task in TASKS.values():
        assert f"notebooks/tasks/{task.file}" in page and task.checks[0].name in page, task.name
        assert any(r.startswith(task.notebook + "_") for r in refs), f"{task.name}: no link to its chapter"
    index = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="tasks.html"' in index
    assert index.index('href="tasks.html"') < index.index('href="cheatsheet.html"'), "the toctree order"


def test_every_internal_link_and_fragment_resolves(site):
    pages = {p: _parse(p) for p in site.glob("*.html")}  # the pages (_static holds theme templates)
    checked = 0
    for page, links in pages.items():
        for ref in links.refs:
            parts = urlsplit(ref)
            if parts.scheme or parts.netloc or ref.startswith(("mailto:", "javascript:")):
                continue  # a link out (GitHub, a paper) is followed by the reader, never loaded by the page
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            assert target.is_file(), f"{page.relative_to(site)} links to a missing {ref}"
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                where = page.relative_to(site)
                assert unquote(parts.fragment) in ids, f"{where}: no #{parts.fragment} in {ref}"
            checked += 1
    assert checked > 100


# --- the site in a browser -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    """The built site on a local HTTP server (a thread of this process); yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def _open(browser, base: str, path: str):
    """A new page at ``base + path`` that records console errors, failed requests and outside requests
    (those are aborted, so nothing leaves the machine); returns the page and the list of problems."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))

    def route(r):
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            return r.continue_()
        problems.append(f"request outside the site: {r.request.url}")
        return r.abort()

    page.route("**/*", route)
    page.goto(base + path, wait_until="load")
    return page, problems


_IMAGES = """async () => Promise.all([...document.images].map(async (img) => {
  img.loading = "eager";
  try { await img.decode(); } catch (e) { return [img.src, 0, 0]; }
  return [img.src, img.naturalWidth, img.naturalHeight];
}))"""


@pytest.mark.browser
@pytest.mark.parametrize("path", ["index.html", *(f"{name}.html" for name in CHAPTERS)])
def test_page_loads_everything_from_the_site_and_shows_its_images(browser, server, path):
    page, problems = _open(browser, server, path)
    try:
        images = page.evaluate(_IMAGES)
        assert all(w > 0 and h > 0 for _, w, h in images), f"images not decoded: {images}"
        if path != "index.html":
            figures, math = _figures_and_math(path.removesuffix(".html"))
            assert len(images) >= figures, f"{len(images)} images shown, the notebook has {figures} figures"
            page.locator(".prev-next-area a").first.wait_for()  # previous/next navigation
            if math:
                page.locator("mjx-container svg").first.wait_for()  # MathJax typeset the formulas
        page.wait_for_load_state("networkidle")
        assert not problems, "\n".join(problems)
    finally:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / path.replace(".html", ".png")))
        page.close()


@pytest.mark.browser
def test_search_finds_a_chapter(browser, server):
    page, problems = _open(browser, server, "search.html?q=copy-on-write")
    try:
        results = page.locator("#search-results a")
        results.first.wait_for()
        assert any("06_sharing_blocks" in (a or "") for a in results.evaluate_all("l => l.map(a => a.href)"))
        assert not problems, "\n".join(problems)
    finally:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "search.png"))
        page.close()


@pytest.mark.browser
def test_scenario_player_of_notebook_03_steps_with_no_kernel(browser, server):
    from playwright.sync_api import expect

    page, problems = _open(browser, server, "03_block_table_tracing.html")
    try:
        player = page.locator(".pl-player").first
        label, shown = player.locator(".pl-label"), player.locator(".pl-frame:visible")
        expect(label).to_have_text(f"step 0 of {len(SCENARIO)}")
        expect(player.locator(".pl-static")).to_have_count(0)  # the script ran: no "one frame only" note
        expect(shown).to_have_count(1)
        expect(shown).to_contain_text("Scenario ready")
        player.locator(".pl-forward").click()
        expect(label).to_have_text(f"step 1 of {len(SCENARIO)}")
        expect(shown).to_contain_text(f"Scenario step 1/{len(SCENARIO)}: {SCENARIO[0][3]}")
        player.locator(".pl-slider").fill("11")  # seq 1 finishes: its blocks go back on the stack
        expect(label).to_have_text(f"step 11 of {len(SCENARIO)}")
        expect(shown.locator("[data-role='log']")).to_contain_text("Freed seq 1")
        player.locator(".pl-play").click()  # one frame every 900 ms
        expect(label).to_have_text(f"step 12 of {len(SCENARIO)}", timeout=5_000)
        player.locator(".pl-play").click()  # pause
        player.locator(".pl-back").click()
        expect(label).to_have_text(re.compile(rf"step 1[12] of {len(SCENARIO)}"))
        player.scroll_into_view_if_needed()
        player.screenshot(path=str(_shots() / "03_player.png"))
        assert not problems, "\n".join(problems)
    finally:
        page.close()


@pytest.mark.browser
def test_sharing_player_of_notebook_06_opens_on_the_copy_and_steps_back_to_the_fork(browser, server):
    from playwright.sync_api import expect

    page, problems = _open(browser, server, "06_sharing_blocks.html")
    try:
        player = page.locator(".pl-player").first
        label, shown = player.locator(".pl-label"), player.locator(".pl-frame:visible")
        expect(label).to_have_text("step 3 of 3")
        expect(shown.locator("[data-block='7']")).to_contain_text("copy of 2")
        expect(player.locator(".pl-forward")).to_be_disabled()
        player.locator(".pl-back").click()
        expect(label).to_have_text("step 2 of 3")
        expect(shown.locator("[data-role='log']")).to_contain_text("Forked seq 0 into seq 1")
        expect(shown.locator("[data-block='2'] .pt-refs")).to_have_text("2 refs")
        player.scroll_into_view_if_needed()
        player.screenshot(path=str(_shots() / "06_player.png"))
        assert not problems, "\n".join(problems)
    finally:
        page.close()


def _figures_and_math(name: str) -> tuple[int, bool]:
    """How many PNG figures a notebook's outputs hold, and whether its markdown has display math."""
    cells = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())["cells"]
    figures = sum("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", []))
    return figures, any("$$" in "".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _shots() -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS
