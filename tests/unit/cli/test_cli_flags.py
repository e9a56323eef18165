"""Every command documents itself, and bad flags exit with status 2 and say why.

In this process, through each command's ``main(argv)`` (``python -m MODULE`` runs
the same function; tests/cluster/test_cli.py runs each entry point as a process
once): argparse's refusals are ``SystemExit(2)``, the others a returned status.
"""

from __future__ import annotations

import importlib

import pytest

# ``python -m NAME`` -> the module whose main it runs
ENTRY_POINTS = {
    "zpipe": "zpipe.cli",
    "zpipe.stage": "zpipe.cli.stage",
    "zpipe.coordinator": "zpipe.cli.coordinator",
    "zpipe.cli.lossy": "zpipe.cli.lossy",
}


def run(capsys: pytest.CaptureFixture[str], name: str, *argv: str) -> tuple[int, str, str]:
    main = importlib.import_module(ENTRY_POINTS[name]).main
    try:
        code = int(main(list(argv)))
    except SystemExit as exc:  # argparse's --help and refusals
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


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
def test_help_documents_the_flags(
    capsys: pytest.CaptureFixture[str], args: list[str], mentions: list[str]
) -> None:
    code, out, err = run(capsys, *args)
    assert code == 0, err
    for flag in mentions:
        assert flag in out


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
def test_bad_flags_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2, (out, err)
    assert message in err
    assert "Traceback" not in err
