"""`zpipe train` against a coordinator: one that never answers (the connect deadline) and the
session's running cluster (split from tests/unit/cli/test_cli_checks.py, which starts no
process and opens no socket)."""

from __future__ import annotations

from pathlib import Path

import pytest

from zpipe.cli import train as train_cli
from zpipe.cluster import LocalCluster

TINY = ["--steps", "1", "--batch-size", "4", "--microbatches", "2"]


def test_train_gives_up_on_a_silent_coordinator_at_the_connect_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--coordinator", "tcp://127.0.0.1:1", "--connect-timeout", "0.5", *TINY]
    assert train_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "tcp://127.0.0.1:1" in err and "--connect-timeout" in err


def test_train_reaches_a_running_coordinator_and_saves(
    cluster: LocalCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = tmp_path / "w.safetensors"
    argv = ["--coordinator", cluster.coordinator_endpoint, "--connect-timeout", "60", *TINY]
    assert train_cli.main([*argv, "--optimizer", "sgd", "-o", str(weights)]) == 0
    assert f"weights saved to {weights}" in capsys.readouterr().out
    assert weights.stat().st_size > 0
