"""Players: frames computed in Python, stepped in the page with no kernel (notebooks 03 and 06, the site).

A ``Player`` is plain HTML holding its start frame, and a few lines of inline script that hold the other
frames and wire the controls: the same output works on the static website and in JupyterLab. Where no
script runs (a notebook JupyterLab does not trust yet, a renderer that strips scripts and styles) only the
start frame shows, the controls stay disabled and a note says why; the other frames live in the script,
so a renderer that drops it does not print every frame's text one after the other."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedlib.teach import _checks

if TYPE_CHECKING:
    from pagedlib.teach.tracer import BlockTableTracer

_BAR = "display:flex;gap:6px;align-items:center;flex-wrap:wrap;font:13px system-ui,sans-serif;margin:4px 0"
_BUTTON = "padding:2px 10px;border:1px solid #888;border-radius:4px;background:#F4F6FA;cursor:pointer"
_NOTE = "font:12px system-ui,sans-serif;color:#8A5A00;background:#FFF6DB;padding:3px 8px;border-radius:4px"
_STATIC = ("Showing one frame only: the controls need this output's script, which JupyterLab runs "
           "once it trusts the notebook (run this cell, or Trust Notebook from the command palette).")
# One player per output: the script finds its own root (the element around it) and needs no id.
_SCRIPT = """<script>(function (root) {
  var holder = root.querySelector(".pl-frames"), first = holder.firstElementChild;
  FRAMES.forEach(function (h, i) {  // the start frame is in the page already; the others are built here
    if (i === START) { holder.appendChild(first); return; }
    var div = document.createElement("div");
    div.className = "pl-frame"; div.style.display = "none"; div.innerHTML = h; holder.appendChild(div);
  });
  var frames = root.querySelectorAll(".pl-frame"), slider = root.querySelector(".pl-slider"),
      label = root.querySelector(".pl-label"), labels = LABELS,
      back = root.querySelector(".pl-back"), play = root.querySelector(".pl-play"),
      forward = root.querySelector(".pl-forward"), last = frames.length - 1, timer = null;
  function show(k) {
    k = Math.max(0, Math.min(last, k));
    frames.forEach(function (f, i) { f.style.display = i === k ? "" : "none"; });
    slider.value = k; label.textContent = labels[k];
    back.disabled = k === 0; forward.disabled = k === last;
  }
  function pause() { clearInterval(timer); timer = null; play.textContent = "\\u25B6 Play"; }
  function tick() { if (+slider.value >= last) { pause(); } else { show(+slider.value + 1); } }
  back.onclick = function () { pause(); show(+slider.value - 1); };
  forward.onclick = function () { pause(); show(+slider.value + 1); };
  slider.oninput = function () { pause(); show(+slider.value); };
  play.onclick = function () {
    if (timer) { pause(); return; }
    if (+slider.value >= last) { show(0); }
    play.textContent = "\\u275A\\u275A Pause"; timer = setInterval(tick, INTERVAL);
  };
  slider.disabled = play.disabled = false; root.querySelector(".pl-static").remove(); show(START);
})(document.currentScript.parentNode);</script>"""


def _script_json(value: object) -> str:
    """``value`` as JSON that cannot end the ``<script>`` it sits in (no ``</``, no ``<!--``)."""
    return json.dumps(value).replace("</", "<\\/").replace("<!--", "<\\u0021--")


class Player:
    """Step through ``frames`` (HTML strings) with a slider, Back, Play and Forward, in the page.

    Args:
        labels: the text shown beside the slider for each frame (default ``frame k of n``).
        start: the frame shown first, and the only one where no script runs.
    """

    def __init__(self, frames: Sequence[str], labels: Sequence[str] | None = None, *, start: int = 0,
                 interval_ms: int = 900) -> None:
        self.frames, self.labels, self.start, self.interval_ms = _checks.frames(frames, labels, start,
                                                                                interval_ms)

    @classmethod
    def of_tracer(cls, tracer: BlockTableTracer, *, start: int = 0, interval_ms: int = 900) -> Player:
        """A player of every step of ``tracer``'s history (what its Back and Forward buttons show)."""
        frames = tracer.frames()
        return cls(frames, [f"step {k} of {len(frames) - 1}" for k in range(len(frames))], start=start,
                   interval_ms=interval_ms)

    def html(self) -> str:
        """The player as one self-contained HTML string (frame ``start`` visible without the script)."""
        last, start = len(self.frames) - 1, self.start
        buttons = "".join(f"<button type='button' class='pl-{cls}' style='{_BUTTON}' disabled>{text}</button>"
                          for cls, text in (("back", "&#9664; Back"), ("play", "&#9654; Play"),
                                            ("forward", "Forward &#9654;")))
        bar = (f"<div style='{_BAR}'>{buttons}<input type='range' class='pl-slider' min='0' max='{last}' "
               f"value='{start}' step='1' style='width:220px' disabled aria-label='frame'>"
               f"<span class='pl-label'>{html.escape(self.labels[start])}</span>"
               f"<span class='pl-static' style='{_NOTE}'>{_STATIC}</span></div>")
        shown = f"<div class='pl-frames'><div class='pl-frame'>{self.frames[start]}</div></div>"
        others = [None if k == start else f for k, f in enumerate(self.frames)]  # [frames], start as null
        values = {"INTERVAL": str(self.interval_ms), "START": str(start), "LABELS": _script_json(self.labels),
                  "FRAMES": _script_json(others)}
        # one pass, so that a placeholder's name inside a frame or a label is never replaced
        script = re.sub(r"\b(INTERVAL|START|LABELS|FRAMES)\b", lambda m: values[m.group(1)], _SCRIPT)
        return f"<div class='pl-player'>{bar}{shown}{script}</div>"

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return f"Player({len(self.frames)} frames)"

