"""A cluster on real kernel links: network namespaces, veth pairs, tbf-capped uplinks.

The coordinator runs in a namespace of its own, each stage in its own, the client
in the root namespace; every stage's uplink is capped at 20 Mbit/s by ``tc tbf``
(see zpipe/cluster/netlab.py), and a cut pulls a process's cable. Every run uses
the settings a user gets without flags (heartbeat, suspect and probe intervals),
must end exactly as training in one process does, and must declare no live stage
dead (the coordinator's JSON log is read for ``stage_dead``).

Needs root, ``ip`` and ``tc`` (CI runs as root); skipped with the reason otherwise.
The cuts are timed from the defaults: a stage is cut off past its suspect time but
inside its probe; the coordinator past the whole detection bound but inside the
stages' coordinator timeout (the coordinator alone is the one cut off: it must not
take every stage for dead).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_single_process,
)
from zpipe._errors import ZpipeError
from zpipe.client import TrainReport
from zpipe.cluster import DeviceSpec
from zpipe.cluster.netcluster import COORDINATOR, LabCluster
from zpipe.cluster.netlab import LinkCut, NetLab, unavailable_reason
from zpipe.cluster.netlayout import Node, TbfCap
from zpipe.config import Timeouts
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.transport.codec import Message, encode

COORDINATOR_NODE = "coord"  # the lab node the coordinator runs in (LabCluster's default)
DEFAULTS = Timeouts()  # what `python -m zpipe.coordinator` and `zpipe.stage` use without flags
UPLINK_MBIT = 20.0
STAGES = ("s0", "s1", "s2")
# suspected after this long without a heartbeat (3 s by default)
SUSPECT_S = DEFAULTS.suspect_after_intervals * DEFAULTS.heartbeat_interval_s
# a stage silent this long is suspected but still inside its probe (3.5 s by default).
# Half a heartbeat past the suspect time, not a whole one: the probe is sent once the
# last heartbeat is SUSPECT_S old (up to a heartbeat before the cut) and answered only
# after the link is back, so the probe's deadline leaves between half a heartbeat and
# one and a half for the stage's queued heartbeats to cross once the link is up
# (a whole heartbeat's cut left 0-1 s, and a CI run once declared the stage dead).
STAGE_CUT_S = SUSPECT_S + DEFAULTS.heartbeat_interval_s / 2
PROBE_S = DEFAULTS.probe_intervals * DEFAULTS.heartbeat_interval_s  # 2 s by default
assert SUSPECT_S < STAGE_CUT_S < SUSPECT_S + PROBE_S - DEFAULTS.heartbeat_interval_s
# past the whole detection bound, inside the stages' coordinator timeout (7 s of 10)
COORDINATOR_CUT_S = DEFAULTS.detection_bound_s + DEFAULTS.heartbeat_interval_s
assert COORDINATOR_CUT_S < DEFAULTS.coordinator_silence_s

# Wide enough that each stage's half is 8.5 MB of weights: a replica with momentum
# is 17 MB per stage (7 s at 20 Mbit/s), the final gather 8.5 MB per stage.
WIDTH = 1448
BULK = ModelSpec("mlp", {"dims": [12, WIDTH, WIDTH, WIDTH, 4]}, seed=17)


@pytest.fixture(scope="module")
def lab() -> Iterator[NetLab]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cap = TbfCap.at(UPLINK_MBIT)
    with NetLab([Node("coord"), *(Node(name, uplink=cap) for name in STAGES)]) as running:
        yield running


@pytest.fixture
def links(lab: NetLab) -> Iterator[NetLab]:
    """The module's lab with every link up, before and after the test."""
    lab.restore_links()
    yield lab
    lab.restore_links()


def _cluster(lab: NetLab, names: list[str]) -> LabCluster:
    return LabCluster(
        lab,
        [DeviceSpec(name) for name in names],
        heartbeat_interval_s=DEFAULTS.heartbeat_interval_s,
        suspect_after=DEFAULTS.suspect_after_intervals,
        probe_intervals=DEFAULTS.probe_intervals,
    )


Batches = list[tuple[torch.Tensor, torch.Tensor]]
OnStep = Callable[[int, float], None]


def _fit(
    cluster: LabCluster,
    spec: ModelSpec,
    batches: Batches,
    on_step: OnStep | None = None,
    **settings: Any,
) -> TrainReport:
    try:
        return cluster.fit(
            spec,
            batches,
            optimizer=SGD,
            num_microbatches=3,
            progress=False,
            on_step=on_step,
            recover=True,
            **settings,
        )
    except ZpipeError as exc:
        # the run's own error, with what the coordinator declared and who exited
        pytest.fail(f"fit raised {type(exc).__name__}: {exc}\n{_what_happened(cluster)}")


def _what_happened(cluster: LabCluster) -> str:
    deaths = [
        (e["stage"], e.get("reason"), e.get("silent_s"))
        for e in cluster.events(COORDINATOR, "stage_dead")
    ]
    exited = {
        name: cluster.logs(name).strip().splitlines()[-1:]
        for name in sorted(set(cluster.processes) - set(cluster.still_running()))
    }
    return (
        f"stages declared dead: {deaths}; processes that exited, with their last log line: {exited}"
    )


def _assert_no_live_stage_declared_dead(
    cluster: LabCluster, *, killed: tuple[str, ...] = ()
) -> None:
    """Only the killed stages were declared dead, and every other process still runs."""
    deaths = [e["stage"] for e in cluster.events(COORDINATOR, "stage_dead")]
    gone = set(cluster.processes) - set(killed) - set(cluster.still_running())
    assert deaths == list(killed) and not gone, _what_happened(cluster)


