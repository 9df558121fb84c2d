"""A ``Player`` in a real JupyterLab, as a reader meets it: in a notebook it does not trust yet (a fresh
clone: stored outputs, no signature) and after running the cell. What notebooks 03 and 06 say about their
players is checked here: untrusted, JupyterLab drops the output's script, so the start frame shows alone
with the controls disabled and the note; once the cell has run, the controls step through the frames.
Uses the JupyterLab and Chromium setup of ``test_browser.py`` (skipped, or failed under CI, the same way)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_browser import CHROMIUM, CHROMIUM_FLAGS, serve_lab

pytestmark = pytest.mark.browser
CELL = "from pagedlib.teach.player import Player\nPlayer(['<b>frame zero</b>', '<b>frame one</b>'], start=0)"


def _notebook(path: Path, kernel_name: str) -> None:
    """A notebook whose one cell's output is stored, as ``make execute`` stores it (no signature)."""
    import nbformat

    from pagedlib.teach.player import Player

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": kernel_name, "language": "python"}
    player = Player(["<b>frame zero</b>", "<b>frame one</b>"], start=0)
    out = nbformat.v4.new_output("execute_result", {"text/html": player.html(), "text/plain": repr(player)},
                                 execution_count=1)
    nb.cells = [nbformat.v4.new_code_cell(CELL, outputs=[out], execution_count=1)]
    nbformat.write(nb, path)


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, str]]:
    """``serve_lab`` (test_browser's private JupyterLab) with the player notebook."""
    yield from serve_lab(tmp_path, monkeypatch, "player.ipynb", _notebook)


def test_player_shows_its_start_frame_untrusted_and_steps_once_the_cell_ran(lab):
    from playwright.sync_api import expect, sync_playwright

    url, log_path, kernel_name = lab
    expect.set_options(timeout=60_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        try:
            page.goto(url)
            expect(page.locator("#jp-main-statusbar")).to_contain_text(f"{kernel_name} | Idle")
            out = page.locator(".jp-OutputArea-output")
            # untrusted: the stored output is sanitized, its script dropped
            expect(out.get_by_text("frame zero", exact=True)).to_be_visible()
            expect(out.get_by_text("frame one", exact=True)).to_be_hidden()
            expect(out.locator("script")).to_have_count(0)
            expect(out).to_contain_text("Showing one frame only")
            for button in out.locator("button").all():
                expect(button).to_be_disabled()
            # run the cell: its new output is trusted, the script wires the controls
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()
            expect(out).not_to_contain_text("Showing one frame only")
            forward = out.locator("button", has_text="Forward")
            forward.click()
            expect(out.get_by_text("frame one", exact=True)).to_be_visible()
            expect(out.get_by_text("frame zero", exact=True)).to_be_hidden()
            expect(out).to_contain_text("frame 1 of 1")
            expect(forward).to_be_disabled()
        except Exception:
            shot = Path(__file__).resolve().parents[1] / "test-artifacts" / "player-lab-failure.png"
            shot.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(shot))
            print(f"screenshot: {shot}\nJupyterLab log tail:\n{log_path.read_text()[-3000:]}")
            raise
        finally:
            browser.close()
