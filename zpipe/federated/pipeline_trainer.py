"""A federated client whose local model trains on a zpipe pipeline (Eco-FL's clients).

``fl-client --pipeline-stages N`` starts a :class:`~zpipe.cluster.AsyncLocalCluster`
of N stage processes (the client's devices, emulated on this machine) and trains
every task there with the synchronous 1F1B pipeline: the task's flat weights
become the ``mlp`` family's units (one Linear a unit), each of the task's
``local_steps`` mini-batches is split into micro-batches, and the trained units
come back as flat weights. FedProx's proximal term lives in the stages'
optimizer (:mod:`zpipe.federated.fedprox`: SGD pulled towards the weights each
stage loaded), so a pipeline client trains what the numpy trainer does, mu included.

With ``home=`` (device classes of :mod:`zpipe.federated.home_plan`, say
``("nx", "tx2", "nano")``) the stages are those devices, emulated with
``--slowdown`` (the class's slowness times ``slowdown_scale``), and every task
trains on Eco-FL's plan for them (:func:`~zpipe.federated.home_plan.plan_home`:
the device order, the eq. 1 partition and the micro-batch count, 1F1B-Sync's
warm-ups). Without it, a fixed partition over 1 or 2 plain stages, as before.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from zpipe._errors import ConfigError
from zpipe.client import TrainReport
from zpipe.cluster import AsyncLocalCluster, DeviceSpec
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.federated.home_plan import home_devices, plan_home
from zpipe.federated.model import MLPShape
from zpipe.models.spec import ModelSpec
from zpipe.models.weights import write_state
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

MLP_UNITS = 2  # the default federated MLP: Linear + ReLU, then Linear


def mlp_state(weights: FloatArray, shape: MLPShape) -> dict[str, torch.Tensor]:
    """Flat weights as the ``mlp`` family's state dict (nn.Linear keeps [out, in])."""
    state = {}
    for i, (w, b) in enumerate(shape.layers(np.asarray(weights, dtype=np.float64))):
        state[f"units.{i}.linear.weight"] = torch.tensor(w.T, dtype=torch.float32)
        state[f"units.{i}.linear.bias"] = torch.tensor(b, dtype=torch.float32)
    return state


def flat_weights(state: dict[str, torch.Tensor], shape: MLPShape) -> FloatArray:
    parts = []
    for i in range(shape.num_layers):
        parts.append(state[f"units.{i}.linear.weight"].detach().double().numpy().T.ravel())
        parts.append(state[f"units.{i}.linear.bias"].detach().double().numpy())
    flat = np.concatenate(parts)
    if flat.shape != (shape.size,):
        raise ConfigError(f"the pipeline returned {flat.size} weights, expected {shape.size}")
    return flat


def fixed_partition(stages: int, units: int) -> list[list[int]]:
    """The unplanned split: one stage holds everything, two put the last layer apart."""
    if stages == 1:
        return [[0, units]]
    return [[0, units - 1], [units - 1, units]]


class PipelineTrainer:
    """Local training on a client's pipeline stages; use ``async with``.

    ``PipelineTrainer(stages)``: 1 or 2 plain stages and a fixed partition.
    ``PipelineTrainer(home=("nx", "tx2", "nano"))``: a stage per device of the
    home, each task trained on Eco-FL's plan for them (``profile``: a measured
    training profile of the model instead of the analytic one).
    """

    def __init__(
        self,
        stages: int | None = None,
        *,
        home: Sequence[str] | None = None,
        slowdown_scale: float = 1.0,
        profile: ModelProfile | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.home = tuple(home) if home is not None else None
        self.profile = profile
        self.last_plan: TrainingPlan | None = None
        self.last_report: TrainReport | None = None
        if self.home is not None:
            if stages is not None and stages != len(self.home):
                raise ConfigError(f"stages={stages} but the home has {len(self.home)} devices")
            if not slowdown_scale > 0:
                raise ConfigError(f"slowdown_scale must be > 0, got {slowdown_scale}")
            devices = [
                DeviceSpec(d.name, slowdown=slowdown_scale / d.speed)
                for d in home_devices(self.home)
            ]
            self.stages = len(devices)
        else:
            if stages is None or not 1 <= stages <= MLP_UNITS:
                raise ConfigError(
                    f"--pipeline-stages must be 1..{MLP_UNITS} (the MLP has 2 layers)"
                )
            devices = [DeviceSpec(f"stage{i}") for i in range(stages)]
            self.stages = stages
        self._cluster = AsyncLocalCluster(
            devices,
            heartbeat_interval_s=0.5,
            measure_links=False,
            allow_factories=(FACTORY,),
            start_timeout_s=start_timeout_s,
        )
        self._workdir = tempfile.TemporaryDirectory(prefix="zpipe-fl-")
        self._plans: dict[tuple[tuple[int, ...], int], TrainingPlan] = {}

    async def __aenter__(self) -> PipelineTrainer:
        await self._cluster.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._cluster.__aexit__(*exc)
        self._workdir.cleanup()

    def plan_for(self, shape: MLPShape, batch_size: int) -> TrainingPlan:
        """Eco-FL's plan of ``shape`` over the home for mini-batches of ``batch_size``
        (planned once per shape and size)."""
        if self.home is None:
            raise ConfigError("only a trainer with a home (home=...) plans its pipeline")
        key = (shape.dims, batch_size)
        if key not in self._plans:
            devices = home_devices(self.home)
            self._plans[key] = plan_home(shape, devices, batch_size, profile=self.profile)
        return self._plans[key]

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
        spec = ModelSpec("mlp", {"dims": list(shape.dims), "activation": "relu"}, weights=str(path))
        batches = []
        for _ in range(steps):
            idx = rng.choice(len(y), size=min(batch_size, len(y)), replace=False)
            batches.append(
                (torch.tensor(x[idx], dtype=torch.float32), torch.tensor(y[idx], dtype=torch.int64))
            )
        size = min(batch_size, len(y))
        if self.home is not None:
            plan = self.plan_for(shape, size)
            report = await self._cluster.fit(
                spec,
                batches,
                optimizer=optimizer_config(lr, mu),
                num_microbatches=plan.num_microbatches,  # the plan's, as fit requires
                plan=plan,
                progress=False,
            )
            self.last_plan = plan
        else:
            report = await self._cluster.fit(
                spec,
                batches,
                optimizer=optimizer_config(lr, mu),
                num_microbatches=2 if size % 2 == 0 else 1,
                partition=fixed_partition(self.stages, shape.num_layers),
                progress=False,
            )
        self.last_report = report
        return flat_weights(dict(report.state_dict), shape)
