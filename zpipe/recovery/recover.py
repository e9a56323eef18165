"""One entry point for the coordinator: the new plan and the weight moves, by policy.

    plan_recovery(old_plan, failed=..., policy="lightweight" | "heavy" | "respipe", ...)

chooses the re-planner (:mod:`zpipe.recovery.replanning`) for the plan's kind
and, for training, the weight redistribution
(:mod:`zpipe.recovery.redistribution`) from the old plan to the new one.
Inference needs no redistribution: its stages build their units from the
model spec.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterSpec
from zpipe.planner.plan import Plan
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery.redistribution import Redistribution, Replica, plan_redistribution
from zpipe.recovery.replanning import (
    heavy_replan_inference,
    heavy_replan_training,
    lightweight_replan,
    respipe_replan,
    unit_work_from_profile,
)
from zpipe.recovery.stage_costs import CostModel

POLICIES = ("lightweight", "heavy", "respipe")


@dataclass(frozen=True)
class RecoveryPlan:
    """The plan to switch to, and (training) who fetches which weights before the commit."""

    policy: str
    plan: Plan | TrainingPlan
    redistribution: Redistribution | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "kind": "training" if isinstance(self.plan, TrainingPlan) else "inference",
            "plan": self.plan.to_dict(),
            "redistribution": (
                None if self.redistribution is None else self.redistribution.to_dict()
            ),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecoveryPlan:
        try:
            kind, raw = data["kind"], data["redistribution"]
            plan: Plan | TrainingPlan
            if kind == "training":
                plan = TrainingPlan.from_dict(data["plan"])
            elif kind == "inference":
                plan = Plan.from_dict(data["plan"])
            else:
                raise ConfigError(f"unknown plan kind {kind!r}")
            return cls(
                str(data["policy"]), plan, None if raw is None else Redistribution.from_dict(raw)
            )
        except KeyError as exc:
            raise ConfigError(f"malformed recovery plan: missing key {exc}") from None


def plan_recovery(
    old: Plan | TrainingPlan,
    *,
    failed: Collection[str],
    policy: str,
    profile: ModelProfile | None = None,
    cluster: ClusterSpec | None = None,
    batch_size: int | None = None,
    unit_work: Sequence[float] | None = None,
    speeds: Mapping[str, float] | None = None,
    unit_bytes: Sequence[float] | None = None,
    live_version: int | None = None,
    replicas: Sequence[Replica] = (),
    version: int | None = None,
    heavy_algo: str | None = None,
    optimizer: str = "sgd",
) -> RecoveryPlan:
    """Re-plan ``old`` without ``failed`` by ``policy``; redistribute if ``live_version`` is set.

    - ``lightweight`` needs ``unit_work`` (or a ``profile`` and, for inference,
      ``batch_size``); ``speeds`` default to 1.0 (give
      :func:`~zpipe.planner.capacity.speeds_from_capacities` of measured ones).
      With the ``profile`` and the ``cluster`` (and, for inference, ``batch_size``)
      it places the cuts by the planners' cost model, links included, and
      ``speeds`` (if given) replace the cluster's compute speeds.
    - Every policy's plan carries the planners' prediction when the profile and
      the cluster are given.
    - ``heavy`` needs ``profile`` and ``cluster`` (and ``batch_size`` for
      inference); training reuses ``old``'s micro-batch size, count and schedule.
    - ``respipe`` needs nothing.

    ``live_version``, ``replicas`` and ``version`` are
    :func:`~zpipe.recovery.redistribution.plan_redistribution`'s.
    """
    training = isinstance(old, TrainingPlan)
    new: Plan | TrainingPlan
    # With the profile and the cluster every policy costs links as the planners do.
    model = None
    if profile is not None and cluster is not None and (training or batch_size is not None):
        model = CostModel(profile, cluster, batch_size=batch_size, optimizer=optimizer)
    if policy == "lightweight":
        if unit_work is None and model is None:
            if profile is None:
                raise ConfigError("lightweight re-planning needs unit_work or a profile")
            size = old.microbatch_size if isinstance(old, TrainingPlan) else batch_size
            if size is None:
                raise ConfigError("lightweight re-planning of inference needs the batch size")
            unit_work = unit_work_from_profile(profile, size, training=training)
        new = lightweight_replan(
            old,
            failed=failed,
            unit_work=unit_work,
            speeds=speeds,
            unit_bytes=unit_bytes,
            model=model,
        )
    elif policy == "heavy":
        if profile is None or cluster is None:
            raise ConfigError("heavy re-planning needs the profile and the cluster")
        if isinstance(old, TrainingPlan):
            new = heavy_replan_training(
                profile,
                cluster,
                failed=failed,
                microbatch_size=old.microbatch_size,
                num_microbatches=old.num_microbatches,
                algo=heavy_algo or "hpp",
                schedule=old.schedule,
                optimizer=optimizer,
            )
        else:
            if batch_size is None:
                raise ConfigError("heavy re-planning of inference needs the batch size")
            new = heavy_replan_inference(
                profile,
                cluster,
                failed=failed,
                batch_size=batch_size,
                algo=heavy_algo or "pipeedge",
            )
    elif policy == "respipe":
        new = respipe_replan(old, failed=failed, speeds=speeds, model=model)
    else:
        raise ConfigError(f"unknown recovery policy {policy!r}; use one of {POLICIES}")
    redistribution = None
    if live_version is not None:
        redistribution = plan_redistribution(
            old,
            new,
            failed=failed,
            live_version=live_version,
            replicas=replicas,
            version=version,
        )
    return RecoveryPlan(policy, new, redistribution)
