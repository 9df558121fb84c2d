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
    body = highlight(code, PythonLexer(), HtmlFormatter(noclasses=True, style="default", nobackground=True))
    module = getattr(obj, "__module__", "")
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", ""))
    caption = f"<div style='font-size:85%;color:#666'>source: <code>{module}.{name}</code></div>"
    return f"<div>{caption}{body}</div>"


def show_source(obj: Any) -> Any:
    """Display the highlighted source of a ``pagedlib`` function, class or method in a notebook."""
    from IPython.display import HTML

    return HTML(source_html(obj))
