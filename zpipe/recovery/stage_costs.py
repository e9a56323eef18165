"""What one stage of a re-planned pipeline costs, under the planners' own cost models.

Lightweight re-planning only moves the cuts between surviving stages, but where
a cut lands decides which device's link carries which activation: a cut after
a unit with a 4.8 MB output on a 50 Mbit/s sender costs 0.8 s a micro-batch
however fast the devices compute. So a re-planner asks these functions what
new stage ``j`` costs on units ``[start, end)``, its compute and the send of
its cut's activation to the next stage, exactly as the planners cost them:

- inference: :mod:`zpipe.planner.cost` (PipeEdge, eq. 1-2): the period
  ``max(T_comp, T_comm to the next device, or of the result to the client)``;
- training: :mod:`zpipe.planner.training_cost` (Asteroid): the stage's
  forward + backward on its group's shares, with its all-reduce spread over
  the round's micro-batches, or the boundary's activation forward and
  gradient back, whichever is slower (Eco-FL's eq. 1, as the straight
  planner minimises it).

A stage that does not fit its devices' memory costs ``inf`` (``memory=True``).
:func:`predict` then fills a re-planned plan's ``predicted`` as the planners
fill theirs, so a recovered plan reports the same numbers a planned one does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from zpipe._errors import ConfigError
from zpipe.planner.cluster import CLIENT, ClusterDevice, ClusterSpec
from zpipe.planner.cost import device_unit_times, predict_plan
from zpipe.planner.memory import profile_need_matrix
from zpipe.planner.plan import Plan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import TrainingPlan

# (new stage index, first unit, end unit) -> seconds per micro-batch; inf: does not fit
StageCost = Callable[[int, int, int], float]


@dataclass(frozen=True)
class CostModel:
    """What a re-planner needs to cost links as the planners do: the model profile, the
    cluster (devices, memory, links), the batch size of an inference run (a training
    plan carries its micro-batch size) and the optimizer (training memory)."""

    profile: ModelProfile
    cluster: ClusterSpec
    batch_size: int | None = None
    optimizer: str = "sgd"


@dataclass(frozen=True)
class TrainShape:
    """A surviving training stage's devices, their shares of a micro-batch and its K_p:
    what lightweight re-planning keeps while it moves the stage's cuts."""

    devices: tuple[str, ...]
    shares: tuple[int, ...]
    warmup: int


def with_speeds(cluster: ClusterSpec, speeds: Mapping[str, float] | None) -> ClusterSpec:
    """``cluster`` with each named device's compute set to ``speeds`` (relative to the
    model profile; its own profile dropped): measured speeds replace what was profiled,
    links and memory stay."""
    if not speeds:
        return cluster
    devices = tuple(
        replace(d, speed=float(speeds[d.name]), profile=None) if d.name in speeds else d
        for d in cluster.devices
    )
    return ClusterSpec(devices=devices, links=cluster.links, client=cluster.client)


def inference_stage_cost(
    profile: ModelProfile,
    cluster: ClusterSpec,
    devices: Sequence[str],
    batch_size: int,
    *,
    memory: bool = True,
) -> StageCost:
    """The period of new stage ``j`` on ``devices[j]``, as :func:`predict_plan` computes it."""
    out = profile.output_bytes(batch_size)
    need = profile_need_matrix(profile, batch_size)  # the one memory model
    members = [cluster.device(n) for n in devices]
    time_prefix = [_prefix(device_unit_times(profile, d, batch_size)) for d in members]
    receivers = [*devices[1:], CLIENT]

    def cost(j: int, start: int, end: int) -> float:
        cap = members[j].memory_bytes
        if memory and cap is not None and need[start, end] > cap:
            return math.inf
        compute = time_prefix[j][end] - time_prefix[j][start]
        send = cluster.comm_time_s(devices[j], receivers[j], out[end - 1])
        return max(compute, send)

    return cost


def training_stage_cost(
    costs: TrainingCosts,
    shapes: Sequence[TrainShape],
    num_microbatches: int,
    *,
    memory: bool = True,
) -> StageCost:
    """The slower of new stage ``j``'s step (forward + backward on its shares, plus its
    all-reduce over the ``num_microbatches`` of a round) and its outgoing transfer."""
    groups: list[list[ClusterDevice]] = [
        [costs.cluster.device(d) for d in s.devices] for s in shapes
    ]

    def cost(j: int, start: int, end: int) -> float:
        shape, group = shapes[j], groups[j]
        pairs = list(zip(group, shape.shares, strict=True))
        if memory:
            for device, share in pairs:
                need = costs.memory_bytes(start, end, share, shape.warmup)
                if device.memory_bytes is not None and need > device.memory_bytes:
                    return math.inf
        forward = max(costs.forward_s(d, start, end, y) for d, y in pairs)
        backward = max(costs.backward_s(d, start, end, y) for d, y in pairs)
        allreduce = costs.allreduce_s(shape.devices, start, end)
        step = forward + backward + allreduce / num_microbatches
        if j + 1 == len(shapes):
            return step
        return max(step, sum(costs.transfer_s(shape.devices, shapes[j + 1].devices, end)))

    return cost


def training_costs(model: CostModel, plan: TrainingPlan) -> TrainingCosts:
    """The training cost model of ``model`` at ``plan``'s micro-batch size."""
    return TrainingCosts(
        model.profile,
        model.cluster,
        microbatch_size=plan.microbatch_size,
        optimizer=model.optimizer,
    )


def inference_batch_size(model: CostModel) -> int:
    if model.batch_size is None:
        raise ConfigError("costing an inference plan needs the batch size")
    return model.batch_size


def predict(plan: Plan | TrainingPlan, model: CostModel) -> dict[str, float]:
    """``plan.predicted`` as the planners fill it: :func:`predict_plan` for inference,
    :func:`predict_training` for training."""
    if isinstance(plan, TrainingPlan):
        return predict_training(plan, training_costs(model, plan))
    return predict_plan(plan, model.profile, model.cluster, inference_batch_size(model))


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out
