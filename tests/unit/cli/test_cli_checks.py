"""One command line: dispatch, one name per idea, and bad input refused before any work.

Everything here fails fast, so it runs in this process through each command's
``main(argv)``: argparse's refusals are ``SystemExit(2)``, the others a returned status.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from zpipe import __main__ as zpipe_main
from zpipe._errors import ConfigError, PipelineError
from zpipe.cli import coordinator as coordinator_main
from zpipe.cli import demo
from zpipe.cli import keys as keys_cli
from zpipe.cli import lossy as experiment
from zpipe.cli import plan as plan_cli
from zpipe.cli import profile as profiler
from zpipe.cli import stage as stage_main
from zpipe.cli import train as train_cli
from zpipe.cli.common import DeprecatedAlias
from zpipe.config import Timeouts
from zpipe.planner.profile import synthetic_profile
from zpipe.transport import security

Main = Callable[[list[str]], int]


def exit_status(main: Main, argv: list[str]) -> int:
    """What the command exits with: argparse's SystemExit code or main's return value."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


# -- dispatch -------------------------------------------------------------------------------


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert zpipe_main.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("demo", "train", "coordinator", "stage", "profile", "plan", "keys", "lossy"):
        assert f"\n  {name} " in out, name


@pytest.mark.parametrize(
    ("command", "prog"),
    [
        ("coordinator", "python -m zpipe.coordinator"),
        ("stage", "python -m zpipe.stage"),
        ("lossy", "python -m zpipe lossy"),
        ("plan", "python -m zpipe plan"),
        ("keys", "python -m zpipe keys"),
    ],
)
def test_every_command_is_dispatched(
    command: str, prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(zpipe_main.main, [command, "--help"]) == 0
    assert f"usage: {prog}" in capsys.readouterr().out


def test_an_unknown_command_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert zpipe_main.main(["lossy-device"]) == 2
    assert "unknown command 'lossy-device'" in capsys.readouterr().err
    assert zpipe_main.main([]) == 2


# -- one name per idea ----------------------------------------------------------------------


@pytest.fixture
def plan_files(tmp_path: Path) -> tuple[Path, Path]:
    # two batch sizes, the larger one cheaper per sample, so the two plans differ
    data = synthetic_profile([1.0, 2.0, 1.0, 2.0], [10, 10, 10, 10]).to_dict()
    data["batch_sizes"], data["input_bytes"] = [1, 2], [0, 0]
    for unit in data["units"]:
        unit["time_s"] = [unit["time_s"][0], 1.5 * unit["time_s"][0]]
        unit["output_bytes"] = [unit["output_bytes"][0], 2 * unit["output_bytes"][0]]
        unit["memory_bytes"] = [0, 0]
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(data))
    cluster = tmp_path / "c.json"
    cluster.write_text(
        json.dumps({"format": "zpipe-cluster/1", "devices": [{"name": "d", "count": 2}]})
    )
    return profile, cluster


