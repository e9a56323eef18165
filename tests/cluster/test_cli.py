"""Every entry point runs as a process: it documents itself, and a bad flag exits with
status 2 and says why (every command's flags: tests/unit/cli/test_cli_flags.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

COMMANDS = [
    ["zpipe"],
    ["zpipe.stage"],
    ["zpipe.coordinator"],
]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["zpipe", "--help"], ["demo", "train", "coordinator", "stage", "zpipe.coordinator"]),
        (["zpipe.stage", "--help"], ["--coordinator", "--slowdown", "--keys"]),
        (["zpipe.coordinator", "--help"], ["--bind", "--suspect-after", "--keys"]),
    ],
)
def test_help_documents_the_flags(args: list[str], mentions: list[str]) -> None:
    # each entry point as a process, once; every command's flags and refusals are
    # checked in process by tests/unit/cli/test_cli_flags.py
    result = run(*args)
    assert result.returncode == 0, result.stderr
    for flag in mentions:
        assert flag in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["zpipe", "launch"], "unknown command 'launch'"),
        (["zpipe.stage", "--coordinator", "localhost:5550", "--name", "a"], "tcp://HOST:PORT"),
        (["zpipe.coordinator", "--heartbeat-interval", "-1"], "must be > 0"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_coordinator_refuses_a_port_it_cannot_bind() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run("zpipe.coordinator", "--bind", f"tcp://127.0.0.1:{port}")
    assert result.returncode == 1
    assert "cannot bind" in result.stderr


@pytest.mark.parametrize("command", [["zpipe.stage"], ["zpipe", "stage"]])
@pytest.mark.parametrize("flag", ["--bind", "--probe-bind"])
def test_stage_refuses_a_port_it_cannot_bind(command: list[str], flag: str) -> None:
    """A stage told to bind a port in use exits 1 and names the address (it hung: the
    socket whose bind failed was left open, and closing the context waited for it)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # nothing listens at the coordinator's address: the stage fails before registering
        result = run(
            *command, "--coordinator", "tcp://127.0.0.1:9", "--name", "occupied",
            flag, f"tcp://127.0.0.1:{port}",
            timeout=90,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert f"cannot bind tcp://127.0.0.1:{port}: Address already in use" in result.stderr
    assert "choose another port" in result.stderr
    assert "Traceback" not in result.stderr


def test_train_command_trains_saves_and_matches_single_process(tmp_path: Path) -> None:
    weights = tmp_path / "trained.safetensors"
    result = run(
        "zpipe", "train", "--local", "2", "--steps", "4", "--batch-size", "8",
        "--microbatches", "2", "--optimizer", "sgd", "--lr", "0.1", "--check",
        "--recover", "--replicate-every", "2", "-o", str(weights), timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    match = re.search(r"weights differ by at most ([0-9.e+-]+)", result.stdout)
    assert match is not None, result.stdout
    assert float(match.group(1)) < 1e-4
    assert "schedule 1f1b" in result.stdout
    # the saved weights are the trained model's and load into a fresh build
    from zpipe.models import ModelSpec, build_full_model
    from zpipe.models.weights import load_unit_weights

    spec = ModelSpec.preset("mlp-small", seed=0)
    fresh = build_full_model(spec)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    load_unit_weights(list(fresh.units), start=0, path=weights)
    assert any(not torch.equal(before[k], v) for k, v in fresh.state_dict().items())
