"""The coordinator's typed edge: a parsed message becomes its event by class, and a
request's optional fields have one default each, in the protocol class."""

from __future__ import annotations

import pytest

from zpipe.coordinator.events import (
    BulkChunkArrived,
    BulkOpenAsked,
    ClientRequest,
    RegisterAsked,
    StageSpoke,
    StallReported,
    event_of,
)
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.bulk import BulkChunk, BulkOpen
from zpipe.protocol.client_control import ClusterRequest, RunEnd, RunRequest, Stalled
from zpipe.protocol.stage_control import Heartbeat, Ready, Register, WeightsRequest

CHUNK = BulkChunk(name="a", token="t", transfer=1, seq=0, chunks=1, nbytes=0)


@pytest.mark.parametrize(
    ("message", "event"),
    [
        (Register(name="a", data_endpoint="tcp://a:1", info={}), RegisterAsked),
        (BulkOpen(name="a", token="t"), BulkOpenAsked),
        (CHUNK, BulkChunkArrived),
        (Stalled(run=1, waited_s=2.0, deadline_s=1.0), StallReported),
        (ClusterRequest(), ClientRequest),
        (RunEnd(run=1), ClientRequest),
        # the client asks a checkpoint with the stages' kind: still the client's request
        (WeightsRequest(run=1, step=0), ClientRequest),
        (Heartbeat(name="a", metrics={}), StageSpoke),
        (Ready(run=1, name="a", build_s=0.1), StageSpoke),
    ],
)
def test_a_parsed_message_becomes_its_event_by_class(
    message: WireMessage, event: type[object]
) -> None:
    made = event_of(b"route", None, message)
    assert type(made) is event
    assert made.message is message  # type: ignore[attr-defined]


def test_every_registration_gets_a_fresh_bulk_token() -> None:
    register = Register(name="a", data_endpoint="tcp://a:1", info={})
    first, second = (event_of(b"route", None, register) for _ in range(2))
    assert isinstance(first, RegisterAsked) and isinstance(second, RegisterAsked)
    assert first.bulk_token and first.bulk_token != second.bulk_token


def _request(**fields: object) -> RunRequest:
    return RunRequest(
        model={}, dtype="float32", sink_endpoint="tcp://c:9", wait_for_stages_s=0.0, **fields
    )  # type: ignore[arg-type]


def test_a_requests_micro_batch_size_is_its_own_else_its_plans_else_one() -> None:
    assert _request(microbatch_size=8).microbatch_size_or() == 8
    assert _request(microbatch_size=8).microbatch_size_or(4) == 8
    assert _request().microbatch_size_or(4) == 4  # a training plan's
    assert _request().microbatch_size_or() == 1  # nothing says: one sample
    assert _request().body().get("microbatch_size") is None  # the default is not sent


def test_a_requests_defaults_are_read_in_one_place() -> None:
    bare = _request()
    assert (bare.run_mode, bare.recovery_policy, bare.replication_kind) == (
        "infer",
        "lightweight",
        "global",
    )
    assert (bare.planner_name, bare.bucketing_mode, bare.train_settings) == ("pipeedge", "auto", {})
    given = _request(mode="train", recovery="heavy", replication="chain", planner="hpp")
    assert (given.run_mode, given.recovery_policy, given.replication_kind, given.planner_name) == (
        "train",
        "heavy",
        "chain",
        "hpp",
    )


def test_a_saved_requests_body_parses_back_to_the_same_request() -> None:
    request = _request(microbatch_size=4, stage_names=["a", "b"], train={"loss": "mse"})
    again = RunRequest.from_body(request.body())
    assert again == request and REGISTRY.parse(again.to_message()) == request
