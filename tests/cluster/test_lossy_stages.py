"""EdgePipe runs on ordinary stages (``python -m zpipe.stage``) and the ordinary coordinator.

The session's shared cluster (three stages, tests/cluster/conftest.py) runs every test:
the coordinator partitions and maps, the stages run their partial layers and
exchange partials over their data sockets. Models and runs are tiny, so the
numbers compared are exact: a lossless run is the unpartitioned network under
sequential SGD, and a lossy run (seeded drops, no retransmission) is its
in-process simulation message by message.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zpipe._errors import PipelineError
from zpipe.cli import lossy as experiment
from zpipe.client.runs.lossy import StagesLossyResult, lossy_request, run_lossy
from zpipe.cluster import LocalCluster
from zpipe.coordinator.runs.lossy_probe import PROBES_PER_LINK
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.evaluation import EvalSpec
from zpipe.lossy.links import Direction, Recovery, Traffic, Transmit, deliver
from zpipe.lossy.partial import mlp_forward_backward
from zpipe.lossy.simulate import (
    PreparedRun,
    RunConfig,
    final_eval_index,
    prepare_run,
    run_training,
)
from zpipe.lossy.trace import TrainingTrace, evaluate_in_process, train_in_process
from zpipe.protocol.client_control import RunFailed
from zpipe.stage.executors.lossy_recovery import WireCounts
from zpipe.transport.emulation import LossKey

pytestmark = pytest.mark.timeout(180)

FEATURES, CLASSES = 12, 5
# Region 80 m gives lossy links (mean reception about 0.6) for three devices.
BASE = RunConfig(
    allocation="vertical",
    n_devices=3,
    region_m=80.0,
    seed=3,
    hidden=(8, 6),
    lr=0.1,
    batch_size=5,
    n_data=4,
    mapping="exhaustive",
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, FEATURES))
    y = rng.integers(0, CLASSES, size=60)
    y[0] = CLASSES - 1  # every class appears: the output layer has CLASSES neurons
    return Dataset("random", x, y, x[:10], y[:10])


@pytest.fixture(scope="module")
def stages(cluster: LocalCluster) -> list[str]:
    cluster.wait_for_stages(3, timeout_s=60)
    return [d.name for d in cluster.devices]


def _run(
    cluster: LocalCluster, prepared: PreparedRun, data: Dataset, **options: Any
) -> StagesLossyResult:
    async def go() -> StagesLossyResult:
        async with cluster.client() as client:
            return await run_lossy(client, prepared, data, **options)

    return asyncio.run(go())


def _assert_same_trace(got: TrainingTrace, want: TrainingTrace) -> None:
    assert got.arrivals == want.arrivals  # the same partials reached the same receivers
    assert {k: v.as_dict() for k, v in got.traffic.items()} == {
        k: v.as_dict() for k, v in want.traffic.items()
    }
    assert dict(got.propagation.expected) == dict(want.propagation.expected)
    assert dict(got.propagation.received) == dict(want.propagation.received)
    assert got.losses.keys() == want.losses.keys()
    # torch (stages) and numpy (simulation) may sum in another order: float64 closeness
    np.testing.assert_allclose(list(got.losses.values()), list(want.losses.values()), rtol=1e-10)
    for (w1, b1), (w2, b2) in zip(got.params, want.params, strict=True):
        np.testing.assert_allclose(w1, w2, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(b1, b2, rtol=1e-10, atol=1e-13)


def test_lossless_run_on_stages_equals_sequential_sgd(
    cluster: LocalCluster, stages: list[str], data: Dataset
) -> None:
    # Horizontal pipelines one mini-batch at a time (period 2L - 1), so equation 3's
    # stashed weights are the latest ones: plain SGD on the whole network.
    cfg = replace(BASE, allocation="horizontal", lossless=True, n_data=3)
    prepared = prepare_run(cfg, data)
    result = _run(cluster, prepared, data, stage_names=stages)
    assert result.stages == stages
    assert result.alloc == prepared.alloc  # Algorithms 1 and 2 ran at the coordinator
    params = [(w.copy(), b.copy()) for w, b in prepared.params]
    for i in range(1, prepared.n_data + 1):
        x, y = prepared.batch(data, i)
        loss, _, grads = mlp_forward_backward(params, x, y)
        assert result.trace.losses[i] == pytest.approx(loss, rel=1e-10)
        params = [
            (w - cfg.lr * dw, b - cfg.lr * db)
            for (w, b), (dw, db) in zip(params, grads, strict=True)
        ]
    for (w, b), (w_got, b_got) in zip(params, result.trace.params, strict=True):
        np.testing.assert_allclose(w_got, w, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(b_got, b, rtol=1e-10, atol=1e-13)
    assert result.trace.propagation.rate("forward", "backward", "share") == 1.0
    assert result.late == 0 and not any(result.protocol_errors.values())


def test_lossless_pipelined_hybrid_on_stages_equals_the_engine(
    cluster: LocalCluster, stages: list[str], data: Dataset
) -> None:
    # Several mini-batches in flight: equation 3's weight stashing, as the in-process
    # engine (tested against the whole network) does it.
    prepared = prepare_run(replace(BASE, allocation="hybrid", lossless=True, n_data=5), data)
    result = _run(cluster, prepared, data, stage_names=stages)
    _assert_same_trace(result.trace, train_in_process(prepared, data))
    assert result.late == 0


@pytest.mark.parametrize(
    ("allocation", "recovery"),
    [
        ("vertical", Recovery("none")),
        ("hybrid", Recovery("none")),
        ("hybrid", Recovery("rtx", copies=2)),
        ("hybrid", Recovery("ack", max_attempts=3)),
        ("horizontal", Recovery("none")),
    ],
)
def test_lossy_run_on_stages_equals_its_simulation(
    cluster: LocalCluster, stages: list[str], data: Dataset, allocation: str, recovery: Recovery
) -> None:
    prepared = prepare_run(replace(BASE, allocation=allocation, recovery=recovery), data)
    want = train_in_process(prepared, data)
    train = [want.traffic[k] for k in ("forward", "backward", "share") if k in want.traffic]
    if recovery.scheme == "none":  # the test means something only if messages were lost
        assert sum(t.delivered for t in train) < sum(t.messages for t in train)
    else:
        assert sum(t.data_tx for t in train) > sum(t.messages for t in train)
    result = _run(cluster, prepared, data, stage_names=stages, test_repeats=3)
    assert result.alloc == prepared.alloc
    _assert_same_trace(result.trace, want)
    # every null-filled pass is one the simulation null-filled too
    null_filled = sum(len(w) for w in result.waits.values())
    prop = want.propagation
    assert null_filled == sum(prop.assemblies[k] - prop.complete[k] for k in prop.assemblies)
    assert result.late == 0  # emulated mode waits only for what can come
    # test-time inference under loss on the final weights: the same test partials
    # lost, the same classes predicted by every output owner, the same accuracy
    assert result.test is not None and result.test_acc is not None
    spec = EvalSpec(len(data.x_test), BASE.batch_size, repeats=3)
    simulated = evaluate_in_process(prepared, want.params, data.x_test, spec)
    assert result.test.traffic.as_dict() == simulated.traffic.as_dict()
    assert result.test.same_as(simulated)
    assert result.test_acc == simulated.accuracy(data.y_test)
    assert result.test_acc_lossless == want.test_accuracy(data)
    test = result.test.traffic
    if recovery.scheme == "none":  # lossy test passes: some partials never came
        assert 0 < result.test.null_filled and test.delivered < test.messages
    else:
        assert test.data_tx > test.messages
    _assert_real_wire_traffic(result, [*want.traffic.values(), test], recovery)


def _assert_real_wire_traffic(
    result: StagesLossyResult, traffic: list[Traffic], recovery: Recovery
) -> None:
    """What the stages really put on the wire: every copy the recovery scheme sent went
    through an emulated link (sent or lost there); r-TX's and ACK's repeated copies
    reached their receivers as duplicates, and ACK's acknowledgements crossed back."""
    assert len(result.on_wire) == 3
    wire = {k: sum(c[k] for c in result.on_wire.values()) for k in WireCounts().as_dict()}
    data_tx = sum(t.data_tx for t in traffic)
    assert wire["copies_sent"] + wire["copies_lost"] == data_tx
    assert wire["copies_lost"] > 0 and wire["acks_dropped"] == wire["acks_overdue"] == 0
    # a receiver's counts stop at its result: a last duplicate may come after it
    assert wire["duplicates"] <= wire["copies_sent"] - sum(t.delivered for t in traffic)
    if recovery.scheme == "none":
        assert wire["duplicates"] == 0
    else:
        assert wire["duplicates"] > 0
    if recovery.scheme == "ack":
        ack_tx = sum(t.ack_tx for t in traffic)
        # (a sender hears an acknowledgement its receiver sent after its result)
        assert 0 < wire["acks_received"] <= ack_tx and wire["acks_sent"] > 0
        assert wire["acks_sent"] + wire["acks_lost"] <= ack_tx
    else:
        assert wire["acks_sent"] == wire["acks_lost"] == wire["acks_received"] == 0


