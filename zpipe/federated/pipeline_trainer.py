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

A home re-schedules between tasks (Eco-FL section 4.4,
:mod:`zpipe.federated.home_resched`): after each task the stages' forward and
backward times say how fast each device ran; when one departs from its history
on the current plan by more than ``reschedule`` (0.5: 1.5x slower, 2x faster),
the home is planned again at the measured speeds (device order, cuts,
micro-batch count) and the next task trains on the new plan if it is predicted
faster (the first task, which warms the stages up, is not measured).
``reschedule=None`` keeps the first plan. Each look is in
:attr:`PipelineTrainer.reschedules`.

A device that leaves the home (its stage process exits, or the coordinator declares
its stage dead during a task) is planned out: the home is planned again over the
devices left (order, cuts, micro-batches) and the task trains again from its
starting weights on the same mini-batches, so it still trains what one process
does; the look is in :attr:`PipelineTrainer.reschedules` with ``left``. Only when
no device is left does the task fail.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from zpipe._errors import ConfigError, StageFailedError
from zpipe.client import TrainReport
from zpipe.cluster import AsyncLocalCluster, DeviceSpec
from zpipe.federated.fedprox import FACTORY, optimizer_config
from zpipe.federated.home_plan import home_devices, mlp_profile, plan_home
from zpipe.federated.home_resched import DEFAULT_THRESHOLD, decide, reorders, seconds_per_work
from zpipe.federated.model import MLPShape
from zpipe.models.spec import ModelSpec
from zpipe.models.weights import write_state
from zpipe.planner.cluster import ClusterDevice
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.transport.slowdown import SlowdownSchedule

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


