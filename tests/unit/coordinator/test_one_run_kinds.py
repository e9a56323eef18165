"""One run at a time for every kind of run start: a ``gen_run_request`` or a
``lossy_run_request`` of another client while a run is in flight is refused with
``run_failed`` naming that run (it used to replace the run silently: issue 33); the
client whose run it is may replace its own; a gone client's run gives way. Pure: the
in-process coordinator fed events."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests._support.coordinator_harness import CLIENT, SPEC, Harness, typed
from zpipe.client.runs.lossy import lossy_request
from zpipe.coordinator.commands import AwaitStages, Command, PlanLossy, ReachClient, RunJob
from zpipe.coordinator.events import ClientRequest, JobDone
from zpipe.lossy.data import Dataset
from zpipe.lossy.partition import partition
from zpipe.lossy.simulate import RunConfig, prepare_run
from zpipe.models import ModelSpec
from zpipe.protocol import WireMessage

NAMES = ["a", "b", "c"]
OTHER = b"client-other"
LLAMA = ModelSpec.preset("llama-tiny")


def _gen_request(names: list[str]) -> WireMessage:
    body = {
        "model": LLAMA.to_dict(), "sink_endpoint": "tcp://other:9", "max_context": 32,
        "max_sequences": 4, "steps_in_flight": 3, "chunk_tokens": 8,
        "wait_for_stages_s": 0.0, "stage_names": names,
    }  # fmt: skip
    return typed("gen_run_request", body)


def _lossy_request() -> WireMessage:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 6)), rng.integers(0, 3, size=40)
    data = Dataset("random", x, y, x[:4], y[:4])
    cfg = RunConfig(
        allocation="hybrid", n_devices=2, hidden=(4,), batch_size=4, n_data=3, mapping="identity"
    )
    return lossy_request(prepare_run(cfg, data), data, stages=2, request_id=99)


def _from(h: Harness, route: bytes, message: WireMessage) -> None:
    h.feed(ClientRequest(route, None, message))


def _to(h: Harness, route: bytes, kind: str) -> list[Any]:
    return [s.wire for s in h.sent if s.to == route and s.wire.kind == kind]


def _setups(h: Harness, kind: str) -> int:
    return sum(len(h.to(name, kind)) for name in NAMES)


def test_another_client_s_generation_start_is_refused_while_a_stream_is_in_flight() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    _from(h, OTHER, _gen_request(NAMES))
    (refused,) = _to(h, OTHER, "run_failed")
    assert refused.body["in_flight"] == run and f"run {run} " in refused.body["error"]
    assert [j for j in h.jobs if isinstance(j, ReachClient)]  # it looked for the client
    assert _setups(h, "gen_setup") == 0 and h.events("run_replaced") == []
    assert h.core.run is not None and h.core.run.run == run  # the stream goes on


def test_the_same_client_s_generation_start_replaces_its_own_run() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    request = _gen_request(NAMES)
    _from(h, CLIENT, request)
    assert _to(h, CLIENT, "run_failed") == []
    assert _setups(h, "gen_setup") == 3
    assert [e["previous"] for e in h.events("run_replaced")] == [run]


def test_a_generation_run_in_flight_refuses_another_client_s_generation_start() -> None:
    h = Harness()
    for name in NAMES:
        h.register(name)
    _from(h, CLIENT, _gen_request(NAMES))
    first = h.to("a", "gen_setup")[0].body["run"]
    h.answer_all("gen_ready", NAMES, run=first)
    assert h.to_client("gen_run_ready")
    _from(h, OTHER, _gen_request(NAMES))
    (refused,) = _to(h, OTHER, "run_failed")
    assert refused.body["in_flight"] == first
    assert _setups(h, "gen_setup") == 3  # nothing set up for the refused one


def test_a_gone_client_s_run_gives_way_to_another_client_s_generation_run() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    h.gone.add(CLIENT)  # its connection dropped
    _from(h, OTHER, _gen_request(NAMES))
    assert [e["run"] for e in h.events("run_abandoned")] == [run]
    h.answer_all("metrics", NAMES, run=run)  # ended as run_end ends it
    assert _to(h, OTHER, "run_failed") == [] and _setups(h, "gen_setup") == 3


def test_another_client_s_lossy_start_is_refused_while_a_stream_is_in_flight() -> None:
    h = Harness()
    run = h.start_stream(NAMES)
    _from(h, OTHER, _lossy_request())
    (refused,) = _to(h, OTHER, "run_failed")
    assert refused.body["in_flight"] == run and f"run {run} " in refused.body["error"]
    assert _setups(h, "lossy_setup") == 0 and h.events("run_replaced") == []
    assert h.core.run is not None and h.core.run.run == run


def test_the_same_client_s_lossy_start_is_not_refused() -> None:
    h = Harness()
    h.start_stream(NAMES)
    _from(h, CLIENT, _lossy_request())
    assert h.events("run_refused") == []
    assert all("in_flight" not in m.body for m in h.to_client("run_failed"))


class HoldingHarness(Harness):
    """Holds the stage waits (``AwaitStages``) while ``holding``: a start that waits
    for its stages while another client's run is admitted meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = False
        self.held: list[RunJob] = []

    def _apply(self, commands: list[Command]) -> None:
        rest: list[Command] = []
        for command in commands:
            waits = isinstance(command, RunJob) and isinstance(command.job, AwaitStages)
            if self.holding and waits:
                self.held.append(command)  # type: ignore[arg-type]
            else:
                rest.append(command)
        super()._apply(rest)

    def release(self) -> None:
        for command in self.held:
            self.feed(JobDone(command.tag, self._job(command.job)))
        self.held = []


