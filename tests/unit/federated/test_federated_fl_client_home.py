"""fl-client's --pipeline-home: device classes checked at the flag."""

from __future__ import annotations

import pytest

from zpipe.cli.fl_client import build_parser, main

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
