"""A Flower (``flwr``) client adapter: any local trainer becomes a ``NumPyClient``.

Flower's servers and strategies can then drive zpipe's local training. The
adapter is a thin translation, nothing more:

- ``get_parameters`` / ``fit`` / ``evaluate`` speak lists of numpy arrays;
- ``fit`` trains ``local_steps`` steps (from Flower's fit config, else the
  default) with FedProx's ``mu`` around the received weights, and reports the
  sample count plus Eco-FL's profile in its metrics: ``label_<k>`` counts
  (only counts leave the client, never samples) and ``train_s``.

:class:`ShardTrainer` is the trainer the simulator's clients use (the numpy
MLP on one shard). A trainer backed by a zpipe pipeline (``zpipe.client.fit``
across a client's devices) would implement the same :class:`LocalTrainer`
protocol; that one is not written yet.

Flower is optional (``pip install 'zpipe[flower]'``). This adapter serves
Flower's legacy strategies (``NumPyClient``); Eco-FL's own server on Flower,
with its grouping, runs as a Message API ``ServerApp`` with a ``ClientApp``
(:mod:`zpipe.federated.flower_app`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.federated.data import ClientShard
from zpipe.federated.model import MLPShape, accuracy, local_train, loss_and_gradient

FloatArray = npt.NDArray[np.float64]


class LocalTrainer(Protocol):
    def get_weights(self) -> list[FloatArray]: ...

    def set_weights(self, weights: list[FloatArray]) -> None: ...

    def train(self, *, steps: int, mu: float) -> int:
        """Train from the current weights; the number of local samples (|D_c|)."""
        ...

    def evaluate(self) -> tuple[float, float, int]:
        """(loss, accuracy, samples) on this client's evaluation data."""
        ...

    def label_counts(self) -> tuple[int, ...]: ...


class ShardTrainer:
    """The simulator's client as a :class:`LocalTrainer`: the numpy MLP on one shard."""

    def __init__(
        self,
        shard: ClientShard,
        shape: MLPShape,
        weights: FloatArray,
        *,
        n_classes: int,
        batch_size: int = 10,
        lr: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.shard, self.shape, self.n_classes = shard, shape, n_classes
        self.weights = np.asarray(weights, dtype=np.float64).copy()
        self.batch_size, self.lr = batch_size, lr
        self.rng = np.random.default_rng(seed)

    def get_weights(self) -> list[FloatArray]:
        return [self.weights.copy()]

    def set_weights(self, weights: list[FloatArray]) -> None:
        if len(weights) != 1 or np.asarray(weights[0]).shape != (self.shape.size,):
            raise ConfigError(f"expected one array of {self.shape.size} weights")
        self.weights = np.asarray(weights[0], dtype=np.float64).copy()

    def train(self, *, steps: int, mu: float) -> int:
        self.weights = local_train(
            self.weights,
            self.shape,
            self.shard.x,
            self.shard.y,
            steps=steps,
            batch_size=self.batch_size,
            lr=self.lr,
            mu=mu,
            rng=self.rng,
        )
        return len(self.shard.y)

    def evaluate(self) -> tuple[float, float, int]:
        loss, _ = loss_and_gradient(self.weights, self.shape, self.shard.x, self.shard.y)
        acc = accuracy(self.weights, self.shape, self.shard.x, self.shard.y)
        return loss, acc, len(self.shard.y)

    def label_counts(self) -> tuple[int, ...]:
        return self.shard.label_counts(self.n_classes)


def make_flower_client(trainer: LocalTrainer, *, local_steps: int = 10, mu: float = 0.05) -> Any:
    """A ``flwr.client.NumPyClient`` around ``trainer`` (``.to_client()`` for Flower's apps)."""
    try:
        from flwr.client import NumPyClient
    except ImportError as exc:
        raise ConfigError("the Flower adapter needs flwr: pip install 'zpipe[flower]'") from exc

    class ZpipeNumPyClient(NumPyClient):
        def get_parameters(self, config: dict[str, Any]) -> list[FloatArray]:
            return trainer.get_weights()

        def fit(
            self, parameters: list[FloatArray], config: dict[str, Any]
        ) -> tuple[list[FloatArray], int, dict[str, Any]]:
            steps = int(config.get("local_steps", local_steps))
            prox = float(config.get("mu", mu))
            if steps < 1 or prox < 0:
                raise ConfigError(f"fit config wants local_steps >= 1 and mu >= 0: {config}")
            trainer.set_weights(list(parameters))
            started = time.perf_counter()
            n = trainer.train(steps=steps, mu=prox)
            metrics: dict[str, Any] = {"train_s": time.perf_counter() - started}
            metrics.update({f"label_{k}": c for k, c in enumerate(trainer.label_counts())})
            return trainer.get_weights(), n, metrics

        def evaluate(
            self, parameters: list[FloatArray], config: dict[str, Any]
        ) -> tuple[float, int, dict[str, Any]]:
            trainer.set_weights(list(parameters))
            loss, acc, n = trainer.evaluate()
            return loss, n, {"accuracy": acc}

    return ZpipeNumPyClient()