def _cut_at(
    cluster: LabCluster, step: int, name: str, seconds: float
) -> tuple[list[LinkCut], OnStep]:
    """An ``on_step`` that cuts ``name`` off for ``seconds`` once mini-batch ``step``
    is done, and the list the cut is put in."""
    cuts: list[LinkCut] = []

    def on_step(done: int, _loss: float) -> None:
        if done == step and not cuts:
            cuts.append(cluster.cut_for(name, seconds))

    return cuts, on_step


def test_a_replica_and_the_final_gather_of_tens_of_megabytes_cross_a_20_mbit_uplink(
    links: NetLab,
) -> None:
    batches = make_batches(4, 9, seed=41)
    want, want_losses = train_single_process(BULK, batches, SGD)
    with _cluster(links, ["s0", "s1"]) as cluster:
        report = _fit(cluster, BULK, batches, partition=[[0, 2], [2, 4]], replicate_every=2)
        kept = cluster.events(COORDINATOR, "replica_kept")
        _assert_no_live_stage_declared_dead(cluster)
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert report.recoveries == []
    # the premise: the replica after step 2 (weights and momentum) was tens of megabytes
    assert report.replicas[:2] == [0, 2]
    assert max(e["bytes"] for e in kept) > 30e6


def test_a_stage_cut_off_past_the_suspect_time_is_kept_and_the_run_ends_exactly(
    links: NetLab,
) -> None:
    batches = make_batches(6, 9, seed=42)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(links, ["s0", "s1"]) as cluster:
        cuts, on_step = _cut_at(cluster, 1, "s1", STAGE_CUT_S)
        report = _fit(
            cluster, SPEC, batches, on_step, partition=[[0, 2], [2, 4]], replicate_every=3
        )
        _assert_no_live_stage_declared_dead(cluster)
    # the premise: the cut was made mid-run, and the run outlasted it
    assert len(cuts) == 1 and cuts[0].restored.is_set()
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert report.recoveries == []


def test_the_coordinator_cut_off_alone_declares_no_stage_dead_and_the_run_ends_exactly(
    links: NetLab,
) -> None:
    batches = make_batches(6, 9, seed=43)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(links, ["s0", "s1"]) as cluster:
        cuts, on_step = _cut_at(cluster, 1, COORDINATOR, COORDINATOR_CUT_S)
        report = _fit(
            cluster, SPEC, batches, on_step, partition=[[0, 2], [2, 4]], replicate_every=3
        )
        _assert_no_live_stage_declared_dead(cluster)
    # the premise: the cut was made mid-run, and the run (its final gather at least) outlasted it
    assert len(cuts) == 1 and cuts[0].restored.is_set()
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert report.recoveries == []


def test_a_stage_killed_during_training_is_the_only_one_declared_dead(links: NetLab) -> None:
    batches = make_batches(6, 9, seed=44)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(links, list(STAGES)) as cluster:
        killed: list[str] = []

        def on_step(done: int, _loss: float) -> None:
            if done == 3 and not killed:
                killed.append("s1")
                cluster.kill("s1")

        report = _fit(
            cluster,
            SPEC,
            batches,
            on_step,
            partition=[[0, 1], [1, 3], [3, 4]],
            stage_names=list(STAGES),
            replicate_every=2,
        )
        _assert_no_live_stage_declared_dead(cluster, killed=("s1",))
    assert killed == ["s1"]
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert [r["dead"] for r in report.recoveries] == ["s1"]


def test_an_open_clusters_data_port_refuses_a_host_outside_the_plan(links: NetLab) -> None:
    # Issue 33: without keys a data port admits only the hosts its assignment names.
    # The client (root namespace) and s0 are s1's senders in turn; a process in the
    # coordinator's namespace is not, and its well-formed micro-batch is never read.
    spec = ModelSpec("mlp", {"dims": [6, 16, 8, 4]}, seed=9)
    batches = [load_layer_sequence(spec).example_input(3, seed=i) for i in range(2)]
    with torch.inference_mode():
        want = [build_full_model(spec)(*b)[0] for b in batches]
    with _cluster(links, ["s0", "s1"]) as cluster:
        members = {m["name"]: m for m in cluster.wait_for_stages(2, timeout_s=120)}
        outputs, _ = cluster.infer(spec, batches, stage_names=["s0", "s1"])
        target = str(members["s1"]["data_endpoint"])
        header = Message("data", {"run": 1, "mb": 0, "src": "s0"}, 1, (torch.ones(3, 16),))
        frames = [bytes(f) for f in encode(header)]
        code = (
            "import sys, time, zmq\n"
            "ctx = zmq.Context(); push = ctx.socket(zmq.PUSH); push.setsockopt(zmq.LINGER, 0)\n"
            f"push.connect({target!r}); push.send_multipart({frames!r})\n"
            "time.sleep(2); push.close(); ctx.term()\n"
        )
        intruder = links.popen(COORDINATOR_NODE, [cluster.python, "-c", code])
        assert intruder.wait(60) == 0
        deadline = time.monotonic() + 30
        while not cluster.events("s1", "peer_refused") and time.monotonic() < deadline:
            time.sleep(0.2)
        refused = cluster.events("s1", "peer_refused")
        # only the intruder's host, once per handshake it tried (libzmq may reconnect
        # and be refused again within its two seconds)
        assert refused and {e["peer"] for e in refused} == {links.address(COORDINATOR_NODE)}
        assert not cluster.events("s1", "dropped_message")  # refused, never read
        again, _ = cluster.infer(spec, batches, stage_names=["s0", "s1"])
        _assert_no_live_stage_declared_dead(cluster)
    for got in (outputs, again):
        for out, expected in zip(got, want, strict=True):
            torch.testing.assert_close(out[0], expected)
