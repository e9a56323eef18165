"""Every command documents itself, and bad flags exit with status 2 and say why."""

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
        (
            ["zpipe", "--help"],
            [
                *("demo", "train", "coordinator", "stage", "profile", "plan", "keys", "lossy"),
                "zpipe.coordinator",
            ],
        ),
        (
            ["zpipe", "demo", "--help"],
            ["--local N, --stages N", "deprecated", "--dtype", "--microbatch-size"],
        ),
        (["zpipe", "keys", "--help"], ["--dir"]),
        (["zpipe", "profile", "--help"], ["--model", "--batch-sizes", "--output"]),
        (
            ["zpipe", "plan", "--help"],
            [
                "--profile FILE, --profiles FILE",
                "--cluster",
                "--planner PLANNER, --algo PLANNER",
                "--microbatch-size N, --batch-size N",
                "--microbatches",
                "--json",
            ],
        ),
        (
            ["zpipe", "train", "--help"],
            [
                *("--local", "--coordinator", "--schedule", "--output", "--recover"),
                *("--rebalance", "--connect-timeout", "--planner", "--microbatches"),
            ],
        ),
        (["zpipe", "lossy", "--help"], ["--allocation", "--multiprocess", "--out"]),
        (["zpipe.cli.lossy", "--help"], ["--allocation", "--sweep"]),
        (["zpipe", "coordinator", "--help"], ["--bind", "--state-dir"]),
        (["zpipe", "stage", "--help"], ["--coordinator", "--slowdown"]),
        (
            ["zpipe.stage", "--help"],
            [
                "--coordinator",
                "--slowdown",
                "--bandwidth-mbps",
                "--keys",
                "--heartbeat-interval",
                "--log-format",
            ],
        ),
        (
            ["zpipe.coordinator", "--help"],
            ["--bind", "--suspect-after", "--keys", "--log-format", "--no-measure-links"],
        ),
    ],
)
def test_help_documents_the_flags(args: list[str], mentions: list[str]) -> None:
    result = run(*args)
    assert result.returncode == 0, result.stderr
    for flag in mentions:
        assert flag in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["zpipe"], "usage"),
        (["zpipe", "launch"], "unknown command 'launch'"),
        (["zpipe", "demo", "--stages", "9"], "--stages"),
        (["zpipe", "demo", "--batches", "0"], "must be >= 1"),
        (["zpipe", "keys"], "required"),
        (["zpipe", "plan", "--profiles", "p.json"], "--cluster"),
        (
            ["zpipe", "plan", "--profiles", "p", "--cluster", "c", "--algo", "best"],
            "invalid choice",
        ),
        (["zpipe", "profile", "--model", "nonexistent", "-o", "x"], "invalid choice"),
        (["zpipe.stage"], "--coordinator"),
        (["zpipe.stage", "--coordinator", "tcp://127.0.0.1:5550"], "--name"),
        (["zpipe.stage", "--coordinator", "localhost:5550", "--name", "a"], "tcp://HOST:PORT"),
        (["zpipe.stage", "--coordinator", "tcp://h:1", "--name", "a/b"], "stage name"),
        (
            ["zpipe.stage", "--coordinator", "tcp://h:1", "--name", "a", "--slowdown", "fast"],
            "not a number",
        ),
        (
            ["zpipe.stage", "--coordinator", "tcp://h:1", "--name", "a", "--slowdown", "0.5"],
            "slowdown must be >= 1",
        ),
        (["zpipe.stage", "--coordinator", "tcp://h:1", "--name", "a", "--loss", "1.5"], "below 1"),
        (
            ["zpipe.stage", "--coordinator", "tcp://h:1", "--name", "a", "--keys", "/nonexistent"],
            "not a directory",
        ),
        (["zpipe.coordinator", "--bind", "nowhere"], "tcp://HOST:PORT"),
        (["zpipe.coordinator", "--heartbeat-interval", "-1"], "must be > 0"),
        (["zpipe.coordinator", "--log-format", "xml"], "invalid choice"),
        (["zpipe", "train", "--local", "2", "--rebalance", "0.2"], "need --recover"),
        (["zpipe", "train", "--local", "2", "--recover", "--rebalance", "2"], "between 0 and 1"),
        (["zpipe", "train", "--local", "2", "--recover", "--recovery", "pray"], "invalid choice"),
        (["zpipe", "train", "--local", "2", "--consistency", "fast"], "need --recover"),
        (["zpipe", "train", "--local", "2", "--replication", "chain"], "need --recover"),
        (["zpipe", "train", "--local", "2", "--recover", "--consistency", "eh"], "invalid choice"),
        # issue 19: clear refusals, never a traceback
        (["zpipe", "train", "--coordinator", "garbage"], "must look like tcp://HOST:PORT"),
        (["zpipe", "train", "-o", "/nonexistent/dir/f.safetensors"], "does not exist"),
        (["zpipe", "train", "--momentum", "2"], "argument --momentum"),
        (
            ["zpipe", "stage", "--coordinator", "tcp://h:1", "--name", "a", "--slowdown", "inf"],
            "argument --slowdown: 'inf' must be a finite number",
        ),
        (["zpipe", "coordinator", "--heartbeat-interval", "inf"], "argument --heartbeat-interval"),
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
