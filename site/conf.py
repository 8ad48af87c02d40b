"""Sphinx configuration of the course website. ``site/build.py`` assembles the pages and runs
Sphinx with this file; the environment variables below come from it."""

import os

project = "Data-Parallel PyTorch"
author = "the course's authors"
copyright = "the course's authors, MIT licence"

extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]

# Furo bundles its CSS, scripts and icons and uses the system's fonts: nothing is fetched from
# a CDN, so the built site reads offline. The course has no math to render (no MathJax).
html_theme = "furo"
html_title = project
html_copy_source = False  # no _sources/ folder: the pages are the content
html_show_sourcelink = False
html_last_updated_fmt = None

myst_heading_anchors = 3  # Markdown links to "page.md#section" resolve

# Notebooks: "cache" executes each notebook once per version of its code cells and keeps the
# outputs in jupyter-cache; "off" shows them unexecuted (build.py's --execute).
nb_execution_mode = os.environ.get("DPT_SITE_NB_MODE", "off")
nb_execution_cache_path = os.environ.get("DPT_SITE_CACHE", "")
nb_execution_timeout = 900  # per cell: only stops a cell that hangs
nb_execution_raise_on_error = True  # a failing notebook fails the build
nb_execution_show_tb = True
nb_merge_streams = True
nb_output_stderr = "remove-warn"
html_favicon = "favicon.svg"  # a page without one makes the browser ask for /favicon.ico