def test_a_lossy_run_on_stages_matches_the_experiments_simulation(
    cluster: LocalCluster, stages: list[str], data: Dataset
) -> None:
    # The experiment's own run (simulate.run_training, with its test passes) reports
    # the same training propagation, traffic and loss (with one evaluation point, its
    # loss is the mean over every mini-batch), and its final test under loss is the
    # stages' (keyed as its final evaluation point, after the curve's).
    cfg = replace(BASE, allocation="hybrid", eval_points=1, test_repeats=2)
    prepared = prepare_run(cfg, data)
    assert prepared.clock is not None
    eval_index = final_eval_index(replace(cfg, eval_points=3), prepared.clock.n_slots)
    assert eval_index > 0
    result = _run(cluster, prepared, data, stage_names=stages, test_repeats=2,
                  test_eval_index=eval_index)  # fmt: skip
    simulated = run_training(cfg, data)
    assert result.trace.propagation.as_dict()["propagation_rate"] == simulated["propagation_rate"]
    assert np.mean(list(result.trace.losses.values())) == pytest.approx(
        simulated["final_train_loss"], rel=1e-10
    )
    for category in ("forward", "backward", "share"):
        assert result.trace.traffic[category].as_dict() == simulated["traffic"][category]
    assert result.test_acc_lossless == simulated["final_test_acc_lossless"]
    # three evaluation points: the final test is keyed after the curve's two
    curved = run_training(replace(cfg, eval_points=3), data)
    assert result.test_acc == curved["final_test_acc"]
    assert result.test is not None
    assert result.test.traffic.messages < curved["traffic"]["test"]["messages"]


