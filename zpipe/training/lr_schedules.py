"""Learning-rate schedules as plain data and a pure function of the step.

A run describes its schedule as ``{"name": "cosine", "warmup_steps": 10,
"total_steps": 200}``; every stage multiplies its optimizer's initial learning
rates by :func:`lr_factor` of the mini-batch it is about to step, so stages
agree without talking, and a run resumed at mini-batch ``s`` (from a replica
or a checkpoint) goes on with the rates an uninterrupted run would use.

    constant  1 after the warm-up
    linear    decays linearly from 1 after the warm-up to 0 at total_steps
    cosine    decays as half a cosine from 1 after the warm-up to 0 at total_steps

The warm-up rises linearly: step ``s < warmup_steps`` uses ``(s + 1) / warmup_steps``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from zpipe._errors import ConfigError

LR_SCHEDULES = ("constant", "linear", "cosine")
_FIELDS = ("name", "warmup_steps", "total_steps")


def check_lr_schedule(schedule: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A validated copy of a schedule description (None: the rates never change)."""
    if schedule is None:
        return None
    if not isinstance(schedule, Mapping):
        raise ConfigError(f"an lr schedule is described by a mapping, got {schedule!r}")
    unknown = sorted(set(schedule) - set(_FIELDS))
    if unknown:
        raise ConfigError(f"lr schedule: unknown fields {unknown}; known: {list(_FIELDS)}")
    name = schedule.get("name", "constant")
    if name not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr schedule {name!r}; known: {', '.join(LR_SCHEDULES)}")
    warmup = schedule.get("warmup_steps", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"lr schedule: warmup_steps must be an integer >= 0, got {warmup!r}")
    checked: dict[str, Any] = {"name": name, "warmup_steps": warmup}
    total = schedule.get("total_steps")
    if name != "constant":
        if isinstance(total, bool) or not isinstance(total, int) or total <= warmup:
            raise ConfigError(
                f"lr schedule {name}: total_steps must be an integer above warmup_steps "
                f"({warmup}), got {total!r}"
            )
        checked["total_steps"] = total
    elif total is not None:
        raise ConfigError("lr schedule constant: total_steps does not apply")
    return checked


def lr_factor(schedule: Mapping[str, Any] | None, step: int) -> float:
    """What the initial learning rates are multiplied by for mini-batch ``step``
    (counted from 0 over the whole training, resumed runs included)."""
    if schedule is None:
        return 1.0
    warmup = int(schedule.get("warmup_steps", 0))
    if step < warmup:
        return (step + 1) / warmup
    name = schedule["name"]
    if name == "constant":
        return 1.0
    total = int(schedule["total_steps"])
    progress = min(1.0, (step - warmup) / (total - warmup))
    if name == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
