"""A pipeline client's plan: Eco-FL's partition of the client's MLP over its home's devices.

Eco-FL (ICPP '22, section 4) trains a client's model as a synchronous 1F1B
pipeline over the devices of one home, partitioned by eq. 1 with its search over
device orders and micro-batch sizes (section 4.3). This module plans that for a
federated client, purely (no processes): :func:`plan_home` is what a
:class:`~zpipe.federated.pipeline_trainer.PipelineTrainer` trains on, and
:func:`home_period_s` is the latency ``fl-sim --pipeline-latency`` gives a client.

The model's profile is analytic (:func:`mlp_profile`): a Linear of ``a -> b``
costs ``a * b`` multiply-accumulates a sample forward and twice that backward
(the gradients of its input and of its weights), at :data:`REFERENCE_S_PER_MAC`
on the reference device; a device class's ``speed`` scales that. Measured
profiles (``python -m zpipe profile --train``) can be given instead.

Device classes (:data:`DEVICE_CLASSES`) are the Jetson-like devices the rest of
zpipe's benches emulate (``bench/_training_common.py``): Xavier NX as the
reference, TX2 1.5x and Nano 3x slower (Asteroid's and Eco-FL's testbeds, roughly),
with their boards' memory (8, 8 and 4 GB). Links inside a home are left
unlimited: the federated MLP's activations are a few hundred bytes a micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise

from zpipe._errors import ConfigError
from zpipe.federated.model import MLPShape
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.profile import ModelProfile, UnitProfile
from zpipe.planner.straight import search_microbatch_and_order
from zpipe.planner.training_plan import TrainingPlan

FLOAT_BYTES = 4
# a nominal reference device of 1 G multiply-accumulates a second; fl-sim uses only
# the ratio of two homes' periods, so the figure cancels there
REFERENCE_S_PER_MAC = 1e-9
MIB = 1 << 20


@dataclass(frozen=True)
class DeviceClass:
    """A kind of device a home may hold: its speed against the reference and its memory."""

    name: str
    speed: float
    memory_mb: int

    def device(self, index: int) -> ClusterDevice:
        return ClusterDevice(f"{self.name}{index}", self.memory_mb * MIB, self.speed)


DEVICE_CLASSES: tuple[DeviceClass, ...] = (
    DeviceClass("nx", 1.0, 8192),
    DeviceClass("tx2", 1.0 / 1.5, 8192),
    DeviceClass("nano", 1.0 / 3.0, 4096),
)
CLASSES_BY_NAME = {c.name: c for c in DEVICE_CLASSES}


def home_devices(classes: Sequence[str]) -> list[ClusterDevice]:
    """A home of the named classes, as the planner's devices (``nx0``, ``tx20``, ...)."""
    seen: dict[str, int] = {}
    devices = []
    for name in classes:
        if name not in CLASSES_BY_NAME:
            raise ConfigError(f"unknown device class {name!r}; known: {sorted(CLASSES_BY_NAME)}")
        devices.append(CLASSES_BY_NAME[name].device(seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return devices


def mlp_profile(
    shape: MLPShape, batch_sizes: Sequence[int], *, s_per_mac: float = REFERENCE_S_PER_MAC
) -> ModelProfile:
    """A training profile of ``shape`` (one unit a Linear) at ``batch_sizes``, from its
    multiply-accumulates: forward ``a * b`` a sample, backward twice that."""
    sizes = tuple(sorted(set(batch_sizes)))
    units = []
    for i, (a, b) in enumerate(pairwise(shape.dims)):
        forward = tuple(a * b * n * s_per_mac for n in sizes)
        units.append(
            UnitProfile(
                f"fc{i}",
                FLOAT_BYTES * (a * b + b),
                forward,
                tuple(FLOAT_BYTES * b * n for n in sizes),
                tuple(FLOAT_BYTES * (a + b) * n for n in sizes),
                tuple(2 * t for t in forward),
                # the unit's input (for its weights' gradient) and its output (ReLU's mask)
                tuple(FLOAT_BYTES * (a + b) * n for n in sizes),
            )
        )
    return ModelProfile(
        batch_sizes=sizes,
        units=tuple(units),
        input_bytes=tuple(FLOAT_BYTES * shape.n_in * n for n in sizes),
        model={"family": "mlp", "config": {"dims": list(shape.dims), "activation": "relu"}},
        device={"name": "reference", "s_per_mac": s_per_mac},
    )


def plan_home(
    shape: MLPShape,
    devices: Sequence[ClusterDevice],
    batch_size: int,
    *,
    profile: ModelProfile | None = None,
    microbatch_sizes: Sequence[int] | None = None,
) -> TrainingPlan:
    """Eco-FL's 1F1B-Sync plan of ``shape`` over ``devices`` for mini-batches of
    ``batch_size``: for each micro-batch size that divides the mini-batch (so
    ``M = batch_size / B``), Eco-FL's device-order search and eq. 1 partition
    (:func:`~zpipe.planner.straight.search_microbatch_and_order`); of those, the
    shortest predicted round among the plans free of data-dependency bubbles
    (every stage holds the forwards eq. 3 asks for), else the shortest of all.

    The search keeps the mini-batch fixed (what a federated task trains on) and
    lets the micro-batch count follow, where the planner's own search keeps the
    count fixed; the order search and the partition are the planner's.
    ``microbatch_sizes`` narrows the sizes tried (say, none so small that a
    real device's per-operation overhead outweighs its compute, which the
    analytic profile does not model).
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if not devices:
        raise ConfigError("a home needs at least one device")
    sizes = [b for b in range(batch_size, 0, -1) if batch_size % b == 0]
    if microbatch_sizes is not None:
        sizes = [b for b in sizes if b in set(microbatch_sizes)]
        if not sizes:
            raise ConfigError(
                f"none of the micro-batch sizes {sorted(microbatch_sizes)} divides {batch_size}"
            )
    profile = profile if profile is not None else mlp_profile(shape, sizes)
    if profile.num_units != shape.num_layers:
        raise ConfigError(
            f"the profile has {profile.num_units} units, the model {shape.num_layers} layers"
        )
    cluster = ClusterSpec(tuple(devices))
    plans = [
        search_microbatch_and_order(
            profile, cluster, num_microbatches=batch_size // b, microbatch_sizes=[b]
        )
        for b in sizes
        if b in profile.batch_sizes
    ]
    if not plans:
        raise ConfigError(
            f"the profile has none of the micro-batch sizes that divide {batch_size}: {sizes}"
        )
    free = [p for p in plans if p.predicted.get("ddb_free", 1.0) > 0]
    return min(free or plans, key=lambda p: p.predicted["round_s"])


@lru_cache(maxsize=4096)
def _period(dims: tuple[int, ...], classes: tuple[str, ...], batch_size: int) -> float:
    plan = plan_home(MLPShape.from_dims(dims), home_devices(classes), batch_size)
    return float(plan.predicted["round_s"])


def home_period_s(shape: MLPShape, classes: Sequence[str], batch_size: int) -> float:
    """The predicted round of one mini-batch on a home of ``classes`` (any order: the
    planner searches the order), on the analytic profile. Cached by device mix."""
    return _period(shape.dims, tuple(sorted(classes)), batch_size)
