"""The site's build fills the generated reference pages: ``mkdocs.yml`` registers
``docs/hooks/reference.py``, and the hook turns each marker page into its content.

CI's ``mkdocs build --strict`` (``.ci/run``) is what checks that the site builds.
A hook that is not registered, or that left a marker in place, would still build
cleanly: the marker is an HTML comment, so the page would come out empty without a
warning. These checks are what the build does not see; they call the hook the way
MkDocs does, in this process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from zpipe.cli import reference as ref

ROOT = Path(__file__).resolve().parents[3]
HOOK = ROOT / "docs" / "hooks" / "reference.py"
MARKED = sorted(
    p for p in (ROOT / "docs").rglob("*.md") if ref.MARKER.search(p.read_text(encoding="utf-8"))
)


def _hooks_in_mkdocs_yml() -> list[str]:
    """The paths under ``hooks:`` in mkdocs.yml (its other tags need MkDocs' loader)."""
    lines = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines()
    start = lines.index("hooks:") + 1
    hooks = []
    for line in lines[start:]:
        if not line.startswith("  - "):
            break
        hooks.append(line.removeprefix("  - ").strip())
    return hooks


@pytest.fixture(scope="module")
def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_zpipe_docs_reference_hook", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mkdocs_runs_the_reference_hook() -> None:
    assert "docs/hooks/reference.py" in _hooks_in_mkdocs_yml()


def test_the_reference_pages_hold_markers() -> None:
    assert {p.relative_to(ROOT / "docs").as_posix() for p in MARKED} >= {
        "reference/cli.md",
        "reference/protocol.md",
        "reference/errors.md",
    }


@pytest.mark.parametrize("page", MARKED, ids=lambda p: p.name)
def test_the_hook_replaces_every_marker_with_its_page(
    hook: ModuleType, page: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # on_config puts the root on it
    config = SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml"))
    assert hook.on_config(config) is config
    markdown = page.read_text(encoding="utf-8")
    built = hook.on_page_markdown(markdown, page=None, config=config, files=None)
    assert not ref.MARKER.search(built)
    for name in {m.group(1) for m in ref.MARKER.finditer(markdown)}:
        assert ref.GENERATORS[name]() in built, name
    # the hand-written introduction stays
    assert built.startswith(markdown[: ref.MARKER.search(markdown).start()])  # type: ignore[union-attr]


def test_the_cli_page_comes_out_with_the_commands(hook: ModuleType) -> None:
    markdown = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert "## zpipe coordinator" not in markdown  # only the generated part has its section
    built = hook.on_page_markdown(markdown, page=None, config=None, files=None)
    assert "## zpipe coordinator" in built
