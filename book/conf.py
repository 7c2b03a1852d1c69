"""Sphinx configuration: the flashqla book, built offline from the notebooks and these pages.

Build (also run by the test suite): ``sphinx-build -W -b html book book/_build/html``.
"""

project = "flashqla"
author = "the flashqla authors"
copyright = "2026, the flashqla authors"

extensions = ["myst_nb", "sphinx-mathjax-offline"]  # MathJax served from _static: no network
exclude_patterns = ["_build", "conf.py", "**/.ipynb_checkpoints"]

# The notebooks are jupytext percent files (notebooks/ is linked in as book/notebooks).
nb_custom_formats = {".py": ["jupytext.reads", {"fmt": "py:percent"}]}
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_timeout = 300
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath"]

html_theme = "sphinx_book_theme"
html_title = "flashqla"
html_theme_options = {"show_toc_level": 2}
suppress_warnings = ["mystnb.unknown_mime_type"]
