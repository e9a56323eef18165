"""``python -m zpipe serve`` refuses what it cannot do before it loads or listens,
and maps its cluster flags to the generation run's settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from zpipe.cli.serve import build_parser, cluster_settings, main
from zpipe.client.runs.generation import GenerateOptions


def test_serve_refuses_several_stages_and_a_missing_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(tmp_path), "--stages", "3"]) == 2
    assert "--stages above 1 needs --coordinator" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nowhere")]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert main(["--model", str(tmp_path), "--port", "70000"]) == 2
    assert "is not a TCP port" in capsys.readouterr().err


def test_cluster_flags_need_a_coordinator(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--model", str(tmp_path), "--keys", str(tmp_path), "--max-sequences", "2"]) == 2
    assert "--keys, --max-sequences only go with --coordinator" in capsys.readouterr().err
    # a cluster backend is built only from a checkpoint directory
    code = main(["--model", str(tmp_path / "nowhere"), "--coordinator", "tcp://127.0.0.1:1"])
    assert code == 1
    assert "not a directory" in capsys.readouterr().err


def test_cluster_flags_become_the_runs_settings(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    local = parse(["--model", str(tmp_path), "--stages", "1"])
    assert cluster_settings(local) is None
    args = parse(["--model", str(tmp_path), "--coordinator", "tcp://hub:5555"])
    settings = cluster_settings(args)
    assert settings == {"stages": 2, "max_sequences": 8, "token_timeout_s": 120.0}
    GenerateOptions(**settings)  # every key is one of the run's settings
    args = parse(
        [
            "--model",
            str(tmp_path),
            "--coordinator",
            "tcp://hub:5555",
            "--stages",
            "3",
            "--max-sequences",
            "4",
            "--max-context",
            "512",
            "--token-timeout",
            "30",
            "--wait-for-stages",
            "60",
        ]
    )
    settings = cluster_settings(args)
    assert settings == {
        "stages": 3,
        "max_sequences": 4,
        "token_timeout_s": 30.0,
        "max_context": 512,
        "wait_for_stages_s": 60.0,
    }
    assert GenerateOptions(**settings).stage_count == 3
