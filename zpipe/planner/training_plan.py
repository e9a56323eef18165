"""A training plan: stages of data-parallel device groups, as plain serialisable data.

Asteroid's hybrid pipeline parallelism (MobiCom '24, section 3.2): the model's
units are split into contiguous stages, each stage runs on a group of devices
that share every micro-batch (data parallelism inside the stage, an all-reduce
of the stage's gradients at the end of the mini-batch), and the stages form a
pipeline. A straight pipeline is the case of one device per stage; pure data
parallelism the case of one stage holding every device.

File form (``TrainingPlan.to_dict``)::

    {"algo": "hpp", "schedule": "1f1b", "num_units": 12,
     "microbatch_size": 8, "num_microbatches": 16,
     "stages": [{"devices": ["a", "b"], "start": 0, "end": 5, "shares": [5, 3], "warmup": 3},
                {"devices": ["c"], "start": 5, "end": 12, "shares": [8], "warmup": 1}],
     "predicted": {"round_s": 1.2, "samples_per_s": 106.7, ...}}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zpipe._errors import ConfigError
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, async_warmup
from zpipe.planner.plan import read_predicted

TRAINING_SCHEDULES = ("1f1b", "gpipe")
TRAINING_ALGOS = ("hpp", "straight", "data-parallel", "even")


@dataclass(frozen=True)
class TrainStage:
    """One stage: the devices that share it, its units ``[start, end)`` and their load.

    ``shares[k]`` is how many samples of every micro-batch ``devices[k]`` runs (a
    device with share 0 holds the stage's weights and takes part in its
    all-reduce, but computes nothing); ``warmup`` is K_p, the forwards the stage
    runs before it starts alternating backward and forward.
    """

    devices: tuple[str, ...]
    start: int
    end: int
    shares: tuple[int, ...]
    warmup: int

    @property
    def num_units(self) -> int:
        return self.end - self.start

    @property
    def microbatch_size(self) -> int:
        return sum(self.shares)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "start": self.start,
            "end": self.end,
            "shares": list(self.shares),
            "warmup": self.warmup,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainStage:
        """Parse one stage; raises KeyError/TypeError/ValueError (the plan wraps them)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"a stage must be an object, got {data!r}")
        devices, shares = data["devices"], data["shares"]
        if isinstance(devices, str) or isinstance(shares, str):
            raise TypeError("devices and shares must be lists")
        return cls(
            devices=tuple(str(d) for d in devices),
            start=_as_int(data["start"]),
            end=_as_int(data["end"]),
            shares=tuple(_as_int(s) for s in shares),
            warmup=_as_int(data["warmup"]),
        )


