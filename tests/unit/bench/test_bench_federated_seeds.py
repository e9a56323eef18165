"""bench/federated.py's seed selection and held-out summary (no simulation runs)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import pytest

import bench.federated as fed


def test_seeds_parse_as_a_count_a_range_or_a_list() -> None:
    assert fed.parse_seeds("3") == [0, 1, 2]
    assert fed.parse_seeds("10-19") == list(range(10, 20))
    assert fed.parse_seeds("5, 1,10-11,1") == [1, 5, 10, 11]
    assert fed.seed_label([10, 11, 12]) == "10-12"
    assert fed.seed_label([1, 5]) == "1,5"


@pytest.mark.parametrize("text", ["9-3", "a", "1-", "-2"])
def test_bad_seed_text_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        fed.parse_seeds(text)


def _fake_compare(
    seeds: Sequence[int], lam: float, target: float, common: dict[str, Any], data: Any
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    # Eco-FL loses to FedAsync on the tuning seeds (< 10) and wins on the held ones
    acc = {m: [0.5 for _ in seeds] for m in fed.METHODS}
    acc["ecofl"] = [0.6 for _ in seeds]
    acc["fedasync"] = [0.7 if s < 10 else 0.55 for s in seeds]
    tta = {m: [100.0 for _ in seeds] for m in fed.METHODS}
    return acc, tta


def _summary(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str):
    monkeypatch.setattr(fed, "compare_methods", _fake_compare)
    monkeypatch.setattr(fed, "lambda_sweep", lambda *a: {})
    monkeypatch.setattr(fed, "load_digits_dataset", lambda: None)
    assert fed.main(["--lambdas=", *argv]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return next(line for line in lines if line.get("summary"))


def test_held_mode_counts_the_goal_keys_on_the_held_seeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _summary(monkeypatch, capsys, "--held", "--tune-figures")
    assert out["seed_list"] == "10-19" and out["held_seeds"] == "10-19"
    assert out["settings_fixed_on_seeds"] == "0-9"
    assert out["ecofl_wins_fedasync"] == 10 and out["tune_ecofl_wins_fedasync"] == 0
    assert out["ecofl_minus_fedasync_acc"] == pytest.approx(0.05)
    assert out["tune_ecofl_minus_fedasync_acc"] == pytest.approx(-0.1)
    assert out["settings_are_chosen"] is True
    assert out["note"].startswith("goal met")


def test_held_alone_runs_only_the_held_seeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _summary(monkeypatch, capsys, "--held")
    assert out["ecofl_wins_fedasync"] == 10 and "tune_ecofl_wins_fedasync" not in out
    assert out["settings_fixed_on_seeds"] == "0-9"


def test_without_held_the_keys_stay_on_the_given_seeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _summary(monkeypatch, capsys, "--seeds", "0-4", "--alpha", "0.5")
    assert out["seeds"] == 5 and out["ecofl_wins_fedasync"] == 0
    assert "tune_ecofl_wins_fedasync" not in out and out["settings_are_chosen"] is False
    assert out["note"].startswith("goal NOT met")


def test_held_seeds_may_not_overlap_the_tuning_seeds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _summary(monkeypatch, capsys, "--held", "--held-seeds", "5-14")
