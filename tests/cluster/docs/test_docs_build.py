"""The site builds: ``mkdocs build --strict`` into a temporary folder, as CI runs it.

Any warning fails the build: a page of the nav that is missing, a link or an
anchor that does not resolve, a docstring mkdocstrings cannot render, a
reference page whose generator fails. It runs mkdocs as a process (mkdocstrings
formats signatures with ruff and reads git in processes of its own), so it
lives in the cluster lane; the checks of the generated pages' contents that
need no process are in tests/unit/docs/."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.cluster


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("mkdocs", "material", "mkdocstrings")),
    reason="the docs extra is not installed: pip install -e '.[docs]'",
)
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for page in ("reference/cli", "reference/protocol", "reference/errors", "reference/api"):
        html = (site / page / "index.html").read_text(encoding="utf-8")
        assert "generated:" not in html, page
    cli = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    assert "zpipe coordinator" in cli
