"""A coordinator restarted between two global copies still falls back to the older one.

Real processes: chain replication with a global copy (FTPipeHD runs both). The
coordinator is killed after mini-batch 6 (chain replicas before 0, 2, 4, 6, global
copies before 0 and 4), and two adjacent stages die while it is down: c held b's
backup, so b's units are only in the global copy of mini-batch 4, which only the
killed coordinator's state directory (``global.state``) still has. Training must
end exactly as an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.coordinator_restart import _cluster, _events
from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_single_process,
)
from zpipe.coordinator.persistence import StateStore

NAMES = ["a", "b", "c", "d"]


def test_a_restarted_coordinator_falls_back_to_the_global_copy_on_disk(tmp_path: Path) -> None:
    batches = make_batches(10, 9, seed=34)
    want, want_losses = train_single_process(SPEC, batches, SGD)
    with _cluster(NAMES, tmp_path / "state") as cluster:
        done = False

        def on_step(step: int, _loss: float) -> None:
            nonlocal done
            if step == 6 and not done:
                done = True
                cluster.kill("coordinator")
                cluster.kill("b")  # c held b's backup: both die while it is down
                cluster.kill("c")
                cluster.restart_coordinator()

        report = cluster.fit(
            SPEC, batches, optimizer=SGD, num_microbatches=3, progress=False,
            on_step=on_step, recover=True, partition=[[0, 1], [1, 2], [2, 3], [3, 4]],
            stage_names=NAMES, replication="chain", chain_every=2, global_every=4,
        )  # fmt: skip
        log = cluster.logs("coordinator")
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    restored = _events(log, "coordinator_restored")[-1]
    assert restored["replica"]["step"] == 6  # type: ignore[index]
    assert restored["fallback"]["step"] == 4  # type: ignore[index]
    (recovery,) = report.recoveries
    assert recovery["resumed_from"] == 4 and recovery["from_global"] is True
    assert _events(log, "restored_from_global")
    newest = StateStore(tmp_path / "state").load_global()
    assert newest is not None and newest.complete
