"""``zpipe train --schedule async-1f1b`` takes the flags a synchronous run takes: an lr
schedule, a resume, user code behind --allow-factory; checked before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zpipe.cli.train import _check_args, _settings, checkpoint_steps
from zpipe.cli.train_args import build_parser
from zpipe.models.weights import STEPS_KEY, write_state

ASYNC = ["--local", "2", "--schedule", "async-1f1b"]


def _checked(argv: list[str]) -> dict[str, object]:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return _settings(args, checkpoint_steps(args.resume) if args.resume else 0)


def test_an_async_run_takes_an_lr_schedule_and_a_resume(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt.safetensors"
    write_state({"units.0.w": torch.zeros(1), STEPS_KEY: torch.tensor(6)}, checkpoint)
    settings = _checked([*ASYNC, "--lr-schedule", "cosine", "--steps", "4",
                         "--resume", str(checkpoint)])  # fmt: skip
    assert settings["lr_schedule"] == {"name": "cosine", "warmup_steps": 0, "total_steps": 10}
    assert settings["start_step"] == 6 and settings["resume_optimizer"] is True


def test_an_async_run_takes_user_code_only_with_allow_factory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _checked([*ASYNC, "--loss", "torch.nn.functional:cross_entropy"])
    assert "--allow-factory torch.nn.functional:cross_entropy" in capsys.readouterr().err
    settings = _checked([*ASYNC, "--loss", "torch.nn.functional:cross_entropy",
                         "--allow-factory", "torch.nn.functional:cross_entropy"])  # fmt: skip
    assert settings["loss"] == "torch.nn.functional:cross_entropy"


def test_a_resume_with_live_copies_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from zpipe._errors import ConfigError
    from zpipe.client.options import TrainOptions
    from zpipe.training.objectives import check_train_settings

    checkpoint = tmp_path / "ckpt.safetensors"
    write_state({"units.0.w": torch.zeros(1), STEPS_KEY: torch.tensor(6)}, checkpoint)
    with pytest.raises(SystemExit):
        _checked([*ASYNC, "--live-copies", "--resume", str(checkpoint)])
    assert "count mini-batches from this run's start" in capsys.readouterr().err
    sgd = {"name": "sgd", "lr": 0.1}
    with pytest.raises(ConfigError, match="resume from a checkpoint with live_copies"):
        TrainOptions(schedule="async-1f1b", num_microbatches=1, optimizer=sgd,
                     resume_optimizer=True, start_step=6, live_copies=True)  # fmt: skip
    with pytest.raises(ConfigError, match="resume from a checkpoint with live_copies"):
        check_train_settings(
            {"schedule": "async-1f1b", "num_microbatches": 1, "optimizer": sgd,
             "resume_optimizer": True, "start_step": 6, "async": {"chain_every": 5}},
            2,
        )  # fmt: skip
