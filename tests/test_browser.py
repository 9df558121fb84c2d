"""The tracer widget in a real browser: JupyterLab on 127.0.0.1, Debian's headless Chromium via playwright.

The test writes a small notebook that builds the article's trace, runs all its cells in JupyterLab, clicks
"Append token" across a block boundary and checks that the rendered pool shows block 9 leaving the free
stack and joining seq 0's table; later it forks a sequence ("Fork") and appends to the child, and checks
the shared block's count and the copy-on-write (the copied block, its highlight, the copy counter), the
legend, then Play, Stop, Forward and Back over the scenario with the log history. On failure it saves a
screenshot to ``test-artifacts/``.

Outside CI the test skips (saying why) when Chromium or playwright is missing; with ``CI=true`` a missing
browser is a failure. ``PAGEDLIB_TRACER_SCREENSHOT=<path.png>`` also saves the widget mid-trace there,
right after the fork's copy-on-write: that is how ``notebooks/images/tracer.png`` is made (notebook 03
lists the same clicks):

    PAGEDLIB_TRACER_SCREENSHOT=notebooks/images/tracer.png python -m pytest tests/test_browser.py
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("PAGEDLIB_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-dev-shm-usage", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"]
NOTEBOOK_CELLS = [
    "from pagedlib.teach.tracer import BlockTableTracer",
    "tracer = BlockTableTracer.article_trace()  # seq 0: 7 tokens in blocks [5, 2]; block 9 is next\ntracer",
]

pytestmark = pytest.mark.browser


def _require_browser() -> None:
    """Skip (or, under CI, fail) when the browser stack is not installed."""
    reason = None
    if not os.path.exists(CHROMIUM):
        reason = f"Chromium not found at {CHROMIUM} (install Debian's `chromium` package)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "the playwright package is not installed"
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but the browser test cannot run: {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kernel_display_name() -> str:
    """The display name of the ``python3`` kernel JupyterLab will start (the status bar shows it)."""
    from jupyter_client.kernelspec import KernelSpecManager

    return KernelSpecManager().get_kernel_spec("python3").display_name


def serve_lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, notebook: str,
              write: Callable[[Path, str], None]) -> Iterator[tuple[str, Path, str]]:
    """A private JupyterLab server (its own config, runtime, workspace, settings and data dirs, so no user
    setting or kernel leaks in) serving ``notebook``, which ``write(path, kernel display name)`` creates;
    yields its URL, the server log and the kernel's display name. Stopped even when the test fails."""
    _require_browser()
    dirs = {name: tmp_path / name for name in ("config", "runtime", "workspaces", "settings", "data", "nb")}
    for d in dirs.values():
        d.mkdir()
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    for var, d in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                   ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                   ("JUPYTER_DATA_DIR", "data")]:
        monkeypatch.setenv(var, str(dirs[d]))
    kernel_name = _kernel_display_name()  # found as the server will find it: the venv's kernelspec
    notification = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    write(dirs["nb"] / notebook, kernel_name)
    port, token = _free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={dirs['nb']}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = tmp_path / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/lab/tree/{notebook}?token={token}", log_path, kernel_name
    finally:
        _stop(proc)


def _tracer_notebook(path: Path, kernel_name: str) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": kernel_name, "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_CELLS]
    nbformat.write(nb, path)


