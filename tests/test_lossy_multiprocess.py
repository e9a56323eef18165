"""Lossy training across real device processes on loopback (zpipe.lossy.multiprocess).

One pool of four device processes serves most tests (start-up and ``import
torch`` cost seconds each on two cores); the tests that kill or orphan a
process start their own, smaller ones. Models are tiny and runs are a few
mini-batches, so the numbers compared are exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from zpipe._errors import ConfigError, PipelineError, ProtocolError
from zpipe.lossy import experiment
from zpipe.lossy.data import Dataset, load_digits_dataset
from zpipe.lossy.linkmodes import check_link_transport, udp_available
from zpipe.lossy.links import Direction, Recovery, deliver
from zpipe.lossy.mapping import map_devices
from zpipe.lossy.multiprocess import DevicePool, run_multiprocess
from zpipe.lossy.partial import mlp_forward_backward
from zpipe.lossy.partition import partition
from zpipe.lossy.simulate import RunConfig, prepare_run, run_training
from zpipe.lossy.trace import TrainingTrace, train_in_process
from zpipe.lossy.wire import RunSpec
from zpipe.transport.codec import Message, encode

pytestmark = pytest.mark.timeout(120)

N_DEVICES = 4
# Region 80 m gives lossy links (mean reception about 0.6) for four devices.
BASE = RunConfig(
    allocation="hybrid",
    n_devices=N_DEVICES,
    region_m=80.0,
    seed=3,
    hidden=(16, 12),
    lr=0.1,
    batch_size=20,
    n_data=4,
    mapping="exhaustive",
    eval_points=1,
    test_repeats=1,
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    return load_digits_dataset()


@pytest.fixture(scope="module")
def pool() -> Iterator[DevicePool]:
    with DevicePool(N_DEVICES) as running:
        yield running
    # close() ended every child: none is left running
    assert not running.processes


def _assert_same_trace(got: TrainingTrace, want: TrainingTrace) -> None:
    assert got.arrivals == want.arrivals  # the same partials reached the same receivers
    assert {k: v.as_dict() for k, v in got.traffic.items()} == {
        k: v.as_dict() for k, v in want.traffic.items()
    }
    assert got.propagation.as_dict() == want.propagation.as_dict()
    assert dict(got.propagation.expected) == dict(want.propagation.expected)
    assert dict(got.propagation.received) == dict(want.propagation.received)
    assert got.losses.keys() == want.losses.keys()
    np.testing.assert_allclose(list(got.losses.values()), list(want.losses.values()), rtol=1e-12)
    for (w1, b1), (w2, b2) in zip(got.params, want.params, strict=True):
        np.testing.assert_allclose(w1, w2, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(b1, b2, rtol=1e-12, atol=1e-14)


# -- no loss: the partitioned network is the whole one --------------------------


def test_lossless_one_step_equals_the_unpartitioned_network(
    pool: DevicePool, data: Dataset
) -> None:
    cfg = replace(BASE, lossless=True, n_data=1)
    prepared = prepare_run(cfg, data)
    result = pool.train(prepared, data)
    x, y = prepared.batch(data, 1)
    loss, _, grads = mlp_forward_backward(prepared.params, x, y)
    assert result.trace.losses[1] == pytest.approx(loss, rel=1e-12)
    for (w, b), (dw, db), (w_got, b_got) in zip(
        prepared.params, grads, result.trace.params, strict=True
    ):
        np.testing.assert_allclose(w_got, w - cfg.lr * dw, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(b_got, b - cfg.lr * db, rtol=1e-12, atol=1e-14)
    assert result.trace.propagation.rate("forward", "backward", "share") == 1.0


def test_lossless_horizontal_equals_sequential_sgd(pool: DevicePool, data: Dataset) -> None:
    # Horizontal pipelines one mini-batch at a time (period 2L - 1), so equation
    # 3's stashed weights are the latest ones: plain SGD on the whole network.
    cfg = replace(BASE, allocation="horizontal", lossless=True, n_data=3)
    prepared = prepare_run(cfg, data)
    result = pool.train(prepared, data)
    params = [(w.copy(), b.copy()) for w, b in prepared.params]
    for i in range(1, cfg.n_data + 1):  # type: ignore[operator]
        x, y = prepared.batch(data, i)
        loss, _, grads = mlp_forward_backward(params, x, y)
        assert result.trace.losses[i] == pytest.approx(loss, rel=1e-12)
        params = [
            (w - cfg.lr * dw, b - cfg.lr * db)
            for (w, b), (dw, db) in zip(params, grads, strict=True)
        ]
    for (w, b), (w_got, b_got) in zip(params, result.trace.params, strict=True):
        np.testing.assert_allclose(w_got, w, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(b_got, b, rtol=1e-12, atol=1e-14)


def test_lossless_pipelined_hybrid_equals_the_engine(pool: DevicePool, data: Dataset) -> None:
    # Several mini-batches in flight: equation 3's weight stashing, as the
    # in-process engine (tested against the whole network) does it.
    prepared = prepare_run(replace(BASE, lossless=True, n_data=5), data)
    result = pool.train(prepared, data)
    _assert_same_trace(result.trace, train_in_process(prepared, data))
    assert result.late == 0


# -- loss: the same drops and the same result as the simulation ------------------


@pytest.mark.parametrize(
    ("allocation", "recovery"),
    [
        ("hybrid", Recovery("none")),
        ("hybrid", Recovery("rtx", copies=2)),
        ("hybrid", Recovery("ack", max_attempts=3)),
        ("vertical", Recovery("none")),
        ("horizontal", Recovery("none")),
    ],
)
def test_lossy_run_drops_what_the_simulation_drops(
    pool: DevicePool, data: Dataset, allocation: str, recovery: Recovery
) -> None:
    cfg = replace(BASE, allocation=allocation, recovery=recovery)
    prepared = prepare_run(cfg, data)
    result = pool.train(prepared, data)
    want = train_in_process(prepared, data)
    _assert_same_trace(result.trace, want)
    train = [want.traffic[k] for k in ("forward", "backward", "share") if k in want.traffic]
    if recovery.scheme == "none":
        # the test means something only if messages were lost
        assert sum(t.delivered for t in train) < sum(t.messages for t in train)
    else:
        assert sum(t.data_tx for t in train) > sum(t.messages for t in train)
    assert result.late == 0


def test_lossy_run_matches_the_experiments_simulation(pool: DevicePool, data: Dataset) -> None:
    # The experiment's own run (simulate.run_training, with its test passes)
    # reports the same training propagation, traffic and loss (with one
    # evaluation point, its loss is the mean over every mini-batch).
    result = run_multiprocess(BASE, data, pool=pool)
    simulated = run_training(BASE, data)
    assert result.trace.propagation.as_dict()["propagation_rate"] == simulated["propagation_rate"]
    assert np.mean(list(result.trace.losses.values())) == pytest.approx(
        simulated["final_train_loss"], rel=1e-12
    )
    for category in ("forward", "backward", "share"):
        assert result.trace.traffic[category].as_dict() == simulated["traffic"][category]


# -- deadlines --------------------------------------------------------------------


def test_receiver_never_waits_past_its_deadline(pool: DevicePool, data: Dataset) -> None:
    # Pure deadline waiting: receivers do not know which partials were lost, so
    # each pass missing one waits until the end of the timeslot it was sent in.
    slot_s = 0.15
    prepared = prepare_run(replace(BASE, n_data=2), data)
    result = pool.train(prepared, data, mode="deadline", slot_s=slot_s)
    waits = [w for per_device in result.waits.values() for w in per_device]
    assert waits, "the run should have lost partials"
    for _data, _kind, _layer, missing, deadline, proceeded in waits:
        assert missing >= 1
        assert proceeded >= deadline - 0.005  # it did wait for the missing partial
        assert proceeded - deadline < 0.1  # and went on, null-filled, right after
    if result.late == 0:  # nothing arrived after its deadline: as simulated
        _assert_same_trace(result.trace, train_in_process(prepared, data))


# -- link measurement ---------------------------------------------------------------


def test_fifty_probes_measure_each_link(pool: DevicePool) -> None:
    prr = np.array(
        [
            [1.0, 1.0, 0.0, 0.5],
            [1.0, 1.0, 0.8, 0.3],
            [0.0, 0.9, 1.0, 1.0],
            [0.5, 0.2, 1.0, 1.0],
        ]
    )
    measured = pool.measure_links(prr, seed=7)
    assert np.array_equal(pool.measure_links(prr, seed=7), measured)  # deterministic
    for src in range(N_DEVICES):
        for dst in range(N_DEVICES):
            if src == dst:
                assert measured[src, dst] == 1.0
                continue
            got = sum(
                deliver(7, src, dst, 0, seq, Direction.PROBE, prr=prr[src, dst]).delivered
                for seq in range(50)
            )
            assert measured[src, dst] == got / 50
    assert measured[0, 1] == 1.0 and measured[0, 2] == 0.0 and measured[2, 0] == 0.0
    assert 0.3 < measured[0, 3] < 0.7
    # the measured matrix feeds Algorithm 2
    alloc = map_devices(
        partition("hybrid", [64, 16, 12, 10], N_DEVICES), measured, method="exhaustive"
    )
    assert sorted(alloc.device_of) == list(range(N_DEVICES))


def test_a_run_mapped_on_measured_links_matches_the_simulation(
    pool: DevicePool, data: Dataset
) -> None:
    result = run_multiprocess(BASE, data, pool=pool, measure_links=True)
    assert result.measured_prr is not None
    prepared = prepare_run(BASE, data, measured=result.measured_prr)
    _assert_same_trace(result.trace, train_in_process(prepared, data))


# -- robustness ---------------------------------------------------------------------


def test_malformed_messages_are_dropped_and_the_device_keeps_serving(
    pool: DevicePool, data: Dataset
) -> None:
    cfg = replace(BASE, n_data=2)
    before = pool.train(prepare_run(cfg, data), data).protocol_errors[0]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(pool.endpoints[0])
    bad_partial = encode(
        Message(
            "lossy_partial",
            {"run": pool.last_run, "data": 1, "kind": "X", "layer": 0, "src": 1},
        )
    )
    header = msgpack.packb({"v": 1, "k": "lossy_go", "e": 0, "b": {"run": "x"}, "t": []})
    for frames in ([b"\xc1 not msgpack"], [header], encode(Message("heartbeat_ack")), bad_partial):
        sock.send_multipart(frames, copy=True)
    sock.close()
    ctx.term()
    time.sleep(0.2)
    after = pool.train(prepare_run(cfg, data), data)  # still serving, still exact
    assert after.protocol_errors[0] - before == 4
    _assert_same_trace(after.trace, train_in_process(prepare_run(cfg, data), data))


def test_a_dead_device_fails_the_run_at_once_and_the_pool_ends_cleanly(data: Dataset) -> None:
    cfg = replace(BASE, allocation="horizontal", n_devices=2, n_data=1)
    with DevicePool(2) as small:
        procs = list(small.processes)
        procs[1].kill()
        procs[1].wait(timeout=5)
        started = time.monotonic()
        with pytest.raises(PipelineError, match="device process 1"):
            small.train(prepare_run(cfg, data), data)
        assert time.monotonic() - started < 5
    assert procs[0].returncode == 0  # asked to shut down, it exited cleanly
    assert all(p.poll() is not None for p in procs)


def test_a_device_whose_launcher_is_gone_exits() -> None:
    # --parent-pid names a process that is not its parent: as if the launcher died.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zpipe.lossy.device",
            "--index",
            "0",
            "--control",
            "tcp://127.0.0.1:9",
            "--parent-pid",
            "1",
            "--log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- no processes ---------------------------------------------------------------------


def test_udp_links_need_draft_sockets() -> None:
    assert check_link_transport("tcp") == "tcp"
    with pytest.raises(ConfigError, match="RADIO/DISH" if not udp_available() else "UDP"):
        check_link_transport("udp")
    with pytest.raises(ConfigError, match="unknown link transport"):
        check_link_transport("carrier-pigeon")


def test_run_spec_round_trips_and_rejects_garbage(data: Dataset) -> None:
    prepared = prepare_run(BASE, data)
    spec = RunSpec(
        alloc=prepared.alloc,
        prr=prepared.topology.prr,
        seed=3,
        recovery=Recovery("ack", max_attempts=3),
        lossless=False,
        lr=0.1,
        n_data=4,
        batch=20,
        mode="emulated",
        slot_s=0.1,
        wait_s=5.0,
    )
    body = msgpack.unpackb(msgpack.packb(spec.to_body()))
    again = RunSpec.from_body(body)
    assert again.alloc == spec.alloc and np.array_equal(again.prr, spec.prr)
    assert again.recovery == spec.recovery
    for broken in (
        {**body, "prr": [[1.0]]},
        {**body, "mode": "psychic"},
        {**body, "n_data": "4"},
        {**body, "recovery": {"scheme": "pray", "copies": 1, "max_attempts": 1}},
        {k: v for k, v in body.items() if k != "alloc"},
    ):
        with pytest.raises(ProtocolError):
            RunSpec.from_body(broken)


# -- the command line -----------------------------------------------------------------


def test_experiment_cli_runs_across_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "mp"
    argv = ["--multiprocess", "--measure-links", "--allocation", "horizontal", "--devices", "2",
            "--seeds", "1", "--steps", "3", "--hidden", "8", "--batch-size", "10",
            "--region", "80", "--out", str(out)]  # fmt: skip
    assert experiment.main(argv) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["matches_simulation"] is True
    assert run["n_data"] == 3 and len(run["measured_prr"]) == 2
    assert json.loads(capsys.readouterr().out)["matches_simulation"] is True


def test_experiment_cli_refuses_udp_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if udp_available():
        pytest.skip("this pyzmq has draft sockets")
    argv = ["--multiprocess", "--link-transport", "udp", "--steps", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        experiment.main(argv)
    assert exc.value.code == 2
    assert "draft RADIO/DISH" in capsys.readouterr().err