@dataclass(frozen=True)
class TrainingPlan:
    """Which device groups train which units, and how micro-batches flow through them.

    One round (one optimizer step) runs ``num_microbatches`` micro-batches of
    ``microbatch_size`` samples through the stages with ``schedule``, then
    all-reduces each multi-device stage's gradients and steps.
    """

    algo: str
    schedule: str
    num_units: int
    microbatch_size: int
    num_microbatches: int
    stages: tuple[TrainStage, ...]
    predicted: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_training_plan(self)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> list[str]:
        """Every device the plan uses, stage by stage."""
        return [d for s in self.stages for d in s.devices]

    @property
    def minibatch_size(self) -> int:
        """Samples per optimizer step."""
        return self.microbatch_size * self.num_microbatches

    @property
    def warmups(self) -> list[int]:
        return [s.warmup for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return {
            "algo": self.algo,
            "schedule": self.schedule,
            "num_units": self.num_units,
            "microbatch_size": self.microbatch_size,
            "num_microbatches": self.num_microbatches,
            "stages": [s.to_dict() for s in self.stages],
            "predicted": dict(self.predicted),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainingPlan:
        """The inverse of :meth:`to_dict`; :class:`ConfigError` for anything malformed."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"malformed training plan: must be an object, got {data!r}")
        try:
            raw_stages = data["stages"]
            if isinstance(raw_stages, (str, Mapping)):
                raise TypeError("stages must be a list")
            predicted = data.get("predicted", {})
            if not isinstance(predicted, Mapping):
                raise TypeError("predicted must be an object")
            return cls(
                algo=str(data["algo"]),
                schedule=str(data["schedule"]),
                num_units=_as_int(data["num_units"]),
                microbatch_size=_as_int(data["microbatch_size"]),
                num_microbatches=_as_int(data["num_microbatches"]),
                stages=tuple(TrainStage.from_dict(s) for s in raw_stages),
                predicted=read_predicted(predicted),
            )
        except ConfigError as exc:
            raise ConfigError(f"malformed training plan: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ConfigError(f"malformed training plan: {what}") from None

    def describe(self, unit_names: Sequence[str] | None = None) -> str:
        """A table for people: one row per stage, with the predictions the plan carries."""
        pred = self.predicted
        head = (
            f"{self.algo} ({self.schedule}): {self.num_stages} stages, micro-batch "
            f"{self.microbatch_size} x {self.num_microbatches}"
        )
        if "round_s" in pred:
            head += f", predicted round {pred['round_s'] * 1e3:.1f} ms"
        if "samples_per_s" in pred:
            head += f", {pred['samples_per_s']:.2f} samples/s"
        rows = [
            head,
            f"  {'stage':>5}  {'units':>11}  {'K':>3}  {'fwd ms':>8}  {'bwd ms':>8}  "
            f"{'allred ms':>9}  {'send ms':>8}  {'mem MB':>8}  devices (samples)",
        ]
        for i, s in enumerate(self.stages):
            group = ", ".join(f"{d} ({y})" for d, y in zip(s.devices, s.shares, strict=True))
            span = ""
            if unit_names is not None:
                span = f"  {unit_names[s.start]} .. {unit_names[s.end - 1]}"
            rows.append(
                f"  {i:>5}  {f'[{s.start}, {s.end})':>11}  {s.warmup:>3}  "
                f"{pred.get(f'stage{i}_forward_s', 0.0) * 1e3:>8.2f}  "
                f"{pred.get(f'stage{i}_backward_s', 0.0) * 1e3:>8.2f}  "
                f"{pred.get(f'stage{i}_allreduce_s', 0.0) * 1e3:>9.2f}  "
                f"{pred.get(f'stage{i}_send_forward_s', 0.0) * 1e3:>8.2f}  "
                f"{pred.get(f'stage{i}_memory_bytes', 0.0) / 1e6:>8.1f}  {group}{span}"
            )
        return "\n".join(rows)


def _as_int(value: Any) -> int:
    """An integer from a file: 3 and 3.0 pass, True, "3" and 3.5 do not."""
    if isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise TypeError(f"expected an integer, got {value!r}")


def validate_training_plan(plan: TrainingPlan) -> None:
    """Check the plan's shape; raise :class:`ConfigError` naming the first problem.

    Stages cover ``[0, num_units)`` contiguously, each non-empty; each stage has at
    least one device, one share per device, shares >= 0 summing to the
    micro-batch size; no device serves two stages (or one twice); warm-ups lie in
    ``1..num_microbatches`` and equal it under GPipe.
    """
    if not plan.algo or not isinstance(plan.algo, str):
        raise ConfigError(f"a training plan needs an algo name, got {plan.algo!r}")
    if plan.schedule not in (*TRAINING_SCHEDULES, ASYNC_SCHEDULE):
        known = ", ".join((*TRAINING_SCHEDULES, ASYNC_SCHEDULE))
        raise ConfigError(f"unknown schedule {plan.schedule!r}; use one of {known}")
    for name in ("num_units", "microbatch_size", "num_microbatches"):
        value = getattr(plan, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if not plan.stages:
        raise ConfigError("a training plan needs at least one stage")
    expected = 0
    seen: dict[str, int] = {}
    for i, stage in enumerate(plan.stages):
        _check_stage(plan, i, stage, expected)
        for d in stage.devices:
            if d in seen:
                raise ConfigError(
                    f"device {d!r} appears in stage {seen[d]} and stage {i}; "
                    "a device serves one stage, once"
                )
            seen[d] = i
        expected = stage.end
    if expected != plan.num_units:
        raise ConfigError(
            f"the stages cover units [0, {expected}), but the model has {plan.num_units}"
        )


def _check_stage(plan: TrainingPlan, i: int, stage: TrainStage, expected: int) -> None:
    if stage.start != expected:
        raise ConfigError(
            f"stage {i} starts at unit {stage.start}, expected {expected}: "
            "ranges must be contiguous and start at 0"
        )
    if stage.end <= stage.start:
        raise ConfigError(f"stage {i} has an empty range [{stage.start}, {stage.end})")
    if not stage.devices or any(not isinstance(d, str) or not d for d in stage.devices):
        raise ConfigError(f"stage {i} needs one or more named devices, got {stage.devices!r}")
    if len(stage.shares) != len(stage.devices):
        raise ConfigError(
            f"stage {i} has {len(stage.devices)} devices but {len(stage.shares)} shares; "
            "give one share per device"
        )
    if any(isinstance(y, bool) or not isinstance(y, int) or y < 0 for y in stage.shares):
        raise ConfigError(f"stage {i}: shares must be integers >= 0, got {list(stage.shares)}")
    if sum(stage.shares) != plan.microbatch_size:
        raise ConfigError(
            f"stage {i}: shares {list(stage.shares)} sum to {sum(stage.shares)}, but a "
            f"micro-batch has {plan.microbatch_size} samples"
        )
    w = stage.warmup
    if plan.schedule == ASYNC_SCHEDULE:
        # asynchronous 1F1B: one micro-batch per mini-batch, warm-up n - i
        want = async_warmup(i, len(plan.stages))
        if plan.num_microbatches != 1 or len(stage.devices) != 1 or w != want:
            raise ConfigError(
                f"stage {i}: {ASYNC_SCHEDULE} runs one device per stage, one micro-batch "
                f"per mini-batch and warm-up n - i = {want}; got {len(stage.devices)} "
                f"devices, {plan.num_microbatches} micro-batches, warm-up {w!r}"
            )
        return
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= plan.num_microbatches:
        raise ConfigError(
            f"stage {i}: warmup must be in 1..{plan.num_microbatches} (the number of "
            f"micro-batches), got {w!r}"
        )
    if plan.schedule == "gpipe" and w != plan.num_microbatches:
        raise ConfigError(
            f"stage {i}: gpipe runs all {plan.num_microbatches} forwards first, so its warmup "
            f"must be {plan.num_microbatches}, got {w}"
        )