@pytest.fixture
def lab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path, str]]:
    """``serve_lab`` with the tracer's test notebook."""
    yield from serve_lab(tmp_path, monkeypatch, "tracer.ipynb", _tracer_notebook)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (the server shuts its kernel down), SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_append_token_moves_a_block_from_the_free_stack_into_the_table(lab):
    from playwright.sync_api import expect, sync_playwright

    url, log_path, kernel_name = lab
    expect.set_options(timeout=60_000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(url)
            # The toolbar says idle before any kernel exists; the status bar names the started kernel.
            expect(page.locator("#jp-main-statusbar")).to_contain_text(f"{kernel_name} | Idle")
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_text("Run All Cells", exact=True).click()

            widget = page.locator(".jp-OutputArea-output .pt-widget")
            view = widget.locator(".widget-html-content .pt-tracer")
            block9 = view.locator("[data-block='9']")
            free_stack = view.locator("[data-role='free-stack']")
            table0 = view.locator("[data-seq='0']")
            expect(block9).to_have_attribute("data-holders", "")
            expect(free_stack.locator(".is-top")).to_have_attribute("data-free", "9")
            expect(table0).to_have_attribute("data-len", "7")
            expect(table0.locator("[data-entry]")).to_have_text(["5", "2"])

            append = widget.locator(".widget-button.pt-append")
            append.click()  # position 7: offset 3 of block 2, no new block
            expect(table0).to_have_attribute("data-len", "8")
            expect(view.locator("[data-block='2'] [data-slot='3']")).to_have_text("s0:t7")
            expect(block9).to_have_attribute("data-holders", "")

            append.click()  # position 8: 8 % 4 == 0, block 9 comes off the free stack
            expect(table0).to_have_attribute("data-len", "9")
            expect(block9).to_have_attribute("data-holders", "0")
            expect(block9.locator("[data-slot='0']")).to_have_text("s0:t8")
            expect(block9.locator("[data-slot='0']")).to_have_class("pt-slot is-filled is-lookup")
            expect(free_stack.locator("[data-free='9']")).to_have_count(0)
            expect(table0.locator("[data-entry]")).to_have_text(["5", "2", "9"])
            expect(view.locator("[data-role='log']")).to_contain_text("8 % 4 == 0; a new block: block 9")

            # a second sequence, added and prompted through the buttons, takes the next blocks (0, 1)
            widget.locator(".widget-button.pt-add").click()
            widget.locator(".widget-button.pt-append-n").click()
            expect(view.locator("[data-seq='1']")).to_have_attribute("data-len", "5")
            expect(view.locator("[data-block='0']")).to_have_attribute("data-holders", "1")
            expect(view.locator("[data-block='1']")).to_have_attribute("data-holders", "1")
            expect(view.locator("[data-role='error']")).to_have_count(0)

            # back to seq 0 with the dropdown; the position box looks up token 8 (block 9, offset 0)
            widget.locator(".pt-seq-picker select").select_option(label="seq 0")
            expect(view.locator("[data-seq='0']")).to_have_class("pt-table is-selected")
            position = widget.locator(".pt-position input")
            position.fill("8")
            position.press("Enter")
            expect(view.locator("[data-role='lookup']")).to_contain_text("8 // 4 = 2")
            expect(view.locator("[data-role='lookup']")).to_contain_text("physical block 9")

            position.fill("99")  # out of range: the error shows, nothing changes, the box snaps back
            position.press("Enter")
            expect(view.locator("[data-role='error']")).to_contain_text("Nothing changed")
            expect(position).to_have_value("8")
            expect(view.locator("[data-role='lookup']")).to_contain_text("physical block 9")

            # fork seq 1 (5 tokens: block 1 holds 1 of 4) into seq 2: both blocks shared, nothing copied
            widget.locator(".pt-seq-picker select").select_option(label="seq 1")
            # the kernel has the selection before the fork (else it forks the sequence selected before)
            expect(view.locator("[data-seq='1']")).to_have_class("pt-table is-selected")
            widget.locator(".widget-button.pt-fork").click()
            block1 = view.locator("[data-block='1']")
            expect(view.locator("[data-seq='2']")).to_have_attribute("data-len", "5")
            expect(block1).to_have_attribute("data-holders", "1 2")
            expect(block1.locator(".pt-refs")).to_have_text("2 refs")
            expect(view.locator("[data-role='counts']")).to_have_attribute("data-copies", "0")
            # seq 2's next token would land in shared block 1: it is copied first, to block 3 (the stack top)
            append.click()
            block3 = view.locator("[data-block='3']")
            expect(view.locator("[data-role='counts']")).to_have_attribute("data-copies", "1")
            expect(view.locator("[data-seq='2'] [data-entry]")).to_have_text(["0", "3"])
            expect(block1).to_have_attribute("data-holders", "1")
            expect(block3).to_have_attribute("data-holders", "2")
            expect(block3).to_have_class("pt-block is-copy is-lookup")
            expect(block3).to_contain_text("copy of 1")
            expect(block3.locator("[data-slot='1']")).to_have_text("s2:t5")
            expect(view.locator("[data-role='log']")).to_contain_text("block 1 was shared (2 refs)")
            expect(view.locator("[data-role='log']")).to_contain_text("to block 3")
            legend = view.locator("[data-role='legend']")
            for words in ("seq 2 (gold)", "double border: shared", "amber: just copied", "pink ring"):
                expect(legend).to_contain_text(words)

            shot = os.environ.get("PAGEDLIB_TRACER_SCREENSHOT")
            if shot:
                widget.screenshot(path=shot)

            # Play: each tick of the frontend's timer applies one scripted step in the kernel; Stop resets
            play_buttons = widget.locator(".pt-play button")
            play_buttons.nth(0).click()
            expect(view.locator("[data-role='log']")).to_contain_text("Scenario step 2/")
            play_buttons.nth(1).click()
            expect(view.locator("[data-role='log']")).to_contain_text("Scenario ready")
            expect(view.locator("[data-holders='']")).to_have_count(12)

            # Forward plays the scenario one step at a time, Back returns; the log history follows
            step, history = widget.locator(".pt-step-label"), widget.locator("[data-role='history']")
            for k in range(1, 4):  # one click at a time: each waits for the kernel's answer
                widget.locator(".widget-button.pt-forward").click()
                expect(step).to_have_text(f"step {k} of 15")
            expect(view.locator("[data-role='log']")).to_contain_text("Scenario step 3/15")
            expect(step).to_have_text("step 3 of 15")
            expect(history.locator("[data-step]")).to_have_count(4)
            widget.locator(".widget-button.pt-back").click()
            expect(view.locator("[data-role='log']")).to_contain_text("Scenario step 2/15")
            expect(view.locator("[data-seq='1']")).to_have_count(0)
            expect(history.locator(".is-current")).to_have_attribute("data-step", "2")
            expect(widget.locator(".widget-button.pt-forward")).to_be_enabled()
        except Exception:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "browser-tracer-failure.png"), full_page=True)
            print(f"screenshot: {ARTIFACTS / 'browser-tracer-failure.png'}\nJupyterLab log tail:\n"
                  f"{log_path.read_text()[-3000:]}")
            raise
        finally:
            browser.close()
