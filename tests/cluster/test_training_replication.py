"""Chain and global replication at once, on real stage processes killed mid-run:
two adjacent stages die and the run goes on from the global copy; heavy recovery
gathers every unit at the coordinator. Both end as an uninterrupted run
(``exact`` consistency)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_single_process,
)
from tests._support.training_recovery import _cluster, _events, _learnable_batches
from zpipe.cluster import DeviceSpec, LocalCluster

NAMES = ["a", "b", "c", "d"]
PARTITION = [[0, 1], [1, 2], [2, 3], [3, 4]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with _cluster(NAMES) as shared:
        yield shared


def _bring_back(cluster: LocalCluster, names: list[str]) -> None:
    """Start the killed stages again, so the next test has every device."""
    for name in names:
        cluster.start_stage(DeviceSpec(name))
    cluster.wait_for_stages(len(NAMES), timeout_s=120)


def test_two_adjacent_stages_killed_resume_from_the_global_copy(cluster: LocalCluster) -> None:
    batches = make_batches(10, 9, seed=31)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    since = len(cluster.logs("coordinator"))
    # chain replicas before mini-batches 0, 2, 4, 6, 8 and global copies before 0, 4;
    # after mini-batch 6, b and c die: c held b's backup, so b's units are only in
    # the global copy taken before mini-batch 4
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 6 and not killed:
            killed.extend(["b", "c"])
            cluster.kill("b")
            cluster.kill("c")

    try:
        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=3, progress=False, on_step=on_step,
            partition=PARTITION, stage_names=NAMES, recover=True, replication="chain",
            chain_every=2, global_every=4,
        )  # fmt: skip
    finally:
        _bring_back(cluster, killed)
    log = cluster.logs("coordinator")[since:]
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    (recovery,) = report.recoveries
    assert recovery["resumed_from"] == 4 and recovery["from_global"] is True
    assert _events(log, "restored_from_global")
    (planned,) = _events(log, "restore_planned")
    assert planned["from_coordinator"] == 4 and planned["from_peers"] == 0
    assert report.training_plan is not None
    assert set(report.training_plan.devices) == {"a", "d"}


def test_heavy_recovery_gathers_every_unit_at_the_coordinator_first(
    cluster: LocalCluster,
) -> None:
    batches = make_batches(8, 9, seed=37)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    since = len(cluster.logs("coordinator"))
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 4 and not killed:
            killed.append("b")
            cluster.kill("b")

    try:
        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=3, progress=False, on_step=on_step,
            partition=PARTITION, stage_names=NAMES, recover=True, replication="chain",
            chain_every=3, recovery="heavy",
        )  # fmt: skip
    finally:
        _bring_back(cluster, killed)
    log = cluster.logs("coordinator")[since:]
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert [(r["dead"], r["resumed_from"]) for r in report.recoveries] == [("b", 3)]
    (gathered,) = _events(log, "heavy_gathered")
    # a's snapshot and c's (its own and its backup of b's) came to the coordinator;
    # d's units it held already (d backs up to it)
    assert set(gathered["holders"]) == {"a", "c"}  # type: ignore[arg-type]
    assert int(gathered["bytes"]) > 0  # type: ignore[call-overload]
    # every unit of every device of the new plan came from the coordinator (the heavy
    # re-plan may put two devices in a data-parallel group: both get their units)
    assert report.training_plan is not None
    units = sum(st.end - st.start for st in report.training_plan.stages for _ in st.devices)
    (planned,) = _events(log, "restore_planned")
    assert planned["from_coordinator"] == units and planned["local"] == 0


def test_fast_consistency_over_chain_replicas_takes_the_dead_units_from_the_backup(
    cluster: LocalCluster,
) -> None:
    adam = {"name": "adam", "lr": 0.01}
    batches = _learnable_batches()[:10]
    _, want_losses = train_single_process(SPEC, batches, adam)
    since = {n: len(cluster.logs(n)) for n in ("coordinator", "c")}
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 5 and not killed:
            killed.append("b")
            cluster.kill("b")

    report = cluster.fit(
        SPEC, batches, optimizer=adam, num_microbatches=3, progress=False, on_step=on_step,
        partition=PARTITION, stage_names=NAMES, recover=True, replication="chain",
        chain_every=4, consistency="fast",
    )  # fmt: skip
    # every mini-batch trained once; up to the failure the run is the uninterrupted one
    assert len(report.losses) == len(batches)
    assert report.losses[:6] == pytest.approx(want_losses[:6], rel=1e-5)
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["replica"]) == ("b", 4)
    # b's unit came from the backup c kept of it: the coordinator never held it
    log = cluster.logs("coordinator")[since["coordinator"] :]
    (fast,) = _events(log, "fast_resume")
    assert fast["units_from_replica"] == [1]
    assert _events(log, "replica_kept")[0]["holders"] == {
        "a": "b",
        "b": "c",
        "c": "d",
        "d": "coordinator",
    }
