"""When a training run changes shape at a replica: rebalancing and admission, pure.

- Rebalancing (Eco-FL's workload migration): from each device's measured time per
  micro-batch, FTPipeHD's capacities (:func:`zpipe.recovery.estimate_capacities`)
  give speeds; the lightweight plan for those speeds
  (:func:`zpipe.recovery.plan_recovery` with no failure) is taken when it
  shortens the bottleneck by at least the run's ``rebalance`` share. Given the
  profile and the cluster, the cuts and the comparison are the planners' cost
  model's, links included (a cut's activation is not moved onto a slow sender).
- Admission: a device that registered since the run was planned joins when the
  planner, over it and the run's devices, predicts a round shorter by that share.
- Unit costs: a plan the client gave (a federated home's, say) was planned on the
  client's profile; the request carries it (``RunRequest.profile``) so that
  rebalancing weighs units as that plan did (:func:`given_unit_work`), not alike
  (a model with a tiny last layer would read its last stage as fast).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from zpipe._errors import ConfigError, ZpipeError
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.recovery import (
    estimate_capacities,
    plan_recovery,
    speeds_from_capacities,
    stage_work,
    unit_work_from_profile,
)
from zpipe.recovery.stage_costs import CostModel, predict, with_speeds
from zpipe.training.objectives import check_train_settings, is_factory_name


def memory_model(optimizer: Mapping[str, Any]) -> str:
    """The planners' name for an optimizer's state (momentum is one more copy)."""
    name = str(optimizer["name"])
    if is_factory_name(name):
        # user code: its state cannot be known before it runs; plan for Adam's two copies
        return "adam"
    return "sgd-momentum" if name == "sgd" and optimizer.get("momentum") else name


def at_microbatch_size(plan: TrainingPlan, batch: int) -> TrainingPlan:
    """``plan`` costed at micro-batches of ``batch`` samples (a straight plan the
    coordinator built without knowing the size records 1)."""
    if plan.microbatch_size == batch:
        return plan
    if any(len(stage.devices) > 1 for stage in plan.stages):
        raise ConfigError("the plan's groups share micro-batches of another size")
    data = plan.to_dict()
    data["microbatch_size"] = batch
    data["stages"] = [{**stage, "shares": [batch]} for stage in data["stages"]]
    return TrainingPlan.from_dict(data)


def run_optimizer(plan: TrainingPlan, train: Mapping[str, Any] | None) -> str:
    """The planners' name for the optimizer a run's ``train`` settings train ``plan`` with."""
    settings = dict(train or {})
    for key in ("plan", "warmups"):
        settings.pop(key, None)
    settings.update(schedule=plan.schedule, num_microbatches=plan.num_microbatches)
    return memory_model(check_train_settings(settings, 1)["optimizer"])


def given_unit_work(profile: Mapping[str, Any], plan: TrainingPlan) -> list[float]:
    """Each unit's training work (forward and backward) at ``plan``'s micro-batch
    size, from the training profile a client sent with the plan it gave; a
    ConfigError says why the profile cannot cost the plan."""
    found = ModelProfile.from_dict(profile, source="the run's profile")
    work = unit_work_from_profile(found, plan.microbatch_size, training=True)
    if len(work) != plan.num_units:
        raise ConfigError(f"the run's profile has {len(work)} units, the plan {plan.num_units}")
    if not all(w >= 0 for w in work) or not sum(work) > 0:
        raise ConfigError("the run's profile must give every unit a time >= 0, some > 0")
    return work


@dataclass(frozen=True)
class Rebalance:
    """What rebalancing found: the plan to switch to (None: stay), and why."""

    plan: TrainingPlan | None
    fields: Mapping[str, Any]
    skipped: str = ""


def rebalanced(
    plan: TrainingPlan,
    counters: Mapping[str, Any],
    unit_work: list[float],
    threshold: float,
    model: CostModel | None = None,
) -> Rebalance:
    """The lightweight plan for the devices' measured speeds, if it shortens the
    bottleneck by at least ``threshold``; a plan not measured yet stays.

    With a cost ``model`` (the profile ``unit_work`` came from, and the cluster with
    its links) the cuts are placed by the planners' cost model at the measured
    speeds, and "shortens" means its predicted round (``round_s``) against the
    current plan's under the same model; the new plan carries that prediction.
    """
    measured: dict[str, float] = {}
    ranges: dict[str, tuple[int, int]] = {}
    fractions: dict[str, float] = {}
    for stage in plan.stages:
        for device, share in zip(stage.devices, stage.shares, strict=True):
            c = counters.get(device) or {}
            done = int(c.get("microbatches") or 0)
            if share == 0:
                continue
            if done == 0:
                return Rebalance(None, {})  # not measured yet
            measured[device] = (float(c["forward_s"]) + float(c["backward_s"])) / done
            ranges[device] = (stage.start, stage.end)
            fractions[device] = share / sum(stage.shares)
    try:
        speeds = speeds_from_capacities(
            estimate_capacities(measured, ranges, unit_work, work_fraction=fractions)
        )
        # a device with share 0 counts as the slowest measured one
        for device in plan.devices:
            speeds.setdefault(device, min(speeds.values()))
        balanced = plan_recovery(
            plan,
            failed=(),
            policy="lightweight",
            unit_work=unit_work,
            speeds=speeds,
            profile=None if model is None else model.profile,
            cluster=None if model is None else model.cluster,
            optimizer="sgd" if model is None else model.optimizer,
        ).plan
        assert isinstance(balanced, TrainingPlan)
        current = None
        if model is not None:
            at_speeds = replace(model, cluster=with_speeds(model.cluster, speeds))
            current = predict(plan, at_speeds)["round_s"]
    except (ZpipeError, ValueError) as exc:
        return Rebalance(None, {}, skipped=str(exc))
    now = max(stage_work(plan, unit_work, speeds))
    then = max(stage_work(balanced, unit_work, speeds))
    moved = [(st.start, st.end) for st in balanced.stages] != [
        (st.start, st.end) for st in plan.stages
    ]
    fields: dict[str, Any] = {
        "speeds": {d: round(v, 4) for d, v in speeds.items()},
        "bottleneck": round(now, 6),
        "balanced": round(then, 6),
    }
    if current is not None:
        # links and memory counted: the planners' round, now and after the move
        now, then = current, float(balanced.predicted["round_s"])
        fields.update(round_s=round(now, 6), balanced_round_s=round(then, 6))
    if not moved or then > now * (1.0 - threshold):
        return Rebalance(None, fields)
    return Rebalance(balanced, fields)


def admits(
    current_round_s: float, bigger: TrainingPlan, plan: TrainingPlan, threshold: float
) -> bool:
    """Whether ``bigger`` (the plan with newcomers) is worth a restart over ``plan``."""
    joining = [n for n in bigger.devices if n not in plan.devices]
    then = float(bigger.predicted["round_s"])
    return bool(joining) and then <= current_round_s * (1.0 - threshold)
