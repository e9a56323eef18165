"""A short federated simulation learns, is deterministic for a seed, and the fl-sim
command writes its results and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zpipe._errors import ConfigError
from zpipe.federated.simulate import SimConfig, run_simulation, time_to_accuracy
from zpipe.lossy.data import Dataset, load_digits_dataset

SMALL = {"n_clients": 40, "max_concurrent": 10, "budget_s": 600.0, "eval_every_s": 50.0}


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits_dataset()


@pytest.mark.parametrize("method", ["ecofl", "fedasync"])
def test_a_short_simulation_learns_and_repeats_exactly(digits: Dataset, method: str) -> None:
    config = SimConfig(method=method, partition="niid", seed=3, **SMALL)
    first = run_simulation(config, digits)
    accs = first["curve"]["test_acc"]
    assert accs[0] < 0.25  # the untrained model is near chance (0.1)
    # well above chance (0.1) by the end: the mean of the last four evaluations
    assert sum(accs[-4:]) / 4 > 0.35
    assert first["client_tasks"] > 40
    assert time_to_accuracy(first, 0.35) <= config.budget_s
    again = run_simulation(config, digits)
    assert again["curve"] == first["curve"] and again["stats"] == first["stats"]


def test_latency_changes_regroup_clients_in_the_simulation(digits: Dataset) -> None:
    config = SimConfig(
        method="ecofl", change_every_s=50.0, change_prob=0.3, seed=1, **{**SMALL, "budget_s": 250.0}
    )
    stats = run_simulation(config, digits)["stats"]
    assert stats["clients_moved"] + stats["clients_dropped"] > 0
    frozen = run_simulation(SimConfig(**{**config.__dict__, "method": "ecofl-nodg"}), digits)
    assert frozen["stats"]["clients_moved"] == 0


def test_fl_sim_command_writes_results_and_plots(tmp_path: Path) -> None:
    from zpipe.__main__ import main

    out = tmp_path / "fl"
    code = main(
        [
            "fl-sim",
            "--methods",
            "ecofl",
            "fedavg",
            "--seeds",
            "1",
            "--clients",
            "30",
            "--concurrent",
            "10",
            "--budget-s",
            "150",
            "--lambdas",
            "0,inf",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in results["runs"]} == {"ecofl", "fedavg"}
    assert [r["lam"] for r in results["lambda_sweep"]] == [0.0, "inf"]
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "lambda.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["fl-sim", "--methods", "fedsgd", "--out", str(out)])


def test_the_rlg_data_layout_stays_when_the_run_groups_otherwise(digits: Dataset) -> None:
    from zpipe.federated.simulate import build_federation

    def classes(**kw: int) -> list[tuple[int, ...]]:
        config = SimConfig(partition="rlg-niid", n_clients=60, max_concurrent=10, seed=3, **kw)
        return [shard.classes for shard in build_federation(config, digits).shards]

    five = classes(n_groups=5)
    assert classes(n_groups=3, n_rlg=5) == five  # the same clients, grouped otherwise
    assert classes(n_groups=3) != five  # n_rlg defaults to n_groups: 3 layouts
    assert len({c for pair in five for c in pair}) == 10  # 5 RLGs of 3 classes cover all
    with pytest.raises(ConfigError):
        SimConfig(n_rlg=0)