def test_a_run_admitted_while_a_generation_start_waited_for_stages_refuses_it() -> None:
    h = HoldingHarness()
    for name in NAMES:
        h.register(name)
    h.holding = True
    _from(h, OTHER, _gen_request(NAMES))  # nothing in flight: it waits for its stages
    assert len(h.held) == 1
    h.holding = False
    run = h.start_stream(NAMES)  # meanwhile another client's stream is admitted
    h.release()
    (refused,) = _to(h, OTHER, "run_failed")
    assert refused.body["in_flight"] == run
    assert _setups(h, "gen_setup") == 0 and h.core.run is not None and h.core.run.run == run


# ---------------------------------------------------------------- a lossy run in flight


class LossyHarness(Harness):
    """Plans a lossy run at once (the genetic search's stand-in: the allocation alone)."""

    def _job(self, job: Any) -> Any:
        if isinstance(job, PlanLossy):
            return partition(job.allocation, job.layer_sizes, job.n_devices)
        return super()._job(job)


def _run_request(h: Harness, route: bytes, names: list[str]) -> None:
    body = {
        "model": SPEC.to_dict(), "dtype": "float32", "sink_endpoint": "tcp://other:9",
        "wait_for_stages_s": 0.0, "stage_names": names, "planner": "even",
        "request_id": f"req-{len(h.sent)}",
    }  # fmt: skip
    _from(h, route, typed("run_request", body))


def test_a_lossy_run_set_up_is_in_flight_until_it_is_answered() -> None:
    """A lossy run has no controller as the current run: another client's stream
    took its stages at its set-up, silently."""
    h = LossyHarness()
    for name in ("a", "b"):
        h.register(name)
    _from(h, CLIENT, _lossy_request())
    run = h.to("a", "lossy_setup")[0].body["run"]
    flight = h.state.lossy_in_flight
    assert flight is not None and (flight.run, flight.client) == (run, CLIENT)
    _run_request(h, OTHER, ["a", "b"])
    (refused,) = _to(h, OTHER, "run_failed")
    assert refused.body["in_flight"] == run and h.to("a", "assign") == []
    h.answer_all("lossy_ready", ["a", "b"], run=run, device=0, error="no room")
    assert [m.body.get("in_flight") for m in h.to_client("run_failed")] == [None]
    assert h.state.lossy_in_flight is None  # answered: over
    _run_request(h, OTHER, ["a", "b"])
    assert len(_to(h, OTHER, "run_failed")) == 1 and h.to("a", "assign")


def test_a_gone_client_s_lossy_run_gives_way() -> None:
    h = LossyHarness()
    for name in ("a", "b"):
        h.register(name)
    _from(h, CLIENT, _lossy_request())
    run = h.to("a", "lossy_setup")[0].body["run"]
    h.gone.add(CLIENT)
    _run_request(h, OTHER, ["a", "b"])
    assert [e["run"] for e in h.events("run_abandoned")] == [run]
    assert _to(h, OTHER, "run_failed") == [] and h.to("a", "assign")
