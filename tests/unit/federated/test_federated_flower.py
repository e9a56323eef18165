"""The Flower ``NumPyClient`` adapter, driven in-process through Flower's own client and
FedAvg strategy APIs (the unit lane starts no process; Eco-FL's ServerApp on Flower's
simulation engine, which starts Ray's, is tested in tests/cluster/test_flower_simulation.py)."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.federated.data import make_shards
from zpipe.federated.flower import ShardTrainer, make_flower_client
from zpipe.federated.model import MLPShape, accuracy, init_weights
from zpipe.lossy.data import load_digits_dataset

flwr = pytest.importorskip("flwr")


def test_flower_fedavg_rounds_over_zpipe_clients_learn() -> None:
    from flwr.common import (
        Code,
        FitRes,
        Status,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.server.strategy import FedAvg

    data = load_digits_dataset()
    rng = np.random.default_rng(0)
    pairs = [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (1, 3), (5, 7), (0, 9)]
    shards = make_shards(data, pairs, samples_per_client=60, rng=rng)
    shape = MLPShape(64, 32, 10)
    weights = init_weights(shape, rng)
    clients = [
        make_flower_client(
            ShardTrainer(s, shape, weights, n_classes=10, seed=i), local_steps=20, mu=0.05
        )
        for i, s in enumerate(shards)
    ]
    strategy = FedAvg()
    start_acc = accuracy(weights, shape, data.x_test, data.y_test)
    parameters = ndarrays_to_parameters([weights])
    for server_round in range(1, 9):
        results = []
        for client in clients:
            new, n, metrics = client.fit(parameters_to_ndarrays(parameters), {"local_steps": 20})
            assert sum(metrics[f"label_{k}"] for k in range(10)) == n  # counts only
            fit_res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new), n, metrics)
            results.append((None, fit_res))
        aggregated, _ = strategy.aggregate_fit(server_round, results, [])
        assert aggregated is not None
        parameters = aggregated
    final = parameters_to_ndarrays(parameters)[0]
    final_acc = accuracy(final, shape, data.x_test, data.y_test)
    assert final_acc > 0.3 and final_acc > start_acc + 0.15  # chance is 0.1
    loss, n, metrics = clients[0].evaluate([final], {})
    assert n == 60 and 0.0 <= metrics["accuracy"] <= 1.0 and np.isfinite(loss)
    assert clients[0].to_client() is not None  # usable by Flower's ClientApp
    with pytest.raises(ConfigError):
        clients[0].fit([final], {"local_steps": 0})
    with pytest.raises(ConfigError):
        clients[0].fit([final[:-1]], {})
