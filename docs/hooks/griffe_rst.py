"""Griffe extension (mkdocstrings): zpipe's docstrings write Sphinx roles
(``:class:`X```) and double backquotes; rendered as Markdown they become inline
code, the same conversion the generated reference pages use."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import griffe

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from zpipe.cli.reference import rst_to_markdown  # noqa: E402


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and docstring.value:
            docstring.value = rst_to_markdown(docstring.value)
