"""A stage's bulk budget from the state of the units a plan gives it (issue 33,
finding 5), with made-up plans: pure, no sockets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests._support.coordinator_harness import Harness
from zpipe.coordinator.bulk_budget import (
    PLANNED_STATE_COPIES,
    PLANNED_STATE_MARGIN_BYTES,
    planned_budget,
    planned_state,
)
from zpipe.coordinator.commands import Send
from zpipe.coordinator.events import BulkChunkArrived, RegisterAsked
from zpipe.models import ModelSpec
from zpipe.models.registry import load_layer_sequence
from zpipe.models.size import parameter_bytes
from zpipe.planner.plan import Plan, StagePlan
from zpipe.protocol.bulk import BulkChunk
from zpipe.protocol.stage_control import Register
from zpipe.transport.bulk import chunk_count
from zpipe.transport.codec import Message

GIB = 1 << 30
MLP = {"family": "mlp", "config": {"dims": [32, 64, 64, 64, 16]}}


def mlp_bytes(start: int, end: int) -> int:
    spec = ModelSpec.from_dict(MLP)
    nbytes = parameter_bytes(load_layer_sequence(spec), start, end)
    assert nbytes is not None
    return nbytes


def inference_run(*stages: tuple[str, int, int], model: Any = MLP) -> SimpleNamespace:
    plan = Plan("made-up", 4, tuple(StagePlan(d, s, e) for d, s, e in stages))
    return SimpleNamespace(
        run=1,
        epoch=0,
        plan=plan,
        training_plan=None,
        devices=[d for d, _, _ in stages],
        request=SimpleNamespace(model=model),
    )


def test_a_budget_is_the_held_state_s_copies_and_a_margin_never_past_the_rule_before_a_plan() -> (
    None
):
    assert planned_budget(None, 2 * GIB) == 2 * GIB  # not sized: the rule before a plan
    assert planned_budget(0, 2 * GIB) == PLANNED_STATE_MARGIN_BYTES  # no units
    assert planned_budget(10 << 20, 2 * GIB) == PLANNED_STATE_COPIES * (10 << 20) + (64 << 20)
    assert planned_budget(GIB, 2 * GIB) == 2 * GIB


def test_each_device_of_a_plan_is_sized_by_the_units_it_holds() -> None:
    run = inference_run(("a", 0, 1), ("b", 1, 4))
    assert planned_state(run, MLP) == {"a": mlp_bytes(0, 1), "b": mlp_bytes(1, 4)}
    assert planned_state(None, MLP) is None  # no run: no plan


def test_a_training_plan_s_groups_each_hold_their_stage_s_units() -> None:
    stages = (
        SimpleNamespace(devices=("a", "a2"), start=0, end=2),
        SimpleNamespace(devices=("b",), start=2, end=4),
    )
    run = inference_run(("a", 0, 2), ("b", 2, 4))
    run.training_plan = SimpleNamespace(stages=stages)
    run.devices = ["a", "a2", "b", "spare"]
    held = planned_state(run, MLP)
    assert held == {
        "a": mlp_bytes(0, 2),
        "a2": mlp_bytes(0, 2),
        "b": mlp_bytes(2, 4),
        "spare": None,
    }


def test_a_model_that_cannot_be_sized_unbuilt_keeps_the_rule_before_a_plan() -> None:
    user_code = {"family": "sequential", "config": {"factory": "os:system"}}
    assert planned_state(inference_run(("a", 0, 4)), user_code) == {"a": None}
    assert planned_state(inference_run(("a", 0, 4)), {"family": "nope"}) == {"a": None}
    assert planned_state(inference_run(("a", 0, 4)), None) == {"a": None}


def _register(harness: Harness, name: str) -> None:
    register = Register(name=name, data_endpoint=f"tcp://{name}:1", info={})
    harness.feed(RegisterAsked(name.encode(), None, register, bulk_token=f"tok-{name}"))


def _announce(name: str, nbytes: int, transfer: int = 1) -> BulkChunkArrived:
    """The first chunk of a transfer announced at ``nbytes`` (one frame)."""
    chunk = BulkChunk(
        name=name,
        token=f"tok-{name}",
        transfer=transfer,
        seq=0,
        chunks=chunk_count(nbytes, 1 << 20),
        nbytes=nbytes,
        frames=[nbytes],
        tensors=(torch.zeros(1 << 20, dtype=torch.uint8),),
    )
    return BulkChunkArrived(f"{name}-bulk".encode(), None, chunk)


def _refused(harness: Harness, event: BulkChunkArrived) -> list[Message]:
    sent = [c.wire for c in harness.feed(event) if isinstance(c, Send)]
    return [m for m in sent if m.kind == "bulk_refused"]


def test_a_stage_the_plan_gives_no_units_is_refused_a_1_gib_announcement_at_once() -> None:
    """The hostile bench's fake stage: registered, in no plan, four transfers
    announced at 1 GiB. Before any plan the rule of one whole message (2 GiB) admits
    the first; with a run planned, none."""
    harness = Harness(interval=1.0)
    for name in ("a", "b", "mallory"):
        _register(harness, name)
    assert _refused(harness, _announce("mallory", GIB, transfer=1)) == []  # before a plan
    harness.state.current = SimpleNamespace(run=inference_run(("a", 0, 2), ("b", 2, 4)))
    [refused] = _refused(harness, _announce("mallory", GIB, transfer=2))
    assert "past its budget" in refused.body["reason"]
    link = harness.state.bulk.get("mallory")
    assert link is not None and link.inbox.budget_bytes == PLANNED_STATE_MARGIN_BYTES
    # a planned stage's own state, even four copies and the margin, still goes
    assert _refused(harness, _announce("a", PLANNED_STATE_MARGIN_BYTES)) == []
    past = PLANNED_STATE_COPIES * mlp_bytes(2, 4) + PLANNED_STATE_MARGIN_BYTES + 1
    assert _refused(harness, _announce("b", past)) != []
    # the run over: the rule before a plan again
    harness.state.current = None
    assert _refused(harness, _announce("mallory", GIB, transfer=1)) == []  # sent anew
