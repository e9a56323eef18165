"""A training plan and run request as a live re-partition changes them: pure edits.

A move re-cuts a plan of one-device stages (:func:`with_bounds`), over fewer devices
when it leaves one out, and then keeps the run's staleness depth (:func:`with_depth`)
so that a later recovery resumes at the depth the run started with.
"""

from __future__ import annotations

from dataclasses import replace

from zpipe._errors import ConfigError
from zpipe.planner.async_schedule import async_warmup
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.client_control import RunRequest


def plan_bounds(plan: TrainingPlan) -> tuple[list[str], list[int]]:
    """The devices in stage order and the cuts of a one-device-per-stage plan."""
    shared = [list(s.devices) for s in plan.stages if len(s.devices) > 1]
    if shared:
        raise ConfigError(f"a live re-partition moves units of one-device stages, not {shared}")
    devices = [s.devices[0] for s in plan.stages]
    return devices, [s.start for s in plan.stages] + [plan.stages[-1].end]


def with_bounds(
    plan: TrainingPlan, bounds: tuple[int, ...], devices: tuple[str, ...] | None = None
) -> TrainingPlan:
    """``plan`` cut at ``bounds``; with ``devices``, over those of its stages alone (a
    move that left the others out: each kept stage's warm-up that of its new place)."""
    if devices is None:
        stages = tuple(
            replace(s, start=bounds[i], end=bounds[i + 1]) for i, s in enumerate(plan.stages)
        )
        return replace(plan, stages=stages)
    by_device = {s.devices[0]: s for s in plan.stages}
    n = len(devices)
    kept = tuple(
        replace(by_device[d], start=bounds[i], end=bounds[i + 1], warmup=async_warmup(i, n))
        for i, d in enumerate(devices)
    )
    return replace(plan, stages=kept)


def with_depth(request: RunRequest, depth: int) -> RunRequest:
    """``request`` whose asynchronous runs keep the staleness of ``depth`` stages (a
    move that left a device out: a later recovery resumes at that depth too)."""
    train = dict(request.train or {})
    settings = dict(train.get("async") or {})
    settings.setdefault("depth", depth)
    return replace(request, train={**train, "async": settings})
