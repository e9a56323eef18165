"""Rebalancing a plan the client gave, costed from the profile it sent with it.

A federated home plans its pipeline itself (Eco-FL's plan on its analytic profile)
and gives the coordinator the plan; no stage profiles then. The MLP's last layer
is tiny: costed unit for unit, its stage reads as fast and rebalancing piles units
on it (issue 31: a rebalance that made the round longer, or never fired).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._support.coordinator_harness import SPEC, Harness
from zpipe._errors import ConfigError
from zpipe.client import TrainOptions
from zpipe.client.runs.fit import training_request
from zpipe.models import ModelSpec
from zpipe.planner.profile import ModelProfile, synthetic_profile
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.transport.codec import Message

# SPEC's six units as the client's profile costs them: five alike, the last tiny
WORK = [1.0, 1.0, 1.0, 1.0, 1.0, 0.01]
PROFILE = synthetic_profile(
    [w / 3 for w in WORK], [64] * 6, backward_times_s=[2 * w / 3 for w in WORK],
    activation_bytes=[64] * 6,
)  # fmt: skip


def _plan(cut: int) -> TrainingPlan:
    return TrainingPlan(
        algo="explicit", schedule="1f1b", num_units=6, microbatch_size=1, num_microbatches=3,
        stages=(TrainStage(("a",), 0, cut, (1,), 2), TrainStage(("b",), cut, 6, (1,), 1)),
    )  # fmt: skip


def _replica_after(
    plan: TrainingPlan, speeds: dict[str, float], profile: dict[str, Any] | None
) -> tuple[Harness, Message]:
    """A run on the client's ``plan`` (with ``profile``, rebalance 0.2) whose devices
    ran their units at ``speeds`` (``WORK`` a second at speed 1): its first replica."""
    h = Harness()
    for name in "ab":
        h.register(name)
    train = {
        "num_microbatches": 3, "optimizer": {"name": "sgd", "lr": 0.1}, "plan": plan.to_dict(),
    }  # fmt: skip
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=["a", "b"], train=train,
        recover=True, rebalance=0.2, profile=profile,
    )  # fmt: skip
    run = h.core.run
    assert run is not None
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    h.client("replicate", run=run.run, step=2)
    for stage in plan.stages:
        name = stage.devices[0]
        units = range(stage.start, stage.end)
        per_microbatch = sum(WORK[u] for u in units) / speeds[name]
        metrics = {
            "microbatches": 3,
            "forward_s": 3 * per_microbatch / 3,
            "backward_s": 3 * per_microbatch * 2 / 3,
        }
        keys = [f"units.{u}.weight" for u in units]
        body = {"run": run.run, "step": 2, "name": name, "keys": keys, "error": ""}
        tensors = tuple(torch.zeros(2) for _ in units)
        h.feed_message(name, Message("weights", {**body, "metrics": metrics}, tensors=tensors))
    (reply,) = h.to_client("replicated")
    assert reply.body["error"] == ""
    return h, reply


def _cuts(reply: Message) -> list[tuple[int, int]] | None:
    moved = reply.body.get("rebalance")
    if moved is None:
        return None
    return [(s.start, s.end) for s in TrainingPlan.from_dict(moved).stages]


def test_a_right_cut_under_real_costs_stays() -> None:
    # a twice as fast holds units 0-3 (2 s), b the last two (1.01 s): the best cut.
    # Unit for unit, b reads twice as fast as a and takes unit 3 (a 1.5 s, b 2.01 s).
    _, reply = _replica_after(_plan(4), {"a": 2.0, "b": 1.0}, PROFILE.to_dict())
    assert _cuts(reply) is None


def test_a_wrong_cut_under_real_costs_moves_to_the_real_balance() -> None:
    # equal speeds, a holds five units (5 s) and b the tiny one: the real balance is
    # 3 | 2 (3 s, 2.01 s); unit for unit it would be 1 | 5 (b at 4.01 s)
    h, reply = _replica_after(_plan(5), {"a": 1.0, "b": 1.0}, PROFILE.to_dict())
    assert _cuts(reply) == [(0, 3), (3, 6)]
    (considered,) = h.events("rebalance_considered")
    assert considered["balanced"] < considered["bottleneck"]


def test_a_profile_that_cannot_cost_the_plan_skips_rebalancing_and_the_replica_stands() -> None:
    short = synthetic_profile([0.1] * 5, [64] * 5, backward_times_s=[0.2] * 5,
                              activation_bytes=[64] * 5)  # fmt: skip
    h, reply = _replica_after(_plan(5), {"a": 1.0, "b": 1.0}, short.to_dict())
    assert _cuts(reply) is None
    (skipped,) = h.events("rebalance_skipped")
    assert "5 units, the plan 6" in skipped["error"]
    h, reply = _replica_after(_plan(5), {"a": 1.0, "b": 1.0}, {"format": "nonsense"})
    (skipped,) = h.events("rebalance_skipped")
    assert "the run's profile" in skipped["error"]


def test_the_client_sends_the_plans_profile_and_refuses_one_without_a_plan() -> None:
    spec = ModelSpec("mlp", {"dims": [8, 16, 16, 16, 16, 16, 4]})
    options = TrainOptions(
        optimizer={"name": "sgd", "lr": 0.1}, num_microbatches=3, plan=_plan(4),
        profile=PROFILE, recover=True, rebalance=0.2,
    )  # fmt: skip
    request = training_request(spec, options, 1, "tcp://client:9")
    assert request.profile is not None
    assert ModelProfile.from_dict(request.profile).backward_times(1) == PROFILE.backward_times(1)
    with pytest.raises(ConfigError, match="profile goes with plan"):
        TrainOptions(optimizer={"name": "sgd"}, num_microbatches=3, profile=PROFILE)
