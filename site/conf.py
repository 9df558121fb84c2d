"""Sphinx configuration of the course website (``make site``; ``site/build.py`` stages the sources).

The pages are the committed, executed notebooks: nothing is re-executed. Every script, stylesheet and font
a page loads is served from the build (MathJax is vendored under ``_static/vendor``), so a page makes no
request outside it."""

project = "Paged attention, hands on"
author = "the pagedlib authors"
copyright = "2026, the pagedlib authors"

extensions = ["myst_nb"]
nb_execution_mode = "off"  # the notebooks are committed executed; CI re-runs them with nbval
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "_static", "**.ipynb_checkpoints"]

html_theme = "sphinx_book_theme"
html_title = project
html_static_path = ["_static"]
# No copies of the sources: a reader gets the notebooks by cloning the repository (the landing page's
# two commands), and the staged copies differ from the committed ones in their widget outputs.
html_copy_source = False
html_theme_options = {
    "use_download_button": False,
    "use_fullscreen_button": False,
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
html_context = {"default_mode": "light"}  # the outputs' inline styles (tracer, tables) suit a light page
# Sphinx loads MathJax from a CDN by default; the vendored single-file SVG build needs no fonts or
# extra components (the menu would offer ones it fetches, so it is off).
mathjax_path = "vendor/mathjax-3.2.2/tex-svg.js"
mathjax3_config = {"options": {"enableMenu": False}}
