"""Sphinx configuration of the relaygr-engine API reference (``sphinx-build -W -b html docs docs/_build``).

The reference is built from the numpydoc docstrings of the installed package (autodoc + napoleon); nothing is
fetched from the network.
"""
import relaygr_engine

project = "relaygr-engine"
author = "relaygr-engine contributors"
copyright = "relaygr-engine contributors, Apache-2.0"
release = version = relaygr_engine.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes" sections as fields (dataclass fields are not documented twice)
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path: list = []
