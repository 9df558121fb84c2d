"""Small helpers the notebooks share."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any


def show_source(obj: Any) -> Any:
    """Display the highlighted source of a ``pagedlib`` function, class or method in a notebook."""
    from IPython.display import HTML
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import PythonLexer

    code = textwrap.dedent(inspect.getsource(obj))  # noclasses: inline styles, so the HTML renders anywhere
    body = highlight(code, PythonLexer(), HtmlFormatter(noclasses=True, style="default", nobackground=True))
    name = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"
    caption = f"<div style='font-size:85%;color:#666'>source: <code>{name}</code></div>"
    return HTML(f"<div>{caption}{body}</div>")
