"""Sphinx configuration: API pages come from the numpydoc docstrings."""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "cuattn"
author = "the cuattn developers"
release = "0.1.0"
extensions = ["sphinx.ext.autodoc", "numpydoc"]
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
autodoc_mock_imports = ["cupy"]
exclude_patterns = ["_build"]
html_theme = "alabaster"
