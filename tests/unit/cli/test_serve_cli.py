"""``python -m zpipe serve`` refuses what it cannot do before it loads or listens."""

from __future__ import annotations

from pathlib import Path

import pytest

from zpipe.cli.serve import main


def test_serve_refuses_several_stages_and_a_missing_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(tmp_path), "--stages", "3"]) == 2
    assert "generation run kind" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nowhere")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--port", "70000"]) == 2
    assert "is not a TCP port" in capsys.readouterr().err
