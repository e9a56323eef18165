"""The CNN's stage side: what a stage builds from its ``lossy_setup`` and what the
client reads back (no sockets: the setups are made as the coordinator makes them).

A stage given a CNN run spec builds whole convolution layers beside its dense
slices; driven pass by pass, the shards built from the wire train exactly as the
in-process simulation does."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from zpipe._errors import ProtocolError
from zpipe.client.runs.lossy import lossy_request
from zpipe.lossy.cnn import CnnSpec
from zpipe.lossy.data import Dataset
from zpipe.lossy.device_run import DeviceRun, build_run
from zpipe.lossy.engine import LinkChannel, shard_params
from zpipe.lossy.mapping import partition_and_map
from zpipe.lossy.shard import Topology
from zpipe.lossy.simulate import PreparedRun, RunConfig, partitioned_model, prepare_run
from zpipe.lossy.torch_cnn import TorchCnnShard
from zpipe.lossy.trace import trace_from_results, train_in_process
from zpipe.lossy.wire import RunSpec, to_tensor
from zpipe.protocol.lossy import LossyResult, LossySetup
from zpipe.transport.codec import Message

SIDE, CLASSES = 6, 4
BASE = RunConfig(
    allocation="hybrid",
    model="cnn",
    n_devices=6,
    region_m=80.0,
    seed=4,
    conv_channels=(3, 4, 5),
    hidden=(8, 8, 6),
    lr=0.1,
    batch_size=5,
    n_data=4,
    mapping="exhaustive",
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(60, SIDE * SIDE))
    y = rng.integers(0, CLASSES, size=60)
    y[0] = CLASSES - 1
    return Dataset("images", x[:50], y[:50], x[50:], y[50:])


def _spec(prepared: PreparedRun) -> RunSpec:
    cfg = prepared.config
    cnn = CnnSpec.for_features(SIDE * SIDE, CLASSES, channels=cfg.conv_channels, hidden=cfg.hidden)
    return RunSpec(alloc=prepared.alloc, prr=prepared.topology.prr, seed=cfg.seed,
                   recovery=cfg.recovery, lossless=prepared.lossless, lr=cfg.lr,
                   n_data=prepared.n_data, batch=cfg.batch_size, mode="emulated",
                   slot_s=0.1, wait_s=1.0, cnn=cnn)  # fmt: skip


def _setup(
    prepared: PreparedRun, data: Dataset, device: int, change: dict[int, Any] | None = None
) -> LossySetup:
    """A device's ``lossy_setup`` as the coordinator builds it (zpipe/coordinator/runs/lossy.py)."""
    topo = Topology(prepared.alloc)
    weights = shard_params(topo, prepared.params, device)
    weights.update(change or {})
    tensors = [to_tensor(a) for layer in sorted(weights) for a in weights[layer]]
    owns_input = topo.slice_of(0, device) is not None
    owns_output = topo.slice_of(topo.last, device) is not None
    batches = [prepared.batch(data, i) for i in range(1, prepared.n_data + 1)]
    if owns_input:
        tensors.append(to_tensor(np.stack([x for x, _ in batches])))
    if owns_output:
        tensors.append(to_tensor(np.stack([y for _, y in batches]).astype(np.int64)))
    return LossySetup(run=1, device=device, spec=_spec(prepared).to_body(),
                      peers={str(d): f"tcp://127.0.0.1:{9000 + d}" for d in topo.alloc.device_of},
                      layers=sorted(weights), inputs=owns_input, labels=owns_output,
                      tensors=tuple(tensors), epoch=1)  # fmt: skip


def test_the_coordinators_partition_of_a_cnn_is_the_simulations(data: Dataset) -> None:
    prepared = prepare_run(BASE, data)
    cnn = _spec(prepared).cnn
    assert cnn is not None
    alloc = partition_and_map(cnn.layer_sizes, "hybrid", 6, prepared.topology.prr_measured,
                              mapping="exhaustive", seed=BASE.seed, cnn=cnn)  # fmt: skip
    assert alloc == prepared.alloc