def _stage_device(
    device: ClusterDevice, scale: float, loads: Mapping[str, str] | None, threads: int | None
) -> DeviceSpec:
    """A home device's stage: its class's slowness times ``scale``, and a load schedule's
    factors on top of that when one names it."""
    slowdown = scale / device.speed
    text = (loads or {}).get(device.name)
    if text is None:
        return DeviceSpec(device.name, slowdown=slowdown, threads=threads)
    schedule = SlowdownSchedule.parse(text)
    scaled = ",".join(f"{at:g}:{factor * slowdown:g}" for at, factor in schedule.points)
    return DeviceSpec(device.name, slowdown_schedule=scaled, threads=threads)


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
    training profile of the model instead of the analytic one;
    ``microbatch_sizes``: the micro-batch sizes the plan may use), re-scheduled
    between tasks when a device's speed departs by ``reschedule`` (None: never).
    ``load_schedules`` emulates a device whose speed changes (a bench's external
    load): by device name (``"tx20"``), ``"seconds:factor,..."`` multiplying the
    device's emulated slowness from that many seconds after its first compute;
    ``threads``: each stage's torch threads. ``rebalance`` (a share, home only)
    also moves cuts between neighbours during a task (a synchronous run's
    ``rebalance``, at replicas every ``rebalance_every`` mini-batches; the order
    stays until the next task's re-schedule).
    """

    def __init__(
        self,
        stages: int | None = None,
        *,
        home: Sequence[str] | None = None,
        slowdown_scale: float = 1.0,
        profile: ModelProfile | None = None,
        microbatch_sizes: Sequence[int] | None = None,
        reschedule: float | None = DEFAULT_THRESHOLD,
        load_schedules: Mapping[str, str] | None = None,
        threads: int | None = None,
        rebalance: float | None = None,
        rebalance_every: int = 2,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.home = tuple(home) if home is not None else None
        self.profile = profile
        self.microbatch_sizes = tuple(microbatch_sizes) if microbatch_sizes else None
        if reschedule is not None and not reschedule > 0:
            raise ConfigError(f"reschedule must be a share > 0 or None, got {reschedule}")
        self.reschedule = reschedule
        if rebalance is not None and not 0 < rebalance < 1:
            raise ConfigError(f"rebalance must be a share in (0, 1) or None, got {rebalance}")
        if rebalance_every < 1:
            raise ConfigError(f"rebalance_every must be >= 1, got {rebalance_every}")
        self.rebalance, self.rebalance_every = rebalance, rebalance_every
        self.last_plan: TrainingPlan | None = None
        self.last_report: TrainReport | None = None
        # every look after a task: the task, whether and why the home re-scheduled
        self.reschedules: list[dict[str, object]] = []
        self._tasks = 0
        self._planned: tuple[ClusterDevice, ...] = ()  # the devices' speeds as planned now
        self._history: dict[str, list[float]] = {}  # seconds per work, tasks of the plan
        if self.home is not None:
            if stages is not None and stages != len(self.home):
                raise ConfigError(f"stages={stages} but the home has {len(self.home)} devices")
            if not slowdown_scale > 0:
                raise ConfigError(f"slowdown_scale must be > 0, got {slowdown_scale}")
            self._planned = tuple(home_devices(self.home))
            devices = [
                _stage_device(d, slowdown_scale, load_schedules, threads) for d in self._planned
            ]
            unknown = sorted(set(load_schedules or {}) - {d.name for d in self._planned})
            if unknown:
                raise ConfigError(f"load_schedules names no device of the home: {unknown}")
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
            self._plans[key] = plan_home(
                shape,
                self._planned,
                batch_size,
                profile=self.profile,
                microbatch_sizes=self.microbatch_sizes,
            )
        return self._plans[key]

    async def _fit_on_home(
        self,
        spec: ModelSpec,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        shape: MLPShape,
        size: int,
        lr: float,
        mu: float,
    ) -> tuple[TrainingPlan, TrainReport]:
        """The task on the home's plan; a device that left is planned out and the task
        trained again from its start (``spec`` names its starting weights)."""
        # replicas carry the optimizer's state, FedProx's anchor included
        during: dict[str, Any] = (
            {}
            if self.rebalance is None
            else dict(recover=True, replicate_every=self.rebalance_every, rebalance=self.rebalance)
        )
        while True:
            plan = self.plan_for(shape, size)
            gone = [d.name for d in self._planned if self._exited(d.name)]
            if gone:
                self._plan_out(gone, plan, shape, size, "its stage process exited")
                continue
            try:
                report = await self._cluster.fit(
                    spec,
                    batches,
                    optimizer=optimizer_config(lr, mu),
                    num_microbatches=plan.num_microbatches,  # the plan's, as fit requires
                    plan=plan,
                    # the plan's unit costs: a rebalance weighs the tiny last layer as such
                    profile=self.task_profile(shape, plan),
                    progress=False,
                    **during,
                )
            except StageFailedError as exc:
                if exc.stage not in {d.name for d in self._planned} or len(self._planned) < 2:
                    raise
                self._plan_out([exc.stage], plan, shape, size, f"its stage failed: {exc.reason}")
                continue
            return plan, report

    def _exited(self, name: str) -> bool:
        process = self._cluster.processes.get(name)
        return process is not None and process.poll() is not None

    def _plan_out(
        self, names: list[str], plan: TrainingPlan, shape: MLPShape, size: int, why: str
    ) -> None:
        """Devices ``names`` left the home: it is planned again over the others, and
        speeds measured on the old plan start a new history."""
        left = [d for d in self._planned if d.name not in names]
        if not left:
            raise ConfigError(f"every device of the home has left ({', '.join(names)}: {why})")
        self._planned = tuple(left)
        self._plans, self._history = {}, {}
        new = self.plan_for(shape, size)
        self.reschedules.append(
            {
                "task": self._tasks + 1,
                "reason": f"{', '.join(names)} left the home ({why}): planned over the rest",
                "rescheduled": True,
                "left": list(names),
                "devices": new.devices,
                # whether the devices that stayed run in another order than before
                "reordered": [d for d in plan.devices if d not in names] != list(new.devices),
            }
        )

    def task_profile(self, shape: MLPShape, plan: TrainingPlan) -> ModelProfile:
        """The training profile ``plan`` was made from (the given one, else the
        analytic one at the plan's micro-batch size), sent with it."""
        if self.profile is not None and self.profile.has_training:
            return self.profile
        return mlp_profile(shape, [plan.microbatch_size])

    def _look(self, shape: MLPShape, batch_size: int, plan: TrainingPlan) -> None:
        """After a task: Eco-FL's re-scheduling check (:mod:`zpipe.federated.home_resched`)."""
        assert self.reschedule is not None
        assert self.last_report is not None
        if self._tasks == 1:
            # the stages' first task pays torch's first calls: not a device's speed
            reason = "the first task warms the stages up: not measured"
            self.reschedules.append({"task": 1, "reason": reason, "rescheduled": False})
            return
        profile = self.profile or mlp_profile(shape, [plan.microbatch_size])
        # the counters are the last attempt's: a task rebalanced mid-way ran its end there
        ran = self.last_report.training_plan or plan
        current = seconds_per_work(ran, self.last_report.stages, profile)
        history = {d: v for d, v in self._history.items() if d in current}
        found = decide(
            plan,
            self._planned,
            history,
            current,
            shape=shape,
            threshold=self.reschedule,
            profile=self.profile,
            microbatch_sizes=self.microbatch_sizes,
        )
        entry: dict[str, object] = {
            "task": self._tasks,
            "reason": found.reason,
            "rescheduled": found.plan is not None,
            "deviations": dict(found.deviations),
        }
        # the departed devices' speeds as measured are the plan's from now on
        self._planned = found.devices
        if found.plan is not None:
            # another plan: times per work on other layers start a new history
            self._plans = {(shape.dims, batch_size): found.plan}
            self._history = {}
            entry["devices"] = found.plan.devices
            entry["reordered"] = reorders(plan, found.plan)
        else:
            for device, seconds in current.items():
                if device in found.departed:
                    self._history[device] = []  # its new normal (or the rest of a change)
                self._history.setdefault(device, []).append(seconds)
        self.reschedules.append(entry)

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
            plan, report = await self._fit_on_home(spec, batches, shape, size, lr, mu)
            self.last_plan = plan
            self.last_report = report
            self._tasks += 1
            if self.reschedule is not None:
                self._look(shape, size, plan)
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
