"""Weights and replicas over a slow uplink never make a live stage look dead.

Stage ``b`` holds the big layer and reaches the coordinator over an emulated
1 Mbit/s uplink (``--uplink-mbps``: its control and bulk connections share it).
Its replica and its final weights take several times the time after which the
coordinator suspects a silent stage; the run must end with exact weights and
no stage declared dead. With the state on the control connection (the design
before the bulk connection) its heartbeats queue behind it and ``b`` is
declared dead: that is what this test reproduces if bulk is turned off.

The cluster runs with keys and roles: the coordinator attributes each chunk by
the stage's CURVE key as well as its token, and the bulk kinds pass the roles.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._support.training import SGD, assert_same_weights, make_batches, train_single_process
from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec
from zpipe.transport.roles import generate_keys_with_roles

# b holds units 1-2: a 512 x 512 layer, 1.1 MB of weights (2.1 MB with momentum).
BIG = ModelSpec("mlp", {"dims": [12, 512, 512, 4], "activation": "gelu"}, seed=3)
UPLINK_MBPS = 1.0
# Generous: on a loaded machine a starved stage must not look dead for being starved.
INTERVAL = 1.0
SUSPECT_AFTER = 3
PROBE_INTERVALS = 2


@pytest.mark.timeout(600)
def test_a_replica_and_the_final_weights_over_a_slow_uplink_kill_no_stage(
    tmp_path: Path,
) -> None:
    # one replica (before the first mini-batch), then the final weights: each crosses
    # the uplink alone (a replica after a step, with momentum, would take twice as long
    # and show nothing more)
    batches = make_batches(3, 8, seed=9)
    want, want_losses = train_single_process(BIG, batches, SGD)
    stage_bytes = (512 * 512 + 512 + 512 * 4 + 4) * 4
    transfer_s = stage_bytes * 8 / (UPLINK_MBPS * 1e6)
    # what this test is about: the weights take longer than a death takes to be found
    assert transfer_s > (SUSPECT_AFTER + PROBE_INTERVALS + 1) * INTERVAL
    devices = [DeviceSpec("a"), DeviceSpec("b", uplink_mbps=UPLINK_MBPS)]
    keys = tmp_path / "keys"
    generate_keys_with_roles(keys, ["coordinator", "client", "a", "b"])
    with LocalCluster(
        devices,
        heartbeat_interval_s=INTERVAL,
        suspect_after=SUSPECT_AFTER,
        probe_intervals=PROBE_INTERVALS,
        measure_links=False,
        log_dir=tmp_path,
        keys_dir=keys,
    ) as cluster:
        report = cluster.fit(
            BIG,
            batches,
            optimizer=SGD,
            num_microbatches=2,
            partition=[[0, 1], [1, 3]],
            recover=True,
            replicate_every=3,
            progress=False,
        )
        coordinator_log = cluster.logs("coordinator")
        stage_log = cluster.logs("b")
    assert report.steps == len(batches) and report.replicas == [0]
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert "stage_dead" not in coordinator_log, "a live stage was declared dead"
    assert "replica_kept" in coordinator_log
    # the state did cross on the bulk connection (chunks), not on the control one
    assert '"bulk_opened"' in coordinator_log
    assert "bulk_refused" not in coordinator_log + stage_log
    assert "role_refused" not in coordinator_log
