"""The site builds with ``mkdocs build --strict`` (no warning: every page in the
nav exists, links and anchors resolve, mkdocstrings renders the API), in this
process, into a temporary folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (.[docs])")
    pytest.importorskip("material", reason="mkdocs-material is not installed (the docs extra)")
    pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed (the docs extra)")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(
        config_file=str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site")
    )
    logging.getLogger("mkdocs").setLevel(logging.WARNING)
    try:
        build(config)  # raises mkdocs.exceptions.Abort on any warning under strict
    finally:
        config.plugins.on_shutdown()
    site = tmp_path / "site"
    for page in ("reference/cli", "reference/protocol", "reference/errors", "reference/api"):
        html = (site / page / "index.html").read_text(encoding="utf-8")
        assert "generated:" not in html, page
    assert "zpipe coordinator" in (site / "reference/cli/index.html").read_text(encoding="utf-8")
