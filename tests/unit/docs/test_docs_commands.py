"""The set-up commands read the same everywhere a user may copy them from.

The test command is written out in ``.ci/run`` (what CI runs), the README, the
install page and the site's home page; a copy that drifts would send a user to a
command CI never ran. The demo command is in the same three pages."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
COPIES = ["README.md", "docs/getting-started/install.md", "docs/index.md"]
DEMO = "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m zpipe demo"


def ci_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    commands = [line for line in lines if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 1, "one set-up line in .ci/run"
    return commands[0]


def test_ci_runs_the_docs_build_and_the_unit_lane_before_the_rest() -> None:
    steps = [step.strip() for step in ci_command().split("&&")]
    build = steps.index(".venv/bin/mkdocs build --strict")
    unit = next(
        i for i, s in enumerate(steps) if s.startswith(".venv/bin/python -m pytest tests/unit")
    )
    rest = next(i for i, s in enumerate(steps) if "tests/cluster" in s)
    assert build < unit < rest
    assert "tests/integration" in steps[rest]
    assert "[test,docs]" in steps[1]


@pytest.mark.parametrize("page", COPIES)
def test_each_page_gives_the_ci_test_command_and_the_demo_command(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert ci_command() in text.splitlines(), f"{page} lacks .ci/run's test command"
    assert DEMO in text.splitlines(), f"{page} lacks the demo command"
