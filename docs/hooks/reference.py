"""MkDocs hook: the reference pages generated from the code while the site builds.

A page holding ``<!-- generated: cli -->`` (or ``protocol``, ``errors``) gets the
Markdown of :mod:`zpipe.cli.reference` in its place; the files on disk keep only
their hand-written introduction and the marker.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_cache: dict[str, str] = {}


def on_config(config: Any) -> Any:
    # this checkout's zpipe, not an installed copy of another one
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    _cache.clear()
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    from zpipe.cli.reference import MARKER, expand

    if not MARKER.search(markdown):
        return markdown
    return expand(markdown, _cache)
