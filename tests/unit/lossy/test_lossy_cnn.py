"""EdgePipe's CNN (Fig. 10(c)): convolution layers allocated layer-wise, a dense
head of super neurons, in the in-process simulation.

Lossless and without pipelining, the partitioned CNN is the unpartitioned torch
network under sequential SGD; a lost convolution output is null-filled, and its
sender gets a zero gradient for that mini-batch."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from zpipe._errors import ConfigError
from zpipe.cli import lossy as experiment
from zpipe.lossy.cnn import CnnSpec, default_conv_devices, partition_cnn
from zpipe.lossy.data import Dataset, load_generated_dataset
from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.links import Direction
from zpipe.lossy.radio import uniform_topology
from zpipe.lossy.schedule import timeslot_ms, worst_forward_macs
from zpipe.lossy.simulate import (
    RunConfig,
    partitioned_model,
    prepare_run,
    run_passes,
    run_training,
)
from zpipe.lossy.torch_cnn import CnnReference
from zpipe.lossy.wire import cnn_from_map

# 6 x 6 one-channel images, 4 classes: conv 6x6 -> 6x6 (pool) 3x3 (pool) 1x1
SIDE, CLASSES = 6, 4
BASE = RunConfig(
    allocation="hybrid",
    model="cnn",
    n_devices=6,
    seed=2,
    conv_channels=(3, 4, 5),
    hidden=(8, 8, 6),
    lr=0.1,
    batch_size=5,
    n_data=4,
    eval_points=2,
    test_repeats=2,
    mapping="exhaustive",
)


@pytest.fixture(scope="module")
def data() -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(80, SIDE * SIDE))
    y = rng.integers(0, CLASSES, size=80)
    y[0] = CLASSES - 1
    return Dataset("images", x[:60], y[:60], x[60:], y[60:])


def test_the_papers_cnn_on_digits_shapes() -> None:
    spec = CnnSpec.for_features(64, 10)
    # input, 3 convolution layers (32x8x8, pooled 64x4x4, pooled 64x2x2), 4 dense layers
    assert spec.layer_sizes == [64, 2048, 1024, 256, 128, 128, 128, 10]
    assert spec.layer_macs[2] == 64 * 8 * 8 * 32 * 9
    assert [w for w, _ in spec.param_shapes()][:3] == [
        (32, 1, 3, 3),
        (64, 32, 3, 3),
        (64, 64, 3, 3),
    ]


def test_generated_features_are_not_an_image() -> None:
    gen = load_generated_dataset()
    with pytest.raises(ConfigError, match="square one-channel images"):
        CnnSpec.for_features(gen.n_features, gen.n_classes)


@pytest.mark.parametrize("kind", ["hybrid", "vertical", "horizontal"])
def test_convolution_layers_are_whole_and_the_head_follows_algorithm_1(kind: str) -> None:
    spec = CnnSpec.for_features(64, 10)
    alloc = partition_cnn(kind, spec, 8)
    n_conv = default_conv_devices(3, 8)
    assert n_conv == 3
    # the input and every convolution layer each owned whole by one device; the image
    # stays with the first convolution
    for layer in range(4):
        (owner,) = alloc.owners(layer)
        assert owner[1].width == spec.layer_sizes[layer]
    assert alloc.owners(0)[0][0] == alloc.owners(1)[0][0]
    assert len({alloc.owners(layer)[0][0] for layer in range(1, 4)}) == 3
    head_devices = {d for layer in range(4, 8) for d, _ in alloc.owners(layer)}
    assert len(head_devices) == 5
    widths = {len(alloc.owners(layer)) for layer in range(4, 8)}
    if kind == "horizontal":  # every head device owns part of every head layer
        assert widths == {5}
    # the timeslot is sized by the heaviest convolution, not by in x out
    assert worst_forward_macs(alloc) == 64 * 8 * 8 * 32 * 9
    assert timeslot_ms(alloc) > timeslot_ms(
        partition_cnn(kind, replace(spec, channels=(2, 2, 2)), 8)
    )


def test_bad_cnn_configs() -> None:
    with pytest.raises(ConfigError, match="conv_devices"):
        replace(BASE, conv_devices=4)
    with pytest.raises(ConfigError, match="conv_devices applies"):
        replace(BASE, model="mlp", conv_devices=1)
    with pytest.raises(ConfigError, match="unknown model"):
        replace(BASE, model="rnn")
    with pytest.raises(ConfigError, match="no gpipe"):
        replace(BASE, gpipe=True, microbatches=2)
    with pytest.raises(ConfigError, match="pooled away"):
        CnnSpec((1, 2, 2), channels=(2, 2, 2))
    with pytest.raises(ConfigError, match="leave the dense layers"):
        partition_cnn("hybrid", CnnSpec.for_features(64, 10), 3, conv_devices=3)


def test_lossless_partitioned_cnn_is_sequential_sgd_on_the_whole_network(data: Dataset) -> None:
    # Without pipelining (period 2L - 1) equation 3's stashed weights are the latest:
    # the partitioned CNN must be the torch network under plain SGD.
    cfg = replace(BASE, lossless=True, pipelined=False, n_data=4)
    prepared = prepare_run(cfg, data)
    assert len({d for d, _ in prepared.alloc.owners(5)}) > 1  # the head is partitioned
    channel = LinkChannel(prr=prepared.topology.prr, seed=cfg.seed, lossless=True)
    model = partitioned_model(prepared, data, channel)
    losses = {}
    last = prepared.alloc.n_layers - 1
    for ev in run_passes(prepared):
        x, y = prepared.batch(data, ev.data)
        if ev.kind == "F":
            model.forward(ev.step, ev.layer, x)
        else:
            loss = model.backward(ev.step, ev.layer, y)
            if ev.layer == last:
                losses[ev.data] = loss
    spec = CnnSpec.for_features(SIDE * SIDE, CLASSES, channels=cfg.conv_channels, hidden=cfg.hidden)
    reference = CnnReference(spec, prepared.params)
    sgd = torch.optim.SGD(reference.parameters(), lr=cfg.lr)
    for i in range(1, prepared.n_data + 1):
        x, y = prepared.batch(data, i)
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            reference(torch.from_numpy(x)), torch.from_numpy(y)
        )
        loss.backward()
        sgd.step()
        assert losses[i] == pytest.approx(loss.item(), rel=1e-10)
    for (w, b), (w_ref, b_ref) in zip(model.full_params(), reference.params(), strict=True):
        np.testing.assert_allclose(w, w_ref, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(b, b_ref, rtol=1e-10, atol=1e-13)


def _one_step(data: Dataset, prr: np.ndarray) -> tuple[dict, dict, dict]:
    cfg = replace(BASE, allocation="vertical", pipelined=False, n_data=1)
    prepared = prepare_run(cfg, data)
    # conv 2's bias positive: its output and gradient do not vanish on a zero input,
    # so only the null-fill rule can keep conv 1's gradient at zero
    prepared.params[1][1][:] = 0.5
    model = partitioned_model(
        prepared, data, LinkChannel(prr=prr, seed=cfg.seed), record_arrivals=True
    )
    before = model.weights
    x, y = prepared.batch(data, 1)
    for ev in run_passes(prepared):
        if ev.kind == "F":
            model.forward(ev.step, ev.layer, x)
        else:
            model.backward(ev.step, ev.layer, y)
    assert model.arrivals is not None
    return before, model.weights, model.arrivals


def test_a_lost_convolution_output_is_null_filled_and_its_sender_gets_no_gradient(
    data: Dataset,
) -> None:
    alloc = prepare_run(replace(BASE, allocation="vertical"), data).alloc
    conv1, conv2 = alloc.owners(1)[0][0], alloc.owners(2)[0][0]
    head = alloc.owners(4)[0][0]
    assert conv1 != conv2
    prr = uniform_topology(max(alloc.device_of) + 1, 1.0)
    before, after, arrivals = _one_step(data, prr)
    assert arrivals[(1, "F", 1, conv2)] == (conv1,)
    assert not np.allclose(after[(1, conv1)][0], before[(1, conv1)][0])  # it learns when heard
    prr[conv1, conv2] = 0.0  # conv 1's output never reaches conv 2
    assert not LinkChannel(prr=prr, seed=0).would_deliver(conv1, conv2, 1, 1, Direction.FORWARD)
    before, after, arrivals = _one_step(data, prr)
    assert arrivals[(1, "F", 1, conv2)] == ()
    # conv 1 took a zero gradient (nobody used its output); conv 2 computed on zeros
    # (its kernels got no gradient, its bias did) and the head learned
    np.testing.assert_array_equal(after[(1, conv1)][0], before[(1, conv1)][0])
    np.testing.assert_array_equal(after[(1, conv1)][1], before[(1, conv1)][1])
    np.testing.assert_array_equal(after[(2, conv2)][0], before[(2, conv2)][0])
    assert not np.allclose(after[(2, conv2)][1], before[(2, conv2)][1])
    assert not np.allclose(after[(4, head)][0], before[(4, head)][0])


def test_cnn_runs_are_seeded_and_lose_messages(data: Dataset) -> None:
    cfg = replace(BASE, region_m=80.0, n_data=6)
    a = run_training(cfg, data)
    b = run_training(cfg, data)
    assert a["final_test_acc"] == b["final_test_acc"]
    assert a["propagation_rate"] == b["propagation_rate"] < 1.0
    assert a["config"]["label"] == "cnn_hybrid"
    assert a["allocation"]["layer_macs"][1] == 3 * SIDE * SIDE * 9
    lossless = run_training(replace(cfg, lossless=True), data)
    assert lossless["propagation_rate"] == 1.0
    assert lossless["final_test_acc"] == lossless["final_test_acc_lossless"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "cnn", "--dataset", "generated"], "square one-channel images"),
        (["--model", "cnn", "--conv-devices", "4"], "conv_devices must be in [0, 3]"),
        (["--conv-channels", "3,4"], "go with --model cnn"),
        (["--model", "cnn", "--conv-channels", "0,4"], "must be >= 1"),
        (["--model", "cnn", "--conv-channels", "4000,4000,4000"], "weights"),
        (["--model", "cnn", "--conv-channels", "2,2,2,2,2"], "pooled away"),
        (["--model", "cnn", "--conv-channels", ",".join(["2"] * 17)], "at most 16"),
        (["--model", "rnn"], "invalid choice"),
    ],
)
def test_the_experiments_cnn_options_refuse_bad_input(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        experiment.main([*argv, "--seeds", "1", "--out", str(tmp_path / "o"), "--no-plots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_experiment_trains_the_cnn(tmp_path: Path) -> None:
    out = tmp_path / "o"
    argv = ["--model", "cnn", "--conv-channels", "2,3,3", "--hidden", "8,8,8",
            "--allocation", "hybrid", "vertical", "--devices", "6", "--steps", "3",
            "--seeds", "1", "--eval-points", "1", "--test-repeats", "1",
            "--limit-train", "200", "--out", str(out), "--no-plots"]  # fmt: skip
    assert experiment.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert [row["label"] for row in results["summary"]] == ["cnn_hybrid", "cnn_vertical"]
    run = results["runs"][0]
    assert run["layer_sizes"] == [64, 128, 48, 12, 8, 8, 8, 10]
    assert run["config"]["conv_channels"] == [2, 3, 3]


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"image": [1, 8], "channels": [2], "hidden": [4], "n_classes": 3},
        {"image": [1, 8, 8], "channels": [True], "hidden": [4], "n_classes": 3},
        {"image": [1, 8, 8], "channels": [2], "hidden": [4]},
        {"image": [1, 8, 8], "channels": [0], "hidden": [4], "n_classes": 3},
    ],
)
def test_a_malformed_cnn_spec_is_refused(body: object) -> None:
    with pytest.raises(ConfigError):
        cnn_from_map(body)


def test_a_cnn_spec_round_trips() -> None:
    spec = CnnSpec((1, 6, 6), (3, 4), (5,), 4)
    assert cnn_from_map(spec.to_dict()) == spec
