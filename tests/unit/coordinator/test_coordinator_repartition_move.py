"""A move decided at the look before the pause is carried out in one ``move`` phase.

Before, the coordinator asked every stage to flush (``prepare``), waited for all of
them, then asked them to fetch (``fetch``), then to commit: the stages that flush
early (the last ones) sat idle until the first stage drained, and the fetches and
the new shards' building waited behind the slowest flush. Now, when a look already
decided the cuts, the stages get ``move`` (flush, snapshot, fetch as each holder
flushes, build) and then ``commit``. A request without a look before it still runs
``prepare``, ``fetch``, ``commit`` (the decision needs the flush's counters). Pure:
the in-process coordinator, no sockets.
"""

from __future__ import annotations

from typing import Any

from tests._support.coordinator_harness import SPEC, Harness
from zpipe.planner import ClusterLink
from zpipe.planner.profile import synthetic_profile
from zpipe.training.repartition import RepartitionSettings

SETTINGS = RepartitionSettings(first=1, every=1, gain=0.1)
OUTPUTS = [1_000, 4_000_000, 1_000, 1_000, 1_000, 1_000]  # unit 1 crosses the cut at 2
PROFILE = synthetic_profile(
    [0.05] * 6, OUTPUTS, param_bytes=[100] * 6, backward_times_s=[0.1] * 6,
    activation_bytes=[10] * 6,
)  # fmt: skip
# a-b at 80 Mbit/s: 2 x 4 MB over it costs more than moving the cut off it
SLOW_AB = {(x, y): ClusterLink(80.0 if {x, y} == {"a", "b"} else 8_000.0)
           for x in "abc" for y in "abc" if x != y}  # fmt: skip
PLANNED = ((0, 2), (2, 4), (4, 6))
COUNTERS = {
    name: {"microbatches": 30, "forward_s": 1.0, "backward_s": 2.0, "start": a, "end": b}
    for name, (a, b) in zip("abc", PLANNED, strict=True)
}


def _start(h: Harness) -> int:
    h.state.measured_links = lambda members: SLOW_AB  # type: ignore[method-assign]
    for name in "abc":
        h.register(name)
        member = h.state.membership.get(name)
        assert member is not None
        h.state.profiles.put(SPEC, 1, "float32", member, PROFILE, train=True)
    train = {"num_microbatches": 3, "optimizer": {"name": "sgd", "lr": 0.1},
             "repartition": SETTINGS.to_dict()}  # fmt: skip
    h.client(
        "run_request", model=SPEC.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=list("abc"), train=train,
        partition=[list(p) for p in PLANNED],
    )  # fmt: skip
    run = h.core.run
    assert run is not None, h.events("run_failed")
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    return run.run


def _answer(h: Harness, run: int, step: int, phase: str) -> list[dict[str, Any]]:
    """Every stage's last request is of ``phase``: answer it (with the counters where
    the phase reports them); the requests."""
    bodies = []
    for name in "abc":
        asked = h.to(name, "repartition_request")
        assert asked and asked[-1].body["phase"] == phase, (name, [a.body["phase"] for a in asked])
        bodies.append(asked[-1].body)
        metrics = COUNTERS[name] if phase in ("profile", "prepare", "move") else {}
        h.stage(name, "repartition_reply", run=run, step=step, phase=phase, error="",
                metrics=metrics)  # fmt: skip
    return bodies


def _phases(h: Harness, name: str) -> list[str]:
    return [m.body["phase"] for m in h.to(name, "repartition_request")]


def test_a_move_the_look_decided_flushes_fetches_and_builds_in_one_phase() -> None:
    h = Harness()
    run = _start(h)
    h.client("repartition", run=run, step=10, look=True)
    _answer(h, run, 10, "profile")
    (look,) = h.to_client("repartitioned")
    assert look.body["pause"] is True  # the slow link moves the cut: the client pauses
    decided = look.body["decision"]["bounds"]
    h.client("repartition", run=run, step=10)
    moves = _answer(h, run, 10, "move")
    # each stage is told the new cuts and where its units come from, in the same request
    assert all(m["bounds"] == decided for m in moves)
    fetched = {(e["start"], e["end"]) for m in moves for e in m["fetch"]}
    assert {u for a, b in fetched for u in range(a, b)} == set(range(6))
    commits = _answer(h, run, 10, "commit")
    assert all(c["bounds"] == decided and c["plan_epoch"] == 1 for c in commits)
    (done,) = h.to_client("repartitioned")[1:]
    assert done.body["error"] == "" and done.body["bounds"] == decided
    for name in "abc":
        assert _phases(h, name) == ["profile", "move", "commit"], name
    # both decisions name the pause's step (the bench splits the pause by it): the
    # look's (no flush) and the move's
    considered = h.events("repartition_considered")
    assert [(e["step"], e.get("flush")) for e in considered] == [(10, False), (10, None)]


def test_a_request_without_a_look_before_it_still_prepares_then_fetches() -> None:
    h = Harness()
    run = _start(h)
    h.client("repartition", run=run, step=10)
    _answer(h, run, 10, "prepare")
    (phase,) = {m.body["phase"] for m in (h.to(n, "repartition_request")[-1] for n in "abc")}
    if phase == "fetch":  # the flush's counters moved the cuts
        _answer(h, run, 10, "fetch")
    _answer(h, run, 10, "commit")
    (done,) = h.to_client("repartitioned")
    assert done.body["error"] == ""
    assert "move" not in _phases(h, "a")