def test_a_cnn_run_spec_round_trips_and_refuses_a_bad_network(data: Dataset) -> None:
    spec = _spec(prepare_run(BASE, data))
    again = RunSpec.from_body(spec.to_body())
    assert again.cnn == spec.cnn and again.alloc == spec.alloc
    assert again.alloc.layer_macs == spec.alloc.layer_macs
    body = spec.to_body()
    with pytest.raises(ProtocolError, match="malformed"):
        RunSpec.from_body({**body, "cnn": {**body["cnn"], "channels": ["x"]}})
    with pytest.raises(ProtocolError, match="not the allocation's"):
        RunSpec.from_body({**body, "cnn": {**body["cnn"], "channels": [3, 4, 6]}})


def test_stages_build_whole_convolution_layers_and_train_as_the_simulation(
    data: Dataset,
) -> None:
    prepared = prepare_run(BASE, data)
    runs: dict[int, DeviceRun] = {}
    for device in sorted(set(prepared.alloc.device_of)):
        msg = LossySetup.from_message(_setup(prepared, data, device).to_message())
        runs[device] = build_run(msg, device)
        assert isinstance(runs[device].shard, TorchCnnShard)
    conv1 = prepared.alloc.owners(1)[0][0]
    assert runs[conv1].shard.weights[1][0].shape == (3, 1, 3, 3)
    # the shards the stages built, driven pass by pass: the simulation's run exactly
    channel = LinkChannel(prr=prepared.topology.prr, seed=BASE.seed)
    model = partitioned_model(prepared, data, channel, record_arrivals=True)
    model.shards = {d: run.shard for d, run in runs.items()}
    want = train_in_process(prepared, data)
    losses = {}
    for ev in _events(prepared):
        x, y = prepared.batch(data, ev.data)
        if ev.kind == "F":
            model.forward(ev.data, ev.layer, x)
        else:
            loss = model.backward(ev.data, ev.layer, y)
            if ev.layer == prepared.alloc.n_layers - 1 and loss is not None:
                losses[ev.data] = loss
    assert want.propagation.rate("forward") < 1.0  # messages were lost
    assert model.arrivals == want.arrivals
    assert losses == want.losses
    for (w1, b1), (w2, b2) in zip(model.full_params(), want.params, strict=True):
        np.testing.assert_array_equal(w1, w2)
        np.testing.assert_array_equal(b1, b2)
    # and the client reads the stages' final weights back into the same trace
    results = {
        d: LossyResult.from_message(
            Message("lossy_result", _result_body(d, run), tensors=_weight_tensors(run))
        )
        for d, run in runs.items()
    }
    trace = trace_from_results(Topology(prepared.alloc), results, cnn=_spec(prepared).cnn)
    for (w1, b1), (w2, b2) in zip(trace.params, want.params, strict=True):
        np.testing.assert_array_equal(w1, w2)
        np.testing.assert_array_equal(b1, b2)


def _events(prepared: PreparedRun) -> list[Any]:
    from zpipe.lossy.schedule import events

    return list(events(prepared.alloc, prepared.n_data, period=prepared.period))


def _weight_tensors(run: DeviceRun) -> tuple[Any, ...]:
    weights = run.shard.weights
    return tuple(to_tensor(a) for layer in sorted(weights) for a in weights[layer])


def _result_body(device: int, run: DeviceRun) -> dict[str, Any]:
    return {"run": 1, "device": device, "error": "", "layers": sorted(run.shard.weights),
            "losses": [], "arrivals": [], "propagation": {}, "traffic": {}, "waits": [],
            "late": 0, "protocol_errors": 0, "wall_s": 0.0}  # fmt: skip


def test_a_convolution_layer_cut_or_misshapen_in_a_setup_is_refused(data: Dataset) -> None:
    prepared = prepare_run(BASE, data)
    conv2 = prepared.alloc.owners(2)[0][0]
    bad = _setup(prepared, data, conv2, {2: (np.zeros((4, 3, 2, 2)), np.zeros(4))})
    with pytest.raises(ProtocolError, match="weights of layer 2"):
        build_run(LossySetup.from_message(bad.to_message()), conv2)


def test_the_client_asks_for_a_cnn_run(data: Dataset) -> None:
    prepared = prepare_run(replace(BASE, conv_devices=2), data)
    request = lossy_request(prepared, data)
    assert request.spec["cnn"]["channels"] == [3, 4, 5]
    assert request.spec["conv_devices"] == 2
    assert request.layer_sizes == list(prepared.alloc.layer_sizes)
    assert tuple(request.tensors[0].shape) == (3, 1, 3, 3)  # conv 1's kernels