def test_a_stage_never_waits_past_its_deadline(
    cluster: LocalCluster, stages: list[str], data: Dataset
) -> None:
    # Pure deadline waiting: receivers do not know which partials were lost, so each
    # pass missing one waits until the end of the timeslot it was sent in.
    slot_s = 0.15
    prepared = prepare_run(replace(BASE, allocation="hybrid", n_data=2), data)
    result = _run(cluster, prepared, data, stage_names=stages, mode="deadline", slot_s=slot_s)
    waits = [w for per_device in result.waits.values() for w in per_device]
    assert waits, "the run should have lost partials"
    for _data, _kind, _layer, missing, deadline, proceeded in waits:
        assert missing >= 1
        assert proceeded >= deadline - 0.005  # it did wait for the missing partial
    if result.late == 0:  # nothing arrived after its deadline: as simulated
        want = train_in_process(prepared, data)
        _assert_same_trace(result.trace, want)
        assert result.test is not None  # the test passes after training, on deadlines too
        assert result.test.same_as(
            evaluate_in_process(prepared, want.params, data.x_test, result.test.spec)
        )


@dataclass
class _CopyFates(LinkChannel):
    """The run's links, counting each copy's and each acknowledgement's seeded fate."""

    copies_lost: int = 0
    acks_lost: int = 0
    acks_come: int = 0

    def send(self, src: int, dst: int, layer: int, step: int, direction: Direction,
             *, transmit: Transmit | None = None) -> bool:  # fmt: skip
        lost = self.keyed_loss()

        def counted(key: LossKey) -> bool:
            gone = lost(key)
            if key.src == src:
                self.copies_lost += int(gone)
            else:  # an acknowledgement of a copy that arrived
                self.acks_lost += int(gone)
                self.acks_come += int(not gone)
            return not gone

        return super().send(src, dst, layer, step, direction, transmit=counted)


