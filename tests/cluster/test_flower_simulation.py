"""Eco-FL's ServerApp and zpipe's ClientApp on Flower's simulation engine (Ray starts
worker processes): 300 SuperNodes are profiled and grouped as the pure grouping says,
two homes that go down are dropped out of their groups, the model learns, and every
decision and weight equals an in-process run of the same clock; a smaller run with
latency changes (Algorithm 1's moves, drop-outs and re-admissions) equals fl-sim.

Each run is kept small for two cores: tiny numpy clients, two Ray workers, no
latency ticks in the 300-client run (a tick profiles every client again)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from zpipe.devices import single_threaded_blas
from zpipe.federated.model import MLPShape, accuracy
from zpipe.federated.server import HierarchicalServer, TrainTask, make_server
from zpipe.federated.simulate import (
    SimConfig,
    build_federation,
    clock_config,
    initial_weights,
    run_simulation,
    server_config,
    train_task,
)
from zpipe.federated.virtual_time import Finished, NeedProfiles, NeedResult, VirtualClock
from zpipe.lossy.data import Dataset, load_digits_dataset

pytest.importorskip("flwr.simulation")
pytest.importorskip("ray")

from zpipe.federated.flower_app import FlowerSettings, run_flower_simulation

pytestmark = pytest.mark.timeout(900)


def _reference(config: SimConfig, failing: frozenset[int], dataset: Dataset) -> dict[str, Any]:
    """The same run in this process: the clock, fl-sim's clients, the same failures."""
    with single_threaded_blas():  # as fl-sim and the ClientApp train
        return _reference_run(config, failing, dataset)


def _reference_run(config: SimConfig, failing: frozenset[int], dataset: Dataset) -> dict[str, Any]:
    federation = build_federation(config, dataset)
    shape = MLPShape(dataset.n_features, config.hidden, dataset.n_classes)
    server = make_server(
        federation.profiles(), initial_weights(config, shape), server_config(config)
    )
    clock = VirtualClock(
        server,
        {c: federation.latency(c) for c in range(config.n_clients)},
        clock_config(config),
        evaluate=lambda w: accuracy(w, shape, dataset.x_test, dataset.y_test),
    )
    dispatched: list[tuple[int, int, int]] = []

    def note(tasks: list[TrainTask]) -> None:
        dispatched.extend((t.task_id, t.client_id, t.version) for t in tasks)

    note(clock.take_dispatched())
    while True:
        match clock.advance():
            case Finished():
                break
            case NeedProfiles():
                federation.change_degrees(config.degrees, config.change_prob)
                alive = [c for c in range(config.n_clients) if c not in failing]
                note(clock.on_profiles({c: federation.latency(c) for c in alive}))
            case NeedResult(task=task):
                if task.client_id in failing:
                    note(clock.on_result(None))
                else:
                    shard = federation.shards[task.client_id]
                    trained = train_task(config, shape, shard, task)
                    note(clock.on_result(trained, len(shard.y)))
    return {
        "server": server,
        "dispatch_log": dispatched,
        "curve": {"time_s": clock.log.curve_t, "test_acc": clock.log.curve_acc},
        "stats": server.stats(),
    }


def test_ecofl_on_flower_simulation_with_300_clients_groups_drops_and_learns() -> None:
    dataset = load_digits_dataset()
    config = SimConfig(
        method="ecofl",
        n_clients=300,
        budget_s=45.0,  # 144 tasks dispatched, two evaluations (60 s: 188, for nothing more)
        eval_every_s=30.0,
        change_every_s=1000.0,  # no tick: each would profile all 300 clients again
        local_steps=20,
        lr=0.2,
        seed=0,
    )
    # two homes of the first round go down after the profiling
    federation = build_federation(config, dataset)
    shape = MLPShape(dataset.n_features, config.hidden, dataset.n_classes)
    pure = make_server(federation.profiles(), initial_weights(config, shape), server_config(config))
    assert isinstance(pure, HierarchicalServer)
    pure_groups = [pure.grouping.members_of(g.group_id) for g in pure.grouping.groups]
    first = pure.start()
    failing = frozenset({first[0].client_id, first[-1].client_id})
    ref = _reference(config, failing, dataset)
    server = ref["server"]

    result = run_flower_simulation(FlowerSettings(config, failing_clients=failing))

    assert result["clients_profiled"] == 300
    # the groups are K-means plus eq. 4 with the RT^g thresholds, as the pure grouping says
    assert result["initial_groups"] == pure_groups
    assert len(pure_groups) == 5 and sum(len(m) for m in pure_groups) > 250
    assert result["dispatch_log"][0][1] == first[0].client_id
    # every decision and every aggregation as in-process: tasks, curve, weights
    assert result["dispatch_log"] == ref["dispatch_log"]
    assert result["curve"] == ref["curve"]
    np.testing.assert_allclose(result["weights"], server.global_weights, rtol=0, atol=1e-12)
    assert result["stats"] == ref["stats"]
    # the homes that went down: their task failed, they left their groups, never came back
    assert result["failed_tasks"] == 2
    assert set(result["dropped"]) >= failing
    assert result["stats"]["clients_dropped"] >= 2
    first_task = {t.client_id: t.task_id for t in first}
    for client in failing:
        mine = [t for t in result["dispatch_log"] if t[1] == client]
        assert mine == [(first_task[client], client, 0)]
    # it learns: chance is 0.1
    assert result["curve"]["test_acc"][0] < 0.2
    assert result["final_acc"] > 0.2  # twice chance (0.31 for this seed: it is exact)
    assert result["client_tasks"] > 100


@pytest.mark.parametrize("method", ["ecofl", "fedasync"])
def test_flower_runs_equal_fl_sim_with_latency_changes(method: str) -> None:
    config = SimConfig(
        method=method,
        n_clients=30,
        max_concurrent=10,
        # two latency ticks: Eco-FL moves 17 clients, drops 8 and re-admits 2 (fl-sim,
        # seed 2); 44 and 58 tasks (at 45 s: 69 and 84, for nothing more)
        budget_s=30.0,
        eval_every_s=15.0,
        change_every_s=15.0,
        change_prob=0.5,
        seed=2,
    )
    reference = run_simulation(config, load_digits_dataset())
    result = run_flower_simulation(FlowerSettings(config))
    assert result["curve"] == reference["curve"]
    assert result["stats"] == reference["stats"]
    assert result["client_tasks"] == reference["client_tasks"] > 30
    if method == "ecofl":  # Algorithm 1 acted: clients moved, dropped out, came back
        stats = result["stats"]
        assert stats["clients_moved"] > 0 and stats["clients_dropped"] > 0
