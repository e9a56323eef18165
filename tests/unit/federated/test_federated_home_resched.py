"""Eco-FL's re-scheduling inside a home (section 4.4): the decision fed with numbers, and
the pipeline trainer's bookkeeping around it (no processes: the trainer is only built)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from zpipe._errors import ConfigError
from zpipe.federated.home_plan import home_devices, mlp_profile, plan_home
from zpipe.federated.home_resched import decide, reorders, seconds_per_work
from zpipe.federated.model import MLPShape
from zpipe.federated.pipeline_trainer import PipelineTrainer

# the bench's home and model (bench/_federated_resched.py): wide layers, micro-batches >= 8
SHAPE = MLPShape.from_dims([64, 512, 512, 512, 512, 10])
HOME = ("nx", "tx2", "nano", "nano")
SIZES = (8, 16, 32)
BATCH = 32


def _plan() -> tuple[Any, Any]:
    devices = home_devices(HOME)
    return plan_home(SHAPE, devices, BATCH, microbatch_sizes=SIZES), devices


def _slowed(plan: Any, device: str, factor: float) -> tuple[dict[str, list[float]], dict]:
    history = {d: [1.0, 1.1, 0.9] for d in plan.devices}
    current = {d: 1.0 for d in plan.devices}
    current[device] = factor
    return history, current


def _counters(plan: Any, s_per_work: dict[str, float], profile: Any) -> dict[str, dict]:
    """Stage counters as a run reports them, for devices that ran at ``s_per_work``."""
    fwd = profile.times(plan.microbatch_size)
    bwd = profile.backward_times(plan.microbatch_size)
    out = {}
    for stage in plan.stages:
        (device,) = stage.devices
        n = plan.num_microbatches * 3  # three mini-batches
        rate = s_per_work[device]
        out[device] = {
            "microbatches": n,
            "backwards": n,
            "forward_s": n * rate * sum(fwd[stage.start : stage.end]),
            "backward_s": n * rate * sum(bwd[stage.start : stage.end]),
        }
    return out


def test_seconds_per_work_is_time_per_micro_batch_over_the_units_profiled_time() -> None:
    plan, _ = _plan()
    profile = mlp_profile(SHAPE, [plan.microbatch_size])
    rates = {d: 2.0 + i for i, d in enumerate(plan.devices)}
    got = seconds_per_work(plan, _counters(plan, rates, profile), profile)
    assert got == pytest.approx(rates)
    # a device that ran nothing is left out, not counted as infinitely fast
    counters = _counters(plan, rates, profile)
    counters[plan.devices[0]] = {"microbatches": 0, "backwards": 0}
    assert plan.devices[0] not in seconds_per_work(plan, counters, profile)


def test_no_history_or_no_departure_keeps_the_plan() -> None:
    plan, devices = _plan()
    history, current = _slowed(plan, "tx20", 1.3)  # 1.3x: inside the 0.5 threshold
    found = decide(plan, devices, history, current, shape=SHAPE, microbatch_sizes=SIZES)
    assert found.plan is None and not found.triggered
    assert found.devices == tuple(devices)
    assert found.deviations["tx20"] == pytest.approx(1.3)
    first = decide(plan, devices, {}, current, shape=SHAPE, microbatch_sizes=SIZES)
    assert first.plan is None and "no history" in first.reason


def test_a_slowed_device_is_reordered_to_the_end_and_loses_layers() -> None:
    plan, devices = _plan()
    assert plan.devices == ["nano0", "nx0", "tx20", "nano1"]
    history, current = _slowed(plan, "tx20", 4.0)
    current["nx0"] = 1.3  # inside the threshold: noise, its speed stays as planned
    found = decide(plan, devices, history, current, shape=SHAPE, microbatch_sizes=SIZES)
    assert found.triggered and found.plan is not None, found.reason
    # the best plan at the measured speeds reorders the devices: tx2 takes the tiny last layer
    assert reorders(plan, found.plan)
    assert found.plan.devices == ["nano0", "nano1", "nx0", "tx20"]
    last = found.plan.stages[-1]
    assert last.devices == ("tx20",) and (last.start, last.end) == (4, 5)
    # tx2's speed rescaled by the measurement (4x slower than its class), the others kept
    speeds = {d.name: d.speed for d in found.devices}
    assert speeds["tx20"] == pytest.approx(devices[1].speed / 4.0)
    assert speeds["nx0"] == devices[0].speed
    fields = found.fields
    assert fields["replanned_round_s"] < fields["round_s"] * 0.9
    assert fields["departed"] == ["tx20"]


def test_a_device_that_sped_up_also_triggers() -> None:
    plan, devices = _plan()
    slow = [replace(d, speed=d.speed / 4) if d.name == "nx0" else d for d in devices]
    slow_plan = plan_home(SHAPE, slow, BATCH, microbatch_sizes=SIZES)
    history, current = _slowed(slow_plan, "nx0", 0.25)  # the load went away
    found = decide(slow_plan, slow, history, current, shape=SHAPE, microbatch_sizes=SIZES)
    assert found.plan is not None and found.plan.devices == plan.devices
    assert [(s.start, s.end) for s in found.plan.stages] == [(s.start, s.end) for s in plan.stages]


def test_a_departure_whose_best_plan_is_the_current_one_keeps_it() -> None:
    plan, devices = _plan()
    # nano1 holds only the 512x10 layer: slowing it changes nothing worth moving
    history, current = _slowed(plan, "nano1", 2.0)
    found = decide(plan, devices, history, current, shape=SHAPE, microbatch_sizes=SIZES)
    assert found.triggered and found.plan is None
    assert "current one" in found.reason
    # too small a gain is refused too (nano0 2x slower: 3.7 % predicted)
    history, current = _slowed(plan, "nano0", 2.0)
    found = decide(plan, devices, history, current, shape=SHAPE, microbatch_sizes=SIZES)
    assert found.triggered and found.plan is None and "gain" in found.reason
    taken = decide(plan, devices, history, current, shape=SHAPE, microbatch_sizes=SIZES, gain=0.01)
    assert taken.plan is not None


def test_settings_out_of_range_are_refused() -> None:
    plan, devices = _plan()
    history, current = _slowed(plan, "tx20", 4.0)
    for bad in ({"threshold": 0.0}, {"gain": 1.0}, {"gain": -0.1}):
        with pytest.raises(ConfigError):
            decide(plan, devices, history, current, shape=SHAPE, **bad)
    with pytest.raises(ConfigError, match="reschedule"):
        PipelineTrainer(home=HOME, reschedule=0.0)
    for bad_share in (0.0, 1.0):
        with pytest.raises(ConfigError, match="rebalance"):
            PipelineTrainer(home=HOME, rebalance=bad_share)
    with pytest.raises(ConfigError, match="rebalance_every"):
        PipelineTrainer(home=HOME, rebalance=0.2, rebalance_every=0)
    with pytest.raises(ConfigError, match="no device"):
        PipelineTrainer(home=HOME, load_schedules={"tpu0": "0:1,5:4"})


class _Report:
    def __init__(self, stages: dict[str, dict]) -> None:
        self.stages = stages
        self.training_plan = None  # no mid-task rebalance: the counters are the plan's


def test_the_trainer_replans_after_a_slow_task_and_starts_its_history_again() -> None:
    trainer = PipelineTrainer(home=HOME, microbatch_sizes=SIZES)
    plan = trainer.plan_for(SHAPE, BATCH)
    profile = mlp_profile(SHAPE, [plan.microbatch_size])
    normal = {d: 1e-3 for d in plan.devices}

    def task(plan: Any, rates: dict[str, float]) -> None:
        trainer.last_report = _Report(_counters(plan, rates, profile))  # type: ignore[assignment]
        trainer._tasks += 1  # as train() counts them
        trainer._look(SHAPE, BATCH, plan)

    # the first task warms up: not measured, however slow
    task(plan, {d: 1.0 for d in plan.devices})
    assert "warms" in str(trainer.reschedules[0]["reason"])
    for _ in range(2):
        task(plan, normal)
    assert [e["rescheduled"] for e in trainer.reschedules] == [False, False, False]
    assert "no history" in str(trainer.reschedules[1]["reason"])
    assert trainer.plan_for(SHAPE, BATCH) is plan
    task(plan, {**normal, "tx20": 4e-3})
    entry = trainer.reschedules[-1]
    assert entry["rescheduled"] and entry["reordered"]
    assert entry["devices"] == ["nano0", "nano1", "nx0", "tx20"]
    new = trainer.plan_for(SHAPE, BATCH)
    assert new.devices == ["nano0", "nano1", "nx0", "tx20"]
    # tx2 staying slow is its new normal: the next task at that speed changes nothing
    for _ in range(2):
        task(new, {**normal, "tx20": 4e-3})
    assert [e["rescheduled"] for e in trainer.reschedules[-2:]] == [False, False]
    assert "no history" in str(trainer.reschedules[-2]["reason"])
    assert trainer.plan_for(SHAPE, BATCH) is new


def test_a_slowdown_caught_half_way_by_a_task_is_caught_in_full_by_the_next() -> None:
    trainer = PipelineTrainer(home=HOME, microbatch_sizes=SIZES)
    plan = trainer.plan_for(SHAPE, BATCH)
    profile = mlp_profile(SHAPE, [plan.microbatch_size])
    normal = {d: 1e-3 for d in plan.devices}
    for rates in (normal, normal, normal, {**normal, "tx20": 1.6e-3}):
        trainer.last_report = _Report(_counters(plan, rates, profile))  # type: ignore[assignment]
        trainer._tasks += 1
        trainer._look(SHAPE, BATCH, plan)
    # the tx2 slowed during that task: 1.6x departs, but no plan gains enough from it
    half = trainer.reschedules[-1]
    assert not half["rescheduled"] and "tx20" in str(half["reason"])
    assert trainer.plan_for(SHAPE, BATCH) is plan
    # the next task sees it 4x slower: 2.5x over its restarted history, the rest unchanged
    trainer.last_report = _Report(  # type: ignore[assignment]
        _counters(plan, {**normal, "tx20": 4e-3}, profile)
    )
    trainer._tasks += 1
    trainer._look(SHAPE, BATCH, plan)
    full = trainer.reschedules[-1]
    assert full["rescheduled"], full["reason"]
    assert full["deviations"]["tx20"] == pytest.approx(2.5)  # type: ignore[index]
    assert trainer.plan_for(SHAPE, BATCH).devices == ["nano0", "nano1", "nx0", "tx20"]


def test_a_trainer_without_rescheduling_keeps_its_first_plan() -> None:
    trainer = PipelineTrainer(home=HOME, microbatch_sizes=SIZES, reschedule=None)
    assert trainer.reschedule is None and trainer.reschedules == []


def test_a_load_schedule_multiplies_the_devices_emulated_slowness() -> None:
    trainer = PipelineTrainer(home=HOME, slowdown_scale=2.0, load_schedules={"tx20": "0:1,30:4"})
    specs = {d.name: d for d in trainer._cluster.devices}
    assert specs["tx20"].slowdown_schedule == "0:3,30:12"  # tx2 is 1.5x slower, scale 2
    assert specs["tx20"].slowdown == 1.0
    assert specs["nano0"].slowdown == pytest.approx(6.0)
