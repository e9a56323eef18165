"""The coordinator's live re-partition costs links (FTPipeHD eq. 5's 2 x T_c): its
controller is built with the run's boundary sizes and measured links, and each look
has the links probed again for the next (in-process; no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support.coordinator_harness import SPEC, Harness
from zpipe.coordinator.commands import Command, MeasureLinks, RunJob
from zpipe.coordinator.links import MeasuredLink
from zpipe.coordinator.runs.async_repartition import build_controller
from zpipe.coordinator.runs.sync_training import SyncTrainingController
from zpipe.planner import ClusterLink, ClusterSpec
from zpipe.planner.cluster import ClusterDevice
from zpipe.planner.profile import synthetic_profile
from zpipe.planner.training_plan import TrainingPlan, TrainStage
from zpipe.training.repartition import RepartitionSettings

SETTINGS = RepartitionSettings(first=1, every=1, gain=0.1)
OUTPUTS = [1_000, 4_000_000, 1_000, 1_000, 1_000, 1_000]  # unit 1 crosses the cut at 2
PROFILE = synthetic_profile(
    [0.05] * 6, OUTPUTS, param_bytes=[100] * 6, backward_times_s=[0.1] * 6,
    activation_bytes=[10] * 6,
)  # fmt: skip
PLAN = TrainingPlan(
    algo="explicit", schedule="1f1b", num_units=6, microbatch_size=1, num_microbatches=3,
    stages=tuple(TrainStage((d,), a, b, (1,), 1) for d, a, b in
                 (("a", 0, 2), ("b", 2, 4), ("c", 4, 6))),
)  # fmt: skip
FAST = {"mbit_s": 8_000.0}  # 1 GB/s
SLOW = {"mbit_s": 80.0}  # 10 MB/s: 2 x 4 MB over it is 0.8 s, compute is 0.3 s


def test_the_controller_is_built_with_boundary_bytes_and_the_links_bandwidths() -> None:
    cluster = ClusterSpec(
        devices=tuple(ClusterDevice(d) for d in "abc"),
        links={("a", "b"): ClusterLink(80.0), ("b", "a"): ClusterLink(80.0),
               ("b", "c"): ClusterLink(8_000.0), ("c", "b"): ClusterLink(800.0)},
    )  # fmt: skip
    controller = build_controller(PLAN, SETTINGS, profile=PROFILE, cluster=cluster)
    assert controller.output_bytes == [float(b) for b in OUTPUTS]
    assert controller.bandwidths_bps is not None
    a_b, b_c = controller.bandwidths_bps
    assert a_b == pytest.approx(10e6)  # 80 Mbit/s both ways
    # 8,000 Mbit/s forward, 800 back: 2 / (1/8000 + 1/800) Mbit/s, in bytes
    assert b_c == pytest.approx(2 / (1 / 8_000 + 1 / 800) * 1e6 / 8)
    assert controller.reference_unit_s == pytest.approx([0.15] * 6)
    # the first look already keeps the big activation off the slow link
    look = controller.look(10, {})
    assert look.moves and look.bounds is not None and look.bounds[1] != 2
    assert look.reason == "eq. 7: nothing measured yet"
    # without a profile (nothing to size a boundary with) or links: eq. 5 without 2 x T_c
    blind = build_controller(PLAN, SETTINGS, profile=None, cluster=cluster)
    assert blind.output_bytes is None and blind.bandwidths_bps is None
    assert not blind.look(10, {}).moves
    unlinked = build_controller(PLAN, SETTINGS, profile=PROFILE, cluster=None)
    assert unlinked.output_bytes is None and unlinked.bandwidths_bps is None


class LinkHarness(Harness):
    """The coordinator harness with a link cache the test sets (the shell's probes'),
    and a stand-in for the probes a look starts: they find ``next_links``."""

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[tuple[str, str], dict[str, float]] = {}
        self.next_links: dict[tuple[str, str], dict[str, float]] = {}
        self.hold_probes = False  # True: a probe's job never comes back
        self.state.measured_links = lambda members: {
            pair: ClusterLink(bandwidth_mbps=link["mbit_s"])
            for pair, link in self.links.items()
            if {m.name for m in members} >= set(pair)
        }

    def _apply(self, commands: list[Command]) -> None:
        held = [
            c
            for c in commands
            if self.hold_probes and isinstance(c, RunJob) and isinstance(c.job, MeasureLinks)
        ]
        self.jobs.extend(c.job for c in held)
        super()._apply([c for c in commands if c not in held])

    def _job(self, job: Any) -> Any:
        if isinstance(job, MeasureLinks):
            chain = [m.name for m in job.members]
            self.links = {**self.links, **self.next_links}
            return {
                pair: MeasuredLink(bandwidth_bps=link["mbit_s"] * 1e6, rtt_s=0.001)
                for pair, link in self.next_links.items()
                if set(pair) <= set(chain)
            }
        return super()._job(job)


def _all_links(a_b: dict[str, float]) -> dict[tuple[str, str], dict[str, float]]:
    pairs = [(x, y) for x in "abc" for y in "abc" if x != y]
    return {p: (a_b if set(p) == {"a", "b"} else FAST) for p in pairs}


def _start(h: LinkHarness) -> tuple[int, SyncTrainingController]:
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
        partition=[[0, 2], [2, 4], [4, 6]],
    )  # fmt: skip
    run = h.core.run
    assert run is not None
    h.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
    h.client("run_go", run=run.run)
    h.answer_all("connected", list(run.devices), run=run.run)
    assert h.to_client("run_started")
    owner = h.state.current
    assert isinstance(owner, SyncTrainingController)
    return run.run, owner


def _look(h: LinkHarness, run: int, step: int) -> dict[str, Any]:
    """A look before ``step``: every stage ran 2 units at 0.15 s a unit per batch."""
    h.client("repartition", run=run, step=step, look=True)
    for name, (start, end) in zip("abc", ((0, 2), (2, 4), (4, 6)), strict=True):
        metrics = {"microbatches": 3 * step, "forward_s": 0.1 * step, "backward_s": 0.2 * step,
                   "start": start, "end": end}  # fmt: skip
        h.stage(name, "repartition_reply", run=run, step=step, phase="profile",
                error="", metrics=metrics)  # fmt: skip
    replies = h.to_client("repartitioned")
    assert replies and replies[-1].body["step"] == step
    body = replies[-1].body
    assert body["error"] == "", body["error"]
    return body


def test_a_look_costs_the_measured_links_and_has_them_probed_for_the_next() -> None:
    h = LinkHarness()
    h.links = _all_links(FAST)  # measured when the run was planned
    h.next_links = _all_links(SLOW)  # what the probes find at the first look: a-b slowed
    run, owner = _start(h)
    first = _look(h, run, 10)
    # equal compute, fast links: the cuts stay, and the links are probed again
    assert first.get("pause") is None and first["decision"]["bounds"] is None
    probes = [j for j in h.jobs if isinstance(j, MeasureLinks)]
    assert [[m.name for m in j.members] for j in probes] == [["a", "b", "c"]]
    assert h.events("repartition_links_measured")[0]["mbit_s"]["a>b"] == SLOW["mbit_s"]
    repartitioning = owner._repartitioning
    assert repartitioning is not None and repartitioning.controller is not None
    assert repartitioning.controller.output_bytes == [float(b) for b in OUTPUTS]
    # the next look costs the slow link: compute alone would keep the cuts
    second = _look(h, run, 20)
    assert second["pause"] is True
    bounds = second["decision"]["bounds"]
    assert bounds is not None and bounds[1] != 2
    assert second["decision"]["period_s"] == pytest.approx(0.8)
    # a look that moves probes nothing (the move's fetches have the links to themselves)
    assert len([j for j in h.jobs if isinstance(j, MeasureLinks)]) == 1


def test_a_probe_still_running_is_not_started_twice() -> None:
    h = LinkHarness()
    h.links = h.next_links = _all_links(FAST)
    h.hold_probes = True  # the first probe does not come back before the next look
    run, _ = _start(h)
    _look(h, run, 10)
    _look(h, run, 20)
    assert len([j for j in h.jobs if isinstance(j, MeasureLinks)]) == 1
    assert not h.events("repartition_links_measured")
