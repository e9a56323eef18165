"""The cost model every planner shares, and the prediction for any plan.

For a micro-batch of size ``b`` (PipeEdge, section III-B, eq. 1-2):

- ``T_comp(i..j, u)``: the sum of the profile's unit times ``i .. j-1`` divided
  by ``u.speed``, or the sum of ``u``'s own profile's times when it has one.
- ``M(i..j)``: the stage's weights plus its forward's peak by the tight rule
  (:mod:`zpipe.planner.memory`, the one memory model); it must fit
  ``u.memory_bytes``. Memory and transfer sizes always come from the model
  profile: a device's own profile only changes times.
- ``T_comm(u, v, P)``: ``cluster.comm_time_s(u, v, P)`` with ``P`` the output
  bytes of the stage's last unit (the model input for the client's hop).
- A stage's period is ``max(T_comp, T_comm to the next device)``: compute and
  communication overlap (eq. 2). The last stage sends its result to the
  client. The client's send of the input to the first stage is a pipeline
  "stage" of its own, as it uses the client's link and not a device's.
- The bottleneck is the largest period; throughput is ``b / bottleneck``.

Why the first stage's receive is not added to its own period: each transfer
occupies the sender's side of one link, and in eq. 2 a stage pays only for its
send; counting the receive as well would charge every interior link twice.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.planner.cluster import CLIENT, ClusterDevice, ClusterSpec
from zpipe.planner.memory import profile_need_matrix
from zpipe.planner.plan import Plan
from zpipe.planner.profile import ModelProfile

GB = 1e9


def device_unit_times(profile: ModelProfile, device: ClusterDevice, batch_size: int) -> list[float]:
    """Each unit's forward time on ``device`` at ``batch_size``."""
    if device.profile is not None:
        own = device.profile
        if own.num_units != profile.num_units:
            raise ConfigError(
                f"device {device.name!r}: its own profile has {own.num_units} units but the "
                f"model profile has {profile.num_units}; profile the same model on it"
            )
        try:
            return own.times(batch_size)
        except ConfigError as exc:
            raise ConfigError(f"device {device.name!r}: its own profile: {exc}") from None
    return [t / device.speed for t in profile.times(batch_size)]


def fmt_bytes(n: float) -> str:
    """Bytes for people: ``1.23 GB`` (decimal units, as the error messages compare them)."""
    if n >= GB:
        return f"{n / GB:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} kB"


def check_memory_totals(
    need: np.ndarray, devices: Sequence[ClusterDevice], profile: ModelProfile
) -> None:
    """Raise :class:`InfeasiblePlanError` for the two reasons no split can ever fit.

    ``need`` is :func:`~zpipe.planner.memory.profile_need_matrix`. Any split needs
    at least every unit's weights plus the largest unit's forward: more than all
    the devices hold together fits nowhere; nor does one unit that alone needs
    more than the largest device holds.
    """
    if any(d.memory_bytes is None for d in devices):
        return
    n = profile.num_units
    alone = [int(need[k, k + 1]) for k in range(n)]
    weights = sum(profile.param_bytes())
    total = weights + max(a - w for a, w in zip(alone, profile.param_bytes(), strict=True))
    held = sum(d.memory_bytes or 0 for d in devices)
    if total > held:
        raise InfeasiblePlanError(
            f"the model needs at least {fmt_bytes(total)} (its weights and its largest unit's "
            f"forward) but the {len(devices)} devices together hold {fmt_bytes(held)}; "
            f"{fmt_bytes(total - held)} short: add devices or memory, or use a smaller micro-batch"
        )
    largest = max(devices, key=lambda d: d.memory_bytes or 0)
    cap = largest.memory_bytes or 0
    for k, m in enumerate(alone):
        if m > cap:
            raise InfeasiblePlanError(
                f"unit {k} ({profile.units[k].name}) alone needs {fmt_bytes(m)} but the largest "
                f"device ({largest.name}) holds {fmt_bytes(cap)}: split the unit or add a bigger "
                "device"
            )


def predict_plan(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, batch_size: int
) -> dict[str, float]:
    """Per-stage compute, communication and memory, the bottleneck and throughput of ``plan``.

    Works for any plan (a planner's or a user's). Keys: ``stage{i}_compute_s``,
    ``stage{i}_comm_s`` (send to the next stage, or of the result to the
    client), ``stage{i}_period_s``, ``stage{i}_memory_bytes``,
    ``source_comm_s`` (client to first stage), ``bottleneck_s``,
    ``throughput_samples_per_s``, ``microbatches_per_s``, ``latency_s`` (one
    micro-batch end to end), ``num_stages``, ``batch_size`` and
    ``memory_violations`` (stages whose units exceed their device's memory).
    """
    if plan.num_units != profile.num_units:
        raise ConfigError(
            f"the plan covers {plan.num_units} units but the profile has {profile.num_units}"
        )
    out = profile.output_bytes(batch_size)
    need = profile_need_matrix(profile, batch_size)
    names = [s.device for s in plan.stages]
    devices = [cluster.device(n) for n in names]
    pred: dict[str, float] = {"batch_size": float(batch_size), "num_stages": float(len(names))}
    source = cluster.comm_time_s(CLIENT, names[0], profile.input_bytes_at(batch_size))
    pred["source_comm_s"] = source
    latency = source + cluster.latency_s(CLIENT, names[0])
    bottleneck, violations = source, 0
    times: dict[str, list[float]] = {}
    for i, (stage, device) in enumerate(zip(plan.stages, devices, strict=True)):
        if device.name not in times:
            times[device.name] = device_unit_times(profile, device, batch_size)
        comp = math.fsum(times[device.name][stage.start : stage.end])
        nxt = names[i + 1] if i + 1 < len(names) else CLIENT
        comm = cluster.comm_time_s(device.name, nxt, out[stage.end - 1])
        mem = int(need[stage.start, stage.end])
        if device.memory_bytes is not None and mem > device.memory_bytes:
            violations += 1
        period = max(comp, comm)
        pred[f"stage{i}_compute_s"] = comp
        pred[f"stage{i}_comm_s"] = comm
        pred[f"stage{i}_period_s"] = period
        pred[f"stage{i}_memory_bytes"] = float(mem)
        bottleneck = max(bottleneck, period)
        latency += comp + comm + cluster.latency_s(device.name, nxt)
    pred["bottleneck_s"] = bottleneck
    pred["microbatches_per_s"] = 1.0 / bottleneck if bottleneck > 0 else math.inf
    pred["throughput_samples_per_s"] = batch_size * pred["microbatches_per_s"]
    pred["latency_s"] = latency
    pred["memory_violations"] = float(violations)
    return pred


def check_plan_memory(
    plan: Plan, profile: ModelProfile, cluster: ClusterSpec, batch_size: int
) -> None:
    """Raise :class:`InfeasiblePlanError` naming the first stage that exceeds its device."""
    needs = profile_need_matrix(profile, batch_size)
    for i, stage in enumerate(plan.stages):
        cap = cluster.device(stage.device).memory_bytes
        need = int(needs[stage.start, stage.end])
        if cap is not None and need > cap:
            raise InfeasiblePlanError(
                f"the {plan.algo} plan puts units [{stage.start}, {stage.end}) "
                f"({fmt_bytes(need)}) on stage {i}, device {stage.device}, which holds "
                f"{fmt_bytes(cap)}; {fmt_bytes(need - cap)} short: use the pipeedge planner, "
                "which respects memory, or add memory"
            )