def test_old_spellings_still_work_and_warn_once_each(
    plan_files: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile, cluster = plan_files
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    current = ["--profile", str(profile), "--cluster", str(cluster), "--planner", "even"]
    assert plan_cli.main([*current, "--microbatch-size", "2", "--json", str(new)]) == 0
    assert "deprecated" not in capsys.readouterr().err
    legacy = ["--profiles", str(profile), "--cluster", str(cluster), "--algo", "even"]
    assert plan_cli.main([*legacy, "--batch-size", "2", "--json", str(old)]) == 0
    warnings = capsys.readouterr().err.strip().splitlines()
    assert warnings == [
        "python -m zpipe plan: warning: --profiles is deprecated and will be removed; "
        "use --profile",
        "python -m zpipe plan: warning: --algo is deprecated and will be removed; use --planner",
        "python -m zpipe plan: warning: --batch-size is deprecated and will be removed; "
        "use --microbatch-size",
    ]
    assert json.loads(old.read_text()) == json.loads(new.read_text())


def test_microbatch_size_means_samples_per_microbatch_in_both_plan_modes(
    plan_files: tuple[Path, Path], tmp_path: Path
) -> None:
    profile, cluster = plan_files
    out = tmp_path / "plan.json"
    argv = ["--profile", str(profile), "--cluster", str(cluster), "--json", str(out)]
    assert plan_cli.main([*argv, "--microbatch-size", "1"]) == 0
    one = json.loads(out.read_text())["predicted"]["throughput_samples_per_s"]
    assert plan_cli.main([*argv, "--microbatch-size", "2"]) == 0
    two = json.loads(out.read_text())["predicted"]["throughput_samples_per_s"]
    assert one != two  # the flag reached the planner as a micro-batch size


def test_demo_local_replaces_stages(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.build_parser().parse_args(["--local", "2"]).local == 2
    assert "deprecated" not in capsys.readouterr().err
    assert demo.build_parser().parse_args(["--stages", "4"]).local == 4
    assert "--stages is deprecated" in capsys.readouterr().err
    assert train_cli.build_parser().parse_args(["--local", "2"]).local == 2


def test_an_alias_must_name_a_real_old_spelling() -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="must follow"):
        parser.add_argument("--new", "--old", action=DeprecatedAlias, deprecated=("--new",))


# -- numeric flags --------------------------------------------------------------------------

STAGE = ["--coordinator", "tcp://127.0.0.1:5550", "--name", "s0"]


@pytest.mark.parametrize(
    ("main", "argv", "flag"),
    [
        (stage_main.main, [*STAGE, "--heartbeat-interval", "inf"], "--heartbeat-interval"),
        (stage_main.main, [*STAGE, "--heartbeat-interval", "nan"], "--heartbeat-interval"),
        (stage_main.main, [*STAGE, "--slowdown", "inf"], "--slowdown"),
        (stage_main.main, [*STAGE, "--bandwidth-mbps", "-5"], "--bandwidth-mbps"),
        (stage_main.main, [*STAGE, "--latency-ms", "nan"], "--latency-ms"),
        (stage_main.main, [*STAGE, "--loss", "nan"], "--loss"),
        (stage_main.main, [*STAGE, "--loss-seed", "-1"], "--loss-seed"),
        (stage_main.main, [*STAGE, "--retain-memory-mb", "-1"], "--retain-memory-mb"),
        (stage_main.main, [*STAGE, "--coordinator-timeout", "inf"], "--coordinator-timeout"),
        (stage_main.main, [*STAGE, "--memory-mb", "-inf"], "--memory-mb"),
        (stage_main.main, [*STAGE, "--memory-mb", "1e308"], "--memory-mb"),
        (stage_main.main, [*STAGE, "--slowdown", "1e300"], "--slowdown"),
        (stage_main.main, [*STAGE, "--latency-ms", "1e20"], "--latency-ms"),
        (stage_main.main, [*STAGE, "--bandwidth-mbps", "1e300"], "--bandwidth-mbps"),
        (stage_main.main, [*STAGE, "--threads", "1000000000"], "--threads"),
        (coordinator_main.main, ["--heartbeat-interval", "inf"], "--heartbeat-interval"),
        (coordinator_main.main, ["--connect-timeout", "-1"], "--connect-timeout"),
        (coordinator_main.main, ["--send-timeout", "1e12"], "--send-timeout"),
        (coordinator_main.main, ["--suspect-after", "0"], "--suspect-after"),
        (coordinator_main.main, ["--probe-intervals", "10000000000"], "--probe-intervals"),
        (train_cli.main, ["--momentum", "2"], "--momentum"),
        (train_cli.main, ["--momentum", "-0.1"], "--momentum"),
        (train_cli.main, ["--lr", "inf"], "--lr"),
        (train_cli.main, ["--lr", "nan"], "--lr"),
        (train_cli.main, ["--seed", "-3"], "--seed"),
        (train_cli.main, ["--steps", "-1"], "--steps"),
        (train_cli.main, ["--connect-timeout", "inf"], "--connect-timeout"),
        (train_cli.main, ["--recover", "--rebalance", "nan"], "--rebalance"),
        (demo.main, ["--seed", "-1"], "--seed"),
        (demo.main, ["--microbatch-size", "0"], "--microbatch-size"),
        (profiler.main, ["--model", "mlp-small", "-o", "x", "--slowdown", "inf"], "--slowdown"),
        (profiler.main, ["--model", "mlp-small", "-o", "x", "--warmup", "-1"], "--warmup"),
        (profiler.main, ["--model", "mlp-small", "-o", "x", "--threads", "99999"], "--threads"),
        (plan_cli.main, ["--profile", "p", "--cluster", "c", "--microbatches", "0"], "--microb"),
        (experiment.main, ["--out", "o", "--region", "inf"], "--region"),
        (experiment.main, ["--out", "o", "--seed-base", "-1"], "--seed-base"),
        (experiment.main, ["--out", "o", "--sweep-values", "1,nan"], "--sweep-values"),
        (experiment.main, ["--out", "o", "--slot-s", "-0.1"], "--slot-s"),
        (experiment.main, ["--out", "o", "--devices", "1000000000"], "--devices"),
        (experiment.main, ["--out", "o", "--hidden", "16,1000000000"], "--hidden"),
    ],
)
def test_numeric_flags_refuse_inf_nan_and_out_of_range(
    main: Main, argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(main, argv) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err, err


def test_timeouts_refuse_infinite_waits() -> None:
    with pytest.raises(ConfigError, match="heartbeat_interval_s must be finite"):
        Timeouts(heartbeat_interval_s=math.inf)
    with pytest.raises(ConfigError, match="send_s"):
        Timeouts(send_s=math.nan)


def test_profile_refuses_an_output_directory_that_does_not_exist(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model", "mlp-small", "-o", "/nonexistent/dir/p.json"]
    assert exit_status(profiler.main, argv) == 2
    assert "the directory /nonexistent/dir does not exist" in capsys.readouterr().err


# -- train: everything checkable is checked before training ---------------------------------

TINY = ["--steps", "1", "--batch-size", "4", "--microbatches", "2"]


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any refusal below must come before the data is made or a process starts."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("training started")

    monkeypatch.setattr(train_cli, "teacher_batches", forbidden)
    monkeypatch.setattr(train_cli, "_train", forbidden)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--coordinator", "garbage"], "--coordinator: 'garbage' must look like tcp://HOST:PORT"),
        (["--coordinator", "tcp://host-without-port"], "must look like tcp://HOST:PORT"),
        (["-o", "/nonexistent/dir/f.safetensors"], "/nonexistent/dir does not exist"),
        (["-o", "weights.txt"], "the suffix must be one of .safetensors"),
        (["--keys", "/nonexistent/keys"], "not a directory"),
        (["--microbatches", "8", "--batch-size", "4"], "cannot split a --batch-size of 4"),
        (["--rebalance", "0.2"], "need --recover"),
        (["--global-every", "4"], "need --recover"),
        (["--recover", "--global-every", "4"], "need --replication chain or topology"),
        (["--recover", "--replication", "chain", "--chain-every", "0"], "--chain-every"),
        (["--live-copies"], "--live-copies needs --schedule async-1f1b"),
        (
            ["--schedule", "async-1f1b", "--live-copies", "--recover", "--replication", "chain"],
            "leave --replication at global",
        ),
        (["--schedule", "async-1f1b", "--live-copies", "--global-every", "0"], "--global-every"),
    ],
)
def test_train_refuses_bad_input_before_training(
    argv: list[str], message: str, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(train_cli.main, argv) == 2
    assert message in capsys.readouterr().err


def test_train_live_copies_take_their_periods_without_recover() -> None:
    from zpipe.cli.train_args import build_parser

    argv = ["--schedule", "async-1f1b", "--live-copies", "--chain-every", "5"]
    args = build_parser().parse_args(argv)
    train_cli._check_args(build_parser(), args)  # accepted: no --recover needed
    settings = train_cli.run_kind_settings(args)
    assert (settings["live_copies"], settings["chain_every"], settings["global_every"]) == (
        True,
        5,
        None,  # TrainOptions' default: 100
    )


def test_train_refuses_an_output_that_is_a_directory(
    tmp_path: Path, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "w.safetensors"
    target.mkdir()
    assert exit_status(train_cli.main, ["-o", str(target)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_train_local_refuses_keys_without_every_pair(
    tmp_path: Path, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    security.generate_keys(tmp_path, ["coordinator", "client", "laptop"])
    assert exit_status(train_cli.main, ["--local", "2", "--keys", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "missing or unreadable: phone" in err
    assert f"python -m zpipe keys --dir {tmp_path} phone" in err


def test_train_remote_refuses_keys_without_the_client_pair(
    tmp_path: Path, no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    security.generate_keys(tmp_path, ["stage0"])
    argv = ["--coordinator", "tcp://127.0.0.1:5550", "--keys", str(tmp_path)]
    assert exit_status(train_cli.main, argv) == 2
    err = capsys.readouterr().err
    assert "missing or unreadable: client, coordinator" in err


def test_train_local_runs_its_cluster_with_the_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    security.generate_keys(tmp_path, ["coordinator", "client", "laptop", "phone"])
    started: dict[str, Any] = {}

    class RecordingCluster:
        def __init__(self, devices: list[Any], **kwargs: Any) -> None:
            started.update(kwargs, names=[d.name for d in devices])

        def __enter__(self) -> RecordingCluster:
            raise PipelineError("recorded; nothing started")

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(train_cli, "LocalCluster", RecordingCluster)
    assert train_cli.main(["--local", "2", "--keys", str(tmp_path), *TINY]) == 1
    assert started["keys_dir"] == tmp_path and started["names"] == ["laptop", "phone"]
    assert "recorded; nothing started" in capsys.readouterr().err


# -- plan: a hostile cluster file is a ConfigError and exit status 2 ------------------------


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        (
            '{"format": "zpipe-cluster/1", "devices": [{"name": "a", '
            '"profile": {"format": "zpipe-profile/1", "units": [1, 2, 3]}}]}',
            "'units' must be a list of objects",
        ),
        (
            '{"format": "zpipe-cluster/1", "units": [1, 2, 3], "devices": [{"name": "a"}]}',
            "unknown key(s) ['units']",
        ),
        ("[" * 100_000 + "]" * 100_000, "nests too deep"),
        ("[" * 40 + "]" * 40, "nests 40 deep"),
        (
            '{"format": "zpipe-cluster/1", "devices": [{"name": "a", "count": 1000000000}]}',
            "count 1000000000 is above 4096",
        ),
        (
            '{"format": "zpipe-cluster/1", "devices": ['
            + ", ".join(f'{{"name": "d{k}x", "count": 4000}}' for k in range(3))
            + "]}",
            "takes the cluster past 4096 devices",
        ),
        (
            '{"format": "zpipe-cluster/1", "devices": [{"name": "a", "memory_mb": 1e308}]}',
            "memory_mb must be a positive number",
        ),
        ('{"format": "zpipe-cluster/1", "devices": [', "is not valid JSON"),
    ],
)
def test_plan_refuses_a_hostile_cluster_file_with_exit_2(
    cluster: str,
    message: str,
    plan_files: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    profile, _ = plan_files
    path = _write(tmp_path / "hostile.json", cluster)
    assert plan_cli.main(["--profile", str(profile), "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m zpipe plan: --cluster: ") and message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"units": [1, 2, 3]}, "'units' must be a list of objects"),
        ({"units": "abc"}, "'units' must be a list of objects"),
        ({"batch_sizes": [1e400]}, "batch_sizes[0] must be a whole number, got inf"),
        ({"model": 5}, "malformed profile"),
    ],
)
def test_plan_refuses_a_malformed_profile_with_a_message(
    change: dict[str, Any],
    message: str,
    plan_files: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    good, cluster = plan_files
    data = {**json.loads(good.read_text()), **change}
    path = _write(tmp_path / "bad-profile.json", json.dumps(data).replace("Infinity", "1e400"))
    assert plan_cli.main(["--profile", str(path), "--cluster", str(cluster)]) == 1
    assert message in capsys.readouterr().err


def test_keys_command_still_dispatches(tmp_path: Path) -> None:
    assert keys_cli.main(["--dir", str(tmp_path), "client"]) == 0
    assert (tmp_path / "client.key").is_file()


def test_lossy_device_sweep_is_capped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--out", str(tmp_path), "--sweep", "devices", "--sweep-values", "6,1e9"]
    assert exit_status(experiment.main, argv) == 2
    assert "device counts must be positive integers up to 64" in capsys.readouterr().err


# -- train: --check fails beyond its tolerance; the report lists recoveries and groups -------


def _fake_report(state: dict[str, Any], **fields: Any) -> Any:
    from zpipe.client import TrainReport
    from zpipe.models import ModelSpec
    from zpipe.planner import Plan
    from zpipe.planner.plan import StagePlan

    spec = ModelSpec.preset("mlp-small", seed=0)
    plan = Plan(algo="hpp", num_units=4, stages=(StagePlan("a", 0, 2), StagePlan("c", 2, 4)))
    return TrainReport(
        run=1,
        plan=plan,
        model_spec=spec,
        schedule="1f1b",
        num_microbatches=2,
        losses=[1.0, 0.5],
        samples=8,
        elapsed_s=1.0,
        state_dict=state,
        **fields,
    )


@pytest.fixture
def trained_off_by(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """`train --check` where the pipeline's weights differ from one process's by ``gap``."""
    import torch

    def setup(gap: float) -> None:
        expected = {"w": torch.zeros(3), "b": torch.ones(2)}
        trained = {"w": torch.tensor([0.0, gap, 0.0]), "b": torch.ones(2)}
        monkeypatch.setattr(train_cli, "_train", lambda *a: _fake_report(trained))
        monkeypatch.setattr(train_cli, "_train_here", lambda *a: expected)

    return setup


def test_train_check_exits_1_beyond_its_tolerance_and_says_both(
    trained_off_by: Callable[[float], None], capsys: pytest.CaptureFixture[str]
) -> None:
    trained_off_by(0.25)
    assert train_cli.main([*TINY, "--check", "--check-tolerance", "0.1"]) == 1
    captured = capsys.readouterr()
    assert "differ by 2.50e-01, more than the tolerance 1.00e-01" in captured.err
    assert "(tolerance 1.00e-01)" in captured.out


@pytest.mark.parametrize("gpu", [True, False])
def test_a_failed_check_explains_the_cpu_reference_when_local_stages_had_a_gpu(
    trained_off_by: Callable[[float], None],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    gpu: bool,
) -> None:
    import torch

    # local stages pick CUDA with --device auto; the reference trains on the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    trained_off_by(1e-3)
    assert train_cli.main([*TINY, "--check"]) == 1
    err = capsys.readouterr().err
    assert ("the local stages computed on this machine's GPU" in err) is gpu
    assert ("--check-tolerance 5e-3" in err) is gpu


def test_train_check_passes_within_its_tolerance(
    trained_off_by: Callable[[float], None], capsys: pytest.CaptureFixture[str]
) -> None:
    trained_off_by(1e-6)
    assert train_cli.main([*TINY, "--check"]) == 0
    assert "differ by at most 1.00e-06 (tolerance 1.00e-04)" in capsys.readouterr().out


def test_weights_difference_of_a_missing_or_reshaped_tensor_is_infinite() -> None:
    import torch

    expected = {"w": torch.zeros(3)}
    assert train_cli.weights_difference({}, expected) == math.inf
    assert train_cli.weights_difference({"w": torch.zeros(4)}, expected) == math.inf
    assert train_cli.weights_difference({"w": torch.full((3,), 0.5)}, expected) == 0.5
    nan = torch.tensor([0.0, float("nan"), 0.0])
    assert train_cli.weights_difference({"w": nan}, expected) == math.inf


def test_train_report_shows_groups_and_lists_recoveries() -> None:
    from zpipe.planner.training_plan import TrainingPlan, TrainStage

    tplan = TrainingPlan(
        algo="hpp",
        schedule="1f1b",
        num_units=4,
        microbatch_size=4,
        num_microbatches=2,
        stages=(TrainStage(("a", "b"), 0, 2, (3, 1), 2), TrainStage(("c",), 2, 4, (4,), 1)),
    )
    recovery = {
        "dead": "b",
        "reason": "no heartbeat for 5.0 s",
        "replica": 4,
        "replayed": 2,
        "policy": "lightweight",
        "consistency": "exact",
    }
    rebalance = {"at": 6, "plan": {"stages": [{"devices": ["a"], "start": 0, "end": 3}]}}
    report = _fake_report({}, training_plan=tplan, recoveries=[recovery], rebalances=[rebalance])
    table = train_cli.describe_stages(report, ["u0", "u1", "u2", "u3"])
    assert "a (3), b (1)" in table and "u0 .. u1" in table
    assert "c " in table.splitlines()[2]
    changes = "\n".join(train_cli.describe_changes(report))
    assert "recoveries: 1" in changes
    assert "stage 'b' lost (no heartbeat for 5.0 s)" in changes
    assert "after mini-batch 4, 2 replayed" in changes
    assert "after mini-batch 6: a [0, 3)" in changes
    assert train_cli.describe_changes(_fake_report({})) == []


def test_train_advertise_host_needs_a_coordinator(
    no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(train_cli.main, ["--advertise-host", "10.0.0.2"]) == 2
    assert "--advertise-host needs --coordinator" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("main", "argv"),
    [
        (stage_main.main, ["--coordinator", "tcp://no-such-host.invalid:5550", "--name", "x"]),
        (train_cli.main, ["--coordinator", "tcp://no-such-host.invalid:5550"]),
    ],
    ids=["stage", "train"],
)
def test_a_coordinator_host_that_does_not_resolve_is_named_not_waited_for(
    main: Main, argv: list[str], no_training: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_status(main, argv) == 2
    err = capsys.readouterr().err
    assert "the host 'no-such-host.invalid'" in err and "cannot be resolved" in err
    assert "is it running" not in err


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "async-1f1b"])
def test_train_repartition_flags_reach_the_run_on_every_schedule(schedule: str) -> None:
    from zpipe.cli.train import run_kind_settings
    from zpipe.cli.train_args import build_parser

    parser = build_parser()
    plain = run_kind_settings(parser.parse_args(["--local", "2", "--schedule", schedule]))
    assert "repartition" not in plain
    args = parser.parse_args(
        [
            "--local",
            "2",
            "--schedule",
            schedule,
            "--repartition-first",
            "5",
            "--repartition-every",
            "10",
        ]
    )
    assert run_kind_settings(args)["repartition"] == {"first": 5, "every": 10}