@pytest.mark.parametrize("recovery", [Recovery("rtx", copies=2), Recovery("ack", max_attempts=3)])
def test_retransmissions_in_deadline_mode_are_the_seeded_ones_whatever_arrives_in_time(
    cluster: LocalCluster, stages: list[str], data: Dataset, recovery: Recovery
) -> None:
    # In deadline mode what a receiver gets depends on scheduling (a copy that misses
    # its timeslot's end is late), but what each sender puts on its emulated links does
    # not: every pass runs and sends, and every copy's fate is the seeded decision.
    prepared = prepare_run(replace(BASE, allocation="hybrid", n_data=2, recovery=recovery), data)
    fates = _CopyFates(prr=prepared.topology.prr, seed=BASE.seed, recovery=recovery)
    want = train_in_process(prepared, data, channel=fates)
    result = _run(cluster, prepared, data, stage_names=stages, mode="deadline", slot_s=0.15)
    assert result.test is not None
    tested = evaluate_in_process(prepared, result.trace.params, data.x_test, result.test.spec,
                                 channel=fates)  # fmt: skip
    # the same messages, copies and (seeded) acknowledgements as the simulation's
    assert {k: v.as_dict() for k, v in result.trace.traffic.items()} == {
        k: v.as_dict() for k, v in want.traffic.items()
    }
    assert result.test.traffic.as_dict() == tested.traffic.as_dict()
    traffic = [*want.traffic.values(), tested.traffic]
    data_tx = sum(t.data_tx for t in traffic)
    assert data_tx > sum(t.messages for t in traffic)  # copies were repeated
    wire = result.wire_totals()
    assert wire["copies_sent"] + wire["copies_lost"] == data_tx
    assert wire["copies_lost"] == fates.copies_lost > 0  # lost on the senders' links
    # receivers got at most what the links let through, and only from senders the
    # seeded decision delivers: a copy either came in time, came late, or came after
    # the receiver's result
    assert result.trace.arrivals.keys() == want.arrivals.keys()
    for key, senders in result.trace.arrivals.items():
        assert set(senders) <= set(want.arrivals[key])
    assert 0 < wire["duplicates"] <= wire["copies_sent"] - sum(t.delivered for t in traffic)
    # in deadline mode no sender waits for an acknowledgement; every one that came
    # acknowledges a copy its sender sent (none dropped as bad or repeated)
    assert all(not waits for waits in result.ack_waits.values()) and wire["acks_overdue"] == 0
    assert wire["acks_dropped"] == 0
    if recovery.scheme == "ack":
        assert sum(t.ack_tx for t in traffic) == fates.acks_lost + fates.acks_come
        assert 0 < wire["acks_received"] <= wire["acks_sent"] <= fates.acks_come
        assert wire["acks_lost"] <= fates.acks_lost
    else:
        assert wire["acks_sent"] == wire["acks_lost"] == wire["acks_received"] == 0
    if result.late == 0 and all(s == want.arrivals[k] for k, s in result.trace.arrivals.items()):
        _assert_same_trace(result.trace, want)  # nothing missed its timeslot: as simulated


def test_the_stages_measure_their_links_with_fifty_probes_and_the_run_maps_on_them(
    cluster: LocalCluster, stages: list[str], data: Dataset
) -> None:
    cfg = replace(BASE, allocation="hybrid", n_data=2)
    prepared = prepare_run(cfg, data)
    result = _run(cluster, prepared, data, stage_names=stages, probes=PROBES_PER_LINK)
    # each probe's fate is the seeded decision on the link's true ratio
    prr = prepared.topology.prr
    want = np.eye(3)
    for src in range(3):
        for dst in set(range(3)) - {src}:
            fates = [deliver(cfg.seed, src, dst, 0, seq, Direction.PROBE, prr=prr[src, dst])
                     for seq in range(PROBES_PER_LINK)]  # fmt: skip
            want[src, dst] = sum(f.delivered for f in fates) / PROBES_PER_LINK
    assert result.measured_prr is not None
    np.testing.assert_array_equal(result.measured_prr, want)
    assert 0 < want[~np.eye(3, dtype=bool)].mean() < 1  # lossy links, measured
    # the coordinator mapped on the measurement: the run is the simulation of that mapping
    on_measured = prepare_run(cfg, data, measured=result.measured_prr)
    assert result.alloc == on_measured.alloc
    _assert_same_trace(result.trace, train_in_process(on_measured, data))


