"""A federated client whose local model trains on a zpipe pipeline (Eco-FL's clients).

``fl-client --pipeline-stages N`` starts a :class:`~zpipe.cluster.AsyncLocalCluster`
of N stage processes (the client's devices, emulated on this machine) and trains
every task there with the synchronous 1F1B pipeline: the task's flat weights
become the ``mlp`` family's units (one Linear a unit), each of the task's
``local_steps`` mini-batches is split into micro-batches, and the trained units
come back as flat weights. FedProx's proximal term lives in the stages'
optimizer (:mod:`zpipe.federated.fedprox`: SGD pulled towards the weights each
stage loaded), so a pipeline client trains what the numpy trainer does, mu included.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from zpipe._errors import ConfigError
from zpipe.cluster import AsyncLocalCluster
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.federated.model import MLPShape
from zpipe.models.spec import ModelSpec
from zpipe.models.weights import write_state

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MLP_UNITS = 2  # the federated MLP: Linear + ReLU, then Linear


def mlp_state(weights: FloatArray, shape: MLPShape) -> dict[str, torch.Tensor]:
    """Flat weights as the ``mlp`` family's state dict (nn.Linear keeps [out, in])."""
    w1, b1, w2, b2 = shape.unpack(np.asarray(weights, dtype=np.float64))
    return {
        "units.0.linear.weight": torch.tensor(w1.T, dtype=torch.float32),
        "units.0.linear.bias": torch.tensor(b1, dtype=torch.float32),
        "units.1.linear.weight": torch.tensor(w2.T, dtype=torch.float32),
        "units.1.linear.bias": torch.tensor(b2, dtype=torch.float32),
    }


def flat_weights(state: dict[str, torch.Tensor], shape: MLPShape) -> FloatArray:
    parts = [
        state["units.0.linear.weight"].detach().double().numpy().T.ravel(),
        state["units.0.linear.bias"].detach().double().numpy(),
        state["units.1.linear.weight"].detach().double().numpy().T.ravel(),
        state["units.1.linear.bias"].detach().double().numpy(),
    ]
    flat = np.concatenate(parts)
    if flat.shape != (shape.size,):
        raise ConfigError(f"the pipeline returned {flat.size} weights, expected {shape.size}")
    return flat


class PipelineTrainer:
    """Local training on ``stages`` pipeline stages; use ``async with``."""

    def __init__(self, stages: int) -> None:
        if not 1 <= stages <= MLP_UNITS:
            raise ConfigError(f"--pipeline-stages must be 1..{MLP_UNITS} (the MLP has 2 layers)")
        self.stages = stages
        self._cluster = AsyncLocalCluster(
            stages, heartbeat_interval_s=0.5, measure_links=False, allow_factories=(FACTORY,)
        )
        self._workdir = tempfile.TemporaryDirectory(prefix="zpipe-fl-")

    async def __aenter__(self) -> PipelineTrainer:
        await self._cluster.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._cluster.__aexit__(*exc)
        self._workdir.cleanup()

    async def train(
        self,
        weights: FloatArray,
        shape: MLPShape,
        x: FloatArray,
        y: IntArray,
        *,
        steps: int,
        batch_size: int,
        lr: float,
        mu: float = 0.0,
        rng: np.random.Generator,
    ) -> FloatArray:
        path = Path(self._workdir.name) / "task.safetensors"
        write_state(mlp_state(weights, shape), path)
        spec = ModelSpec(
            "mlp",
            {"dims": [shape.n_in, shape.n_hidden, shape.n_out], "activation": "relu"},
            weights=str(path),
        )
        batches = []
        for _ in range(steps):
            idx = rng.choice(len(y), size=min(batch_size, len(y)), replace=False)
            batches.append(
                (torch.tensor(x[idx], dtype=torch.float32), torch.tensor(y[idx], dtype=torch.int64))
            )
        size = min(batch_size, len(y))
        partition = [[0, 2]] if self.stages == 1 else [[0, 1], [1, 2]]
        report = await self._cluster.fit(
            spec,
            batches,
            optimizer=optimizer_config(lr, mu),
            num_microbatches=2 if size % 2 == 0 else 1,
            partition=partition,
            progress=False,
        )
        return flat_weights(dict(report.state_dict), shape)
