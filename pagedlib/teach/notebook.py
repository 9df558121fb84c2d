"""Small helpers the notebooks share."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def source_html(obj: Any) -> str:
    """Syntax-highlighted HTML of ``obj``'s source (inline styles, so it renders anywhere)."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    code = textwrap.dedent(inspect.getsource(obj))
    formatter = HtmlFormatter(noclasses=True, style="default", nobackground=True)
    body = highlight(code, PythonLexer(), formatter)
    module = getattr(obj, "__module__", "")
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
    caption = f"<div style='font-size:85%;color:#666'>source: <code>{module}.{name}</code></div>"
    return f"<div>{caption}{body}</div>"


def show_source(obj: Any) -> Any:
    """Display the highlighted source of a ``pagedlib`` function, class or method in a notebook.

    The notebooks never copy code: they show the library's own source with this, then run it.
    """
    from IPython.display import HTML

    return HTML(source_html(obj))
