"""The federated servers driven by hand: selection bound, aggregation, staleness,
failures, bad updates, regrouping and re-admission through the server."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError, ProtocolError
from zpipe.federated.aggregation import staleness_factor
from zpipe.federated.grouping import ClientProfile, GroupingPolicy
from zpipe.federated.server import (
    METHODS,
    ClientUpdate,
    FederatedServer,
    HierarchicalServer,
    ServerConfig,
    TrainTask,
    make_server,
)


def _profiles(latencies: list[float], samples: list[int] | None = None) -> list[ClientProfile]:
    rng = np.random.default_rng(0)
    out = []
    for i, latency in enumerate(latencies):
        counts = [0] * 10
        a, b = rng.choice(10, size=2, replace=False)
        n = samples[i] if samples else 20
        counts[a], counts[b] = n // 2, n - n // 2
        out.append(ClientProfile(i, latency, tuple(counts)))
    return out


def _update(task: TrainTask, weights: np.ndarray, n: int = 20) -> ClientUpdate:
    return ClientUpdate(task.task_id, task.client_id, weights, n)


@pytest.mark.parametrize("method", METHODS)
def test_at_most_k_clients_train_and_none_holds_two_tasks(method: str) -> None:
    rng = np.random.default_rng(1)
    latencies = [float(x) for x in rng.choice([1.0, 3.0, 6.0, 9.0, 12.0], 60) + rng.random(60)]
    profiles = _profiles(latencies)
    config = ServerConfig(method=method, max_concurrent=10, grouping=GroupingPolicy(seed=0))
    server = make_server(profiles, np.zeros(4), config)
    outstanding = {t.task_id: t for t in server.start()}
    seen_clients: set[int] = set()
    for step in range(400):
        assert 0 < len(outstanding) <= 10
        holders = [t.client_id for t in outstanding.values()]
        assert len(holders) == len(set(holders))
        seen_clients.update(holders)
        task = outstanding.pop(sorted(outstanding)[int(rng.integers(len(outstanding)))])
        new = server.on_update(_update(task, np.full(4, float(step))))
        if step % 50 == 0:  # latency changes now and then (regroup for Eco-FL)
            client = int(rng.integers(60))
            new += server.observe_latency(client, float(rng.choice([1.0, 6.0, 12.0, 40.0])))
        outstanding.update({t.task_id: t for t in new})
    assert server.version > 0
    assert len(seen_clients) > 20  # selection spreads over the federation


def test_fedavg_round_is_the_sample_weighted_average() -> None:
    profiles = _profiles([1.0, 2.0, 3.0], samples=[10, 30, 60])
    server = make_server(profiles, np.zeros(2), ServerConfig(method="fedavg", max_concurrent=3))
    tasks = server.start()
    assert sorted(t.client_id for t in tasks) == [0, 1, 2]
    values = {0: np.array([1.0, 0.0]), 1: np.array([0.0, 1.0]), 2: np.array([2.0, 2.0])}
    n = {0: 10, 1: 30, 2: 60}
    new: list[TrainTask] = []
    for task in tasks:
        assert server.version == 0
        new = server.on_update(_update(task, values[task.client_id], n[task.client_id]))
    expected = (10 * values[0] + 30 * values[1] + 60 * values[2]) / 100
    assert server.version == 1 and server.global_weights == pytest.approx(expected)
    assert len(new) == 3 and all(t.weights == pytest.approx(expected) for t in new)


def test_fedasync_mixes_each_update_with_its_staleness() -> None:
    config = ServerConfig(method="fedasync", max_concurrent=2, alpha=0.6, staleness_a=0.5)
    server = make_server(_profiles([1.0, 2.0, 3.0]), np.zeros(3), config)
    first, second = server.start()
    server.on_update(_update(first, np.ones(3)))
    after_first = 0.6 * np.ones(3)  # staleness 0: alpha itself
    assert server.global_weights == pytest.approx(after_first)
    server.on_update(_update(second, np.full(3, 5.0)))
    alpha_t = 0.6 * staleness_factor(1, a=0.5)  # it started from version 0, now 1
    assert server.global_weights == pytest.approx((1 - alpha_t) * after_first + alpha_t * 5.0)
    assert server.version == 2


def _one_group_server(**overrides: object) -> HierarchicalServer:
    config = ServerConfig(
        method="ecofl",
        max_concurrent=2,
        alpha=0.5,
        grouping=GroupingPolicy(n_groups=1, seed=0),
        **overrides,  # type: ignore[arg-type]
    )
    server = make_server(_profiles([1.0, 1.1], samples=[10, 30]), np.zeros(2), config)
    assert isinstance(server, HierarchicalServer)
    return server


def test_eco_group_round_averages_by_samples_then_mixes_asynchronously() -> None:
    server = _one_group_server()
    tasks = server.start()
    assert sorted(t.client_id for t in tasks) == [0, 1]
    by_client = {t.client_id: t for t in tasks}
    assert server.on_update(_update(by_client[0], np.array([4.0, 0.0]), 10)) == []
    new = server.on_update(_update(by_client[1], np.array([0.0, 4.0]), 30))
    group_model = np.array([1.0, 3.0])  # (10 * [4, 0] + 30 * [0, 4]) / 40
    assert server.global_weights == pytest.approx(0.5 * group_model)  # staleness 0
    assert server.version == 1 and len(new) == 2


def test_group_models_mix_with_the_inter_group_alpha_when_one_is_set() -> None:
    server = _one_group_server(group_alpha=0.9)  # FedAsync's alpha stays 0.5
    for task in server.start():
        server.on_update(_update(task, np.full(2, 4.0), 10 if task.client_id == 0 else 30))
    assert server.global_weights == pytest.approx(0.9 * np.full(2, 4.0))  # staleness 0
    flat = make_server(
        _profiles([1.0]),
        np.zeros(1),
        ServerConfig(method="fedasync", max_concurrent=1, alpha=0.5, group_alpha=0.9),
    )
    (task,) = flat.start()
    flat.on_update(_update(task, np.full(1, 4.0)))
    assert flat.global_weights == pytest.approx([2.0])  # FedAsync mixes with alpha


def test_intra_group_syncs_restart_from_the_group_model() -> None:
    server = _one_group_server(intra_syncs=2)
    tasks = server.start()
    new: list[TrainTask] = []
    for task in tasks:
        n = 10 if task.client_id == 0 else 30
        new = server.on_update(_update(task, np.full(2, 2.0 * (task.client_id + 1)), n))
    group_model = (10 * np.full(2, 2.0) + 30 * np.full(2, 4.0)) / 40
    assert server.version == 0  # not merged yet: one more sync in this round
    assert len(new) == 2 and all(t.weights == pytest.approx(group_model) for t in new)


def test_a_failed_client_leaves_the_round_which_completes_without_it() -> None:
    server = _one_group_server()
    tasks = server.start()
    by_client = {t.client_id: t for t in tasks}
    assert server.on_task_failed(by_client[0].task_id) == []
    new = server.on_update(_update(by_client[1], np.array([2.0, 2.0]), 30))
    assert server.global_weights == pytest.approx([1.0, 1.0]) and len(new) == 2
    assert server.stats()["failed_tasks"] == 1
    with pytest.raises(ProtocolError):
        server.on_task_failed(by_client[0].task_id)  # already closed


def test_bad_updates_are_refused_and_the_task_stays_outstanding() -> None:
    server = _one_group_server()
    task = server.start()[0]
    for bad in (
        ClientUpdate(task.task_id, task.client_id, np.zeros(3), 10),  # wrong shape
        ClientUpdate(task.task_id, task.client_id, np.array([np.nan, 0.0]), 10),
        ClientUpdate(task.task_id, task.client_id, np.zeros(2), 0),
        ClientUpdate(task.task_id, 1 - task.client_id, np.zeros(2), 10),  # not its task
        ClientUpdate(999, task.client_id, np.zeros(2), 10),
    ):
        with pytest.raises(ProtocolError):
            server.on_update(bad)
    assert server.outstanding() == 2
    server.on_update(_update(task, np.zeros(2)))
    assert server.outstanding() == 1


def test_regrouping_and_readmission_through_the_server() -> None:
    latencies = [1.0, 1.1, 1.2, 1.05, 10.0, 10.1, 10.2, 10.05]
    config = ServerConfig(
        method="ecofl", max_concurrent=4, grouping=GroupingPolicy(n_groups=2, lam=1.0, seed=0)
    )
    server = make_server(_profiles(latencies), np.zeros(2), config)
    assert isinstance(server, HierarchicalServer)
    server.start()
    grouping = server.grouping
    assert grouping.members_of(0) == [0, 1, 2, 3] and grouping.members_of(1) == [4, 5, 6, 7]
    server.observe_latency(0, 10.1)
    assert 0 in grouping.groups[1].members
    server.observe_latency(1, 500.0)
    assert 1 in grouping.dropped
    server.observe_latency(1, 1.1)
    assert 1 in grouping.groups[0].members
    stats = server.stats()
    assert (stats["clients_moved"], stats["clients_dropped"], stats["clients_readmitted"]) == (
        1,
        1,
        1,
    )


def test_an_idle_group_starts_when_a_client_is_readmitted() -> None:
    config = ServerConfig(
        method="ecofl", max_concurrent=2, grouping=GroupingPolicy(n_groups=2, lam=1.0, seed=0)
    )
    server = make_server(_profiles([1.0, 10.0]), np.zeros(2), config)
    assert isinstance(server, HierarchicalServer)
    tasks = {t.client_id: t for t in server.start()}
    assert set(tasks) == {0, 1}
    server.on_update(_update(tasks[0], np.zeros(2)))  # client 0's group restarts at once
    assert server.observe_latency(1, 300.0) == []  # dropped: group 1 will have nobody
    server.on_update(_update(tasks[1], np.zeros(2)))
    assert 1 in server.grouping.dropped and server.outstanding() == 1
    new = server.observe_latency(1, 10.0)  # back in range: its group starts a round
    assert [t.client_id for t in new] == [1]


def test_configuration_errors_are_clear() -> None:
    with pytest.raises(ConfigError):
        ServerConfig(method="fedsgd")
    with pytest.raises(ConfigError):
        ServerConfig(alpha=1.5)
    with pytest.raises(ConfigError):
        ServerConfig(group_alpha=0.0)
    with pytest.raises(ConfigError):  # 5 groups cannot share 3 concurrent slots
        make_server(
            _profiles([float(i) for i in range(20)]),
            np.zeros(2),
            ServerConfig(max_concurrent=3, grouping=GroupingPolicy(n_groups=5)),
        )
    assert isinstance(
        make_server(_profiles([1.0]), np.zeros(1), ServerConfig("fedavg")), FederatedServer
    )
