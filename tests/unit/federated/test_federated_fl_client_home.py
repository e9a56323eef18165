"""fl-client's --pipeline-home: device classes checked at the flag."""

from __future__ import annotations

import pytest

from zpipe.cli.fl_client import _checked, build_parser, main
from zpipe.federated.home_resched import DEFAULT_THRESHOLD

BASE = ["--server", "tcp://127.0.0.1:5999", "--id", "0"]


def test_the_home_is_a_list_of_known_classes() -> None:
    args = build_parser().parse_args([*BASE, "--pipeline-home", "nano, nx,tx2"])
    assert args.pipeline_home == ("nano", "nx", "tx2")
    assert build_parser().parse_args(BASE).pipeline_home is None
    for bad in ("", "nx,tpu"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*BASE, "--pipeline-home", bad])


def test_a_home_and_a_stage_count_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status = main([*BASE, "--pipeline-home", "nx,tx2", "--pipeline-stages", "2"])
    assert status == 2
    assert "not both" in capsys.readouterr().err


def test_rescheduling_is_on_for_a_home_and_zero_turns_it_off() -> None:
    home = [*BASE, "--pipeline-home", "nx,tx2"]
    assert _checked(build_parser().parse_args(home))[2] == DEFAULT_THRESHOLD
    assert _checked(build_parser().parse_args([*home, "--reschedule", "0.8"]))[2] == 0.8
    assert _checked(build_parser().parse_args([*home, "--reschedule", "0"]))[2] is None


def test_reschedule_without_a_home_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--reschedule", "0.5"]) == 2
    assert "--pipeline-home" in capsys.readouterr().err