def test_a_bad_lossy_request_fails_with_a_clear_error(
    cluster: LocalCluster, stages: list[str], data: Dataset
) -> None:
    prepared = prepare_run(replace(BASE, n_data=1), data)
    request = lossy_request(prepared, data, stage_names=stages)
    truncated = replace(request, tensors=request.tensors[:-1])

    async def go() -> RunFailed:
        async with cluster.client() as client:
            return await client.connection.control.ask(
                truncated, expect=(RunFailed,), timeout_s=30, awaited="run_failed"
            )

    reply = asyncio.run(go())
    assert "tensors" in str(reply.error)
    with pytest.raises(PipelineError, match="not registered"):
        _run(cluster, prepared, data, stage_names=["nobody"], wait_for_stages_s=0.5)


def test_the_lossy_command_runs_on_the_clusters_stages(
    cluster: LocalCluster, stages: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--coordinator", cluster.coordinator_endpoint, "--allocation", "hybrid"]
    argv += ["--devices", "3", "--region", "80", "--seeds", "1", "--steps", "2"]
    argv += ["--hidden", "8,8", "--batch-size", "5", "--limit-train", "40"]
    argv += ["--mapping", "exhaustive", "--out", str(tmp_path)]
    assert experiment.main(argv) == 0  # 0: the run on stages matched its simulation
    rows = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert len(rows) == 1 and rows[0]["matches_simulation"] and rows[0]["n_data"] == 2
    assert rows[0]["wire"]["copies_sent"] > 0 and rows[0]["wire"]["acks_sent"] == 0
    # its test-time inference ran under loss across the stages, as simulated
    assert rows[0]["test_matches_simulation"] and 0 <= rows[0]["final_test_acc"] <= 1
    assert rows[0]["test_traffic"]["messages"] > 0
    assert sorted(rows[0]["stages"]) == sorted(stages)
    with pytest.raises(SystemExit):
        experiment.main([*argv, "--multiprocess"])
    assert "it takes no --multiprocess" in capsys.readouterr().err


def test_the_lossy_commands_multiprocess_runs_on_a_local_cluster_of_stages(
    tmp_path: Path,
) -> None:
    # --multiprocess: a local cluster of ordinary stages started for the command
    argv = ["--multiprocess", "--allocation", "horizontal", "--devices", "2", "--seeds", "1",
            "--steps", "2", "--hidden", "8", "--batch-size", "10", "--limit-train", "40",
            "--region", "80", "--mapping", "exhaustive", "--out", str(tmp_path)]  # fmt: skip
    assert experiment.main(argv) == 0  # 0: the run matched its simulation
    (row,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert row["matches_simulation"] and row["n_data"] == 2 and len(row["stages"]) == 2


def test_partials_larger_than_an_idle_data_port_takes_cross(
    cluster: LocalCluster, stages: list[str]
) -> None:
    # 40 samples x 256 neurons x 8 bytes = 80 KiB a partial: above the 64 KiB an idle
    # stage's data port accepts, so the run raises its stages' receive limits first.
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 256))
    y = rng.integers(0, 4, size=80)
    y[0] = 3
    wide = Dataset("wide", x, y, x[:10], y[:10])
    cfg = replace(BASE, hidden=(256,), batch_size=40, n_data=1, lossless=True)  # vertical
    prepared = prepare_run(cfg, wide)
    result = _run(cluster, prepared, wide, stage_names=stages, wait_s=10.0)
    assert result.trace.propagation.rate("forward", "backward", "share") == 1.0
    _assert_same_trace(result.trace, train_in_process(prepared, wide))
