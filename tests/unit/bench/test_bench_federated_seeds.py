"""bench/federated.py's seed selection, held-out summary and Flower section (no simulation
runs: the comparison, fl-sim and Flower's engine are replaced by fakes)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
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


COMMONS: list[dict[str, Any]] = []  # what each fake comparison was given


def _fake_compare(
    seeds: Sequence[int],
    lam: float,
    target: float,
    common: dict[str, Any],
    data: Any,
    *,
    evidence: dict[str, list[dict[str, Any]]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    COMMONS.append(common)
    # Eco-FL loses to FedAsync on the tuning seeds (< 10) and wins on the held ones
    acc = {m: [0.5 for _ in seeds] for m in fed.METHODS}
    acc["ecofl"] = [0.6 for _ in seeds]
    acc["fedasync"] = [0.7 if s < 10 else 0.55 for s in seeds]
    tta = {m: [100.0 for _ in seeds] for m in fed.METHODS}
    return acc, tta


def _fake_run(config: Any, *, engine: str, final_acc: float = 0.3) -> dict[str, Any]:
    return {
        "engine": engine,
        "config": config,
        "client_tasks": 7 * config.n_clients,
        "stats": {"global_updates": 11},
        "curve": {"time_s": [0.0, config.budget_s], "test_acc": [0.1, final_acc]},
        "final_acc": final_acc,
        "wall_s": 0.5,
    }


def _fake_flower(settings: Any) -> dict[str, Any]:
    return {
        **_fake_run(settings.sim, engine="flower"),
        "clients_profiled": settings.sim.n_clients,
        "profiling_wall_s": 3.0,
        "initial_groups": [[0], [1], [2]],
        "wall_s": 8.0,
    }


def _summary(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    *argv: str,
    flower: Callable[[Any], dict[str, Any]] = _fake_flower,
    has_flower: bool = True,
):
    monkeypatch.setattr(fed, "compare_methods", _fake_compare)
    # the Flower section's two runs: fakes, so no Ray worker starts in the unit lane
    monkeypatch.setattr(fed, "flower_available", lambda: has_flower)
    monkeypatch.setattr(fed, "run_flower_simulation", flower)
    monkeypatch.setattr(fed, "run_simulation", lambda c, d: _fake_run(c, engine="fl-sim"))
    monkeypatch.setattr(fed, "lambda_sweep", lambda *a: {})
    monkeypatch.setattr(fed, "load_digits_dataset", lambda: None)
    # the pipeline-client and pipeline-memory sections start stage processes: fakes here
    monkeypatch.setattr(
        fed, "pipeline_client_section", lambda args: {"pipeline_client_over_dp_throughput": 2.0}
    )
    monkeypatch.setattr(
        fed, "pipeline_memory_section", lambda args: {"gpipe_over_1f1b_peak_memory": 1.2}
    )
    monkeypatch.setattr(
        fed,
        "pipeline_resched_section",
        lambda args: {"resched_over_static_throughput_after_slowdown": 1.3},
    )
    monkeypatch.setattr(
        fed,
        "pipeline_partition_section",
        lambda args: {"ecofl_over_even_partition_throughput": 1.6},
    )
    # and the netns section makes a network lab (root)
    monkeypatch.setattr(
        fed, "netns_section", lambda args: {"pipeline_client_over_dp_throughput_netns": 9.0}
    )
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


def test_the_flower_section_compares_a_flower_run_with_fl_sim_of_the_same_seed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _summary(monkeypatch, capsys, "--seeds", "1", "--flower-budget-s", "30")
    assert out["flower_sim_clients"] == 300 and out["flower_sim_budget_s"] == 30.0
    assert out["flower_sim_acc"] == 0.3 and out["flsim_acc"] == 0.3
    assert out["flower_sim_groups"] == 3 and out["flower_server_wall_s"] == 8.0
    assert out["flower_equals_flsim_tasks"] is True and out["flower_equals_flsim_curve"] is True
    assert out["flower_sim_wall_s"] >= 0 and out["flsim_wall_s"] == 0.5
    assert out["flower_over_flsim_wall"] == pytest.approx(out["flower_sim_wall_s"] / 0.5, abs=0.1)


def test_the_flower_run_takes_the_clients_flag_and_reports_a_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []

    def flower(settings: Any) -> dict[str, Any]:
        seen.append(settings.sim)
        return {
            **_fake_flower(settings),
            "final_acc": 0.25,
            "curve": {"time_s": [], "test_acc": []},
        }

    out = _summary(monkeypatch, capsys, "--seeds", "1", "--flower-clients", "12", flower=flower)
    (config,) = seen
    assert config.n_clients == 12 and config.method == "ecofl" and config.seed == 0
    assert config.partition == "rlg-niid" and config.budget_s == 60.0
    assert out["flower_sim_clients"] == 12 and out["flower_equals_flsim_curve"] is False
    assert out["flower_equals_flsim_tasks"] is True


def test_skip_flower_leaves_the_section_out_and_a_missing_flower_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _summary(monkeypatch, capsys, "--seeds", "1", "--skip-flower")
    assert not any(k.startswith("flower_") for k in out)
    out = _summary(monkeypatch, capsys, "--seeds", "1", has_flower=False)
    assert "flower_sim_clients" not in out and "not installed" in out["flower_sim_skipped"]


def test_the_held_comparison_takes_latencies_from_the_paper_set_ups_homes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    COMMONS.clear()
    out = _summary(monkeypatch, capsys, "--held", "--tune-figures")
    assert out["latency"] == "pipeline"
    assert out["homes"] == {
        "classes": ["tx2", "nano"],
        "devices": "1-3",
        "mlp_more_hidden": [32, 32],
    }
    # the tuning and the held seeds faced the same conditions
    assert len(COMMONS) == 2 and COMMONS[0] == COMMONS[1]
    assert COMMONS[0]["pipeline_latency"] is True and COMMONS[0]["home_sizes"] == (1, 3)
    COMMONS.clear()
    out = _summary(monkeypatch, capsys, "--held", "--latency", "drawn")
    assert out["latency"] == "drawn" and "homes" not in out
    assert "pipeline_latency" not in COMMONS[0]
    COMMONS.clear()
    out = _summary(monkeypatch, capsys, "--seeds", "2")
    assert out["latency"] == "drawn" and "pipeline_latency" not in COMMONS[0]


class _Grouping:
    def __init__(self) -> None:
        self.groups = [
            type("G", (), {"group_id": 0, "members": {0, 1}})(),
            type("G", (), {"group_id": 1, "members": {2}})(),
        ]
        self.latency = {0: 4.0, 1: 6.0, 2: 30.0}


class _Server:
    def __init__(self, merges: list[tuple[int, float]], grouped: bool) -> None:
        self.merges = merges
        if grouped:
            self.grouping = _Grouping()


def _run(accs: list[float]) -> dict[str, Any]:
    times = [100.0 * i for i in range(len(accs))]
    return {"curve": {"time_s": times, "test_acc": accs}}


def test_the_evidence_says_which_group_the_global_model_took_and_how_much() -> None:
    eco = fed.run_evidence(
        _run([0.1, 0.2, 0.5, 0.4, 0.6]), _Server([(0, 0.4), (0, 0.4), (0, 0.4), (1, 0.2)], True)
    )
    assert eco["merges"] == 4 and eco["mean_weight"] == pytest.approx(0.35)
    assert eco["by_group"][0] == {"merges": 3, "mean_weight": pytest.approx(0.4), "latency_s": 5.0}
    assert eco["by_group"][1]["latency_s"] == 30.0
    flat = fed.run_evidence(_run([0.1, 0.3, 0.3, 0.3, 0.3]), _Server([(-1, 0.1)] * 5, False))
    out = fed.summarize_evidence({"ecofl": [eco], "fedasync": [flat]}, budget_s=400.0)
    # the second half of the budget (t >= 200): 0.5 -> 0.4 -> 0.6 swings 0.15 a step
    assert out["ecofl"]["acc_swing"] == pytest.approx(0.15)
    assert out["ecofl"]["top_group_merge_share"] == 0.75
    assert out["ecofl"]["top_group_mean_weight"] == 0.4 and out["ecofl"]["groups_merging"] == 2
    assert out["fedasync"] == {"global_updates": 5, "mean_merge_weight": 0.1, "acc_swing": 0.0}
