"""Small helpers the notebooks share."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def show_source(obj: Any, elide: dict[str, str] | None = None) -> Any:
    """Display the highlighted source of a ``pagedlib`` function, class or method in a notebook. ``elide``
    maps the start of a line that opens a block (``"if self.prefix_cache"``) to a label: that line and the
    block under it are shown as one comment, ``# ... label``, so a chapter can show the path it teaches and
    say where the rest is taught. A start that matches no line is an error (the source changed)."""
    from pygments.lexers import PythonLexer

    code = textwrap.dedent(inspect.getsource(obj))
    for start, label in (elide or {}).items():
        code = elide_block(code, start, label)
    name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"
    return _highlighted(code, PythonLexer(), f"<code>{name}</code>")


def _highlighted(code: str, lexer: Any, source: str) -> Any:
    """``code`` highlighted by ``lexer`` under a caption naming its ``source`` (HTML), as notebook HTML."""
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter

    # noclasses: inline styles, so the HTML renders anywhere
    body = highlight(code, lexer, HtmlFormatter(noclasses=True, style="default", nobackground=True))
    caption = f"<div style='font-size:85%;color:#666'>source: {source}</div>"
    return HTML(f"<div>{caption}{body}</div>")


def elide_block(code: str, start: str, label: str) -> str:
    """``code`` with the first line that starts (after its indentation) with ``start``, and every line
    indented deeper below it, replaced by ``# ... label`` at that line's indentation."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip().startswith(start):
            indent = len(line) - len(line.lstrip())
            end = i + 1
            while end < len(lines) and (not lines[end].strip() or
                                        len(lines[end]) - len(lines[end].lstrip()) > indent):
                end += 1
            return "\n".join([*lines[:i], " " * indent + f"# ... {label}", *lines[end:]]) + "\n"
    raise ValueError(f"no line of the source starts with {start!r}")


def c_function(source: str, name: str) -> str:
    """The definition of C function ``name`` in ``source``, with the comment block just above it: from its
    first line that opens a definition (``... name(`` at the start of a line) to the ``}`` that closes it
    at the start of a line. ``ValueError`` if no definition of ``name`` is there."""
    lines = source.splitlines()
    for i, line in enumerate(lines):
        if not line[:1].isspace() and f" {name}(" in line and not line.rstrip().endswith(";"):
            first = i
            above = lines[first - 1].rstrip() if first else ""
            while above and not above.endswith(("}", ";")):  # the comment that opens the definition
                first -= 1
                above = lines[first - 1].rstrip() if first else ""
            last = next(j for j in range(i, len(lines)) if lines[j].startswith("}"))
            return "\n".join(lines[first:last + 1]) + "\n"
    raise ValueError(f"no definition of {name} in the C source")


def show_c_source(path: Any, name: str) -> Any:
    """Display the highlighted C function ``name`` of the file ``path`` (the CPU kernel, ``cpu_varlen.c``),
    its comment included, the way ``show_source`` shows Python."""
    from pathlib import Path

    from pygments.lexers import CLexer

    path = Path(path)
    code = c_function(path.read_text(), name)
    return _highlighted(code, CLexer(), f"<code>pagedlib/kernels/{path.name}</code>, <code>{name}</code>")
