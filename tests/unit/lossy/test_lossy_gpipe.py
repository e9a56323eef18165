"""GPipe with vertical allocation (Fig. 7's baseline) and the M_layers partition
knob (Fig. 6), in the pure simulation."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import LinkChannel, PartitionedMLP
from zpipe.lossy.gpipe import (
    gpipe_data_within,
    gpipe_period,
    gpipe_template,
    gpipe_timeslot_ms,
)
from zpipe.lossy.links import Recovery
from zpipe.lossy.partial import mlp_forward_backward
from zpipe.lossy.partition import partition
from zpipe.lossy.schedule import sequential_period
from zpipe.lossy.simulate import (
    PreparedRun,
    RunConfig,
    pass_batch,
    prepare_run,
    run_passes,
    run_training,
)


@pytest.fixture(scope="module")
def tiny() -> Dataset:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 12)) * 2
    y = rng.integers(0, 4, size=300)
    x = centers[y] + rng.normal(size=(300, 12))
    return Dataset("blobs", x[:240], y[:240], x[240:], y[240:])


def _cfg(**kw: object) -> RunConfig:
    base: dict[str, object] = {
        "allocation": "vertical",
        "n_devices": 4,
        "hidden": (16, 16),
        "batch_size": 10,
        "n_data": 5,
        "eval_points": 2,
        "test_repeats": 1,
        "lr": 0.05,
        "gpipe": True,
        "microbatches": 3,
    }
    base.update(kw)
    return RunConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n_layers", "micro"), [(4, 1), (4, 2), (6, 3), (6, 6)])
def test_one_device_per_layer_places_passes_where_hand_computed(n_layers: int, micro: int) -> None:
    alloc = partition("vertical", [16] * n_layers, n_layers)
    got = {(p.kind, p.layer, p.micro): p.timeslot for p in gpipe_template(alloc, micro)}
    want: dict[tuple[str, int, int], int] = {}
    for j in range(micro):
        for layer in range(n_layers):
            want[("F", layer, j)] = layer + j
        for layer in range(1, n_layers):
            want[("B", layer, j)] = (
                (n_layers + micro - 1) + (n_layers - 1 - layer) + (micro - 1 - j)
            )
    assert got == want
    assert gpipe_period(alloc, micro) == 2 * n_layers - 1 + 2 * (micro - 1)


def test_one_micro_batch_is_model_parallelism_without_pipelining() -> None:
    for n_devices in (2, 3, 6):
        alloc = partition("vertical", [16] * 6, n_devices)
        assert gpipe_period(alloc, 1) == sequential_period(alloc)


def test_a_device_never_runs_two_passes_in_one_timeslot() -> None:
    # 3 devices on 6 layers: two layers per device, so the greedy placement must wait.
    alloc = partition("vertical", [16] * 6, 3)
    template = gpipe_template(alloc, 4)
    seen: set[tuple[int, int]] = set()
    for p in template:
        for k, sn in enumerate(alloc.super_neurons):
            if sn.slice_of(p.layer) is not None:
                assert (k, p.timeslot) not in seen
                seen.add((k, p.timeslot))
    assert gpipe_period(alloc, 4) > 2 * 6 - 1 + 2 * 3


def test_timeslot_divides_compute_but_not_the_message() -> None:
    alloc = partition("vertical", [784, 128, 128, 10], 4)
    # Table II: 784 x 128 takes 341.42 ms; eq. 4: 784 values x 32 bits at 250 kb/s; 100 ms margin
    want = 341.42 / 4 + 784 * 32 / 250.0 + 100.0
    assert gpipe_timeslot_ms(alloc, 4) == pytest.approx(want)
    assert gpipe_timeslot_ms(alloc, 1) == pytest.approx(341.42 + 784 * 32 / 250.0 + 100.0)


def test_run_time_is_mini_batches_times_period_times_slot(tiny: Dataset) -> None:
    run = run_training(_cfg(), tiny)
    alloc = partition("vertical", [12, 16, 16, 4], 4)
    period = 2 * 4 - 1 + 2 * (3 - 1)
    assert run["pipeline_period"] == period
    assert run["timeslots"] == 5 * period
    slot_s = gpipe_timeslot_ms(alloc, 3) / 1000.0
    assert run["train_time_s"] == pytest.approx(5 * period * slot_s)
    assert run["n_data"] == 5
    assert run["curve"]["data_done"][-1] == 5
    assert run["config"]["label"] == "vertical_gpipe"


def test_a_budget_of_n_mini_batches_gives_n() -> None:
    alloc = partition("vertical", [12, 16, 16, 4], 4)
    per = gpipe_period(alloc, 3) * gpipe_timeslot_ms(alloc, 3) / 1000.0
    for n in (1, 7, 40):
        assert gpipe_data_within(alloc, 3, n * per, max_data=100) == n
    assert gpipe_data_within(alloc, 3, 7.5 * per, max_data=100) == 7
    with pytest.raises(ConfigError):
        gpipe_data_within(alloc, 3, 200 * per, max_data=100)


def _train(
    cfg: RunConfig, data: Dataset
) -> tuple[list[tuple[np.ndarray, np.ndarray]], PreparedRun]:
    """Play the run's schedule on the engine; the final weights."""
    prepared = prepare_run(cfg, data)
    channel = LinkChannel(
        prepared.topology.prr, cfg.seed, lossless=prepared.lossless, recovery=cfg.recovery
    )
    model = PartitionedMLP(prepared.alloc, prepared.params, channel, lr=cfg.lr)
    for ev in run_passes(prepared):
        x, y = pass_batch(prepared, data, ev)
        if ev.kind == "F":
            model.forward(ev.step, ev.layer, x)
        else:
            model.backward(ev.step, ev.layer, y, lr_scale=ev.lr_scale)
    return model.full_params(), prepared


def _sequential_sgd(prepared: PreparedRun, data: Dataset) -> list[tuple[np.ndarray, np.ndarray]]:
    """Plain SGD on the run's mini-batches, one after another, whole."""
    params = [(w.copy(), b.copy()) for w, b in prepared.params]
    lr = prepared.config.lr
    for i in range(1, prepared.n_data + 1):
        x, y = prepared.batch(data, i)
        _, _, grads = mlp_forward_backward(params, x, y)
        params = [
            (w - lr * gw, b - lr * gb) for (w, b), (gw, gb) in zip(params, grads, strict=True)
        ]
    return params


def test_lossless_gpipe_equals_sequential_mini_batch_sgd(tiny: Dataset) -> None:
    # 10 rows in 3 micro-batches (4, 3, 3): the flush makes it plain mini-batch SGD.
    got, prepared = _train(_cfg(lossless=True), tiny)
    for (w, b), (w_ref, b_ref) in zip(got, _sequential_sgd(prepared, tiny), strict=True):
        np.testing.assert_allclose(w, w_ref, atol=1e-12)
        np.testing.assert_allclose(b, b_ref, atol=1e-12)


def test_pipelined_vertical_without_gpipe_is_not_sequential_sgd(tiny: Dataset) -> None:
    # The contrast: EdgePipe's schedule uses stale weights, GPipe's flush does not.
    got, prepared = _train(_cfg(lossless=True, gpipe=False, microbatches=0), tiny)
    assert not np.allclose(got[0][0], _sequential_sgd(prepared, tiny)[0][0], atol=1e-9)


def test_lossy_gpipe_drops_per_micro_batch_and_is_reproducible(tiny: Dataset) -> None:
    cfg = _cfg(n_devices=4, region_m=120.0)
    a = run_training(cfg, tiny)
    b = run_training(cfg, tiny)
    assert a["final_test_acc"] == b["final_test_acc"]
    assert a["traffic"] == b["traffic"]
    # every micro-batch sends its own messages: 3 per mini-batch per link crossed
    forward = a["traffic"]["forward"]["messages"]
    assert forward == 3 * 5 * 3  # 3 forward links (input->1->2->out) x 5 x 3
    assert a["propagation_rate"] < 1.0


def test_bad_gpipe_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="recovery"):
        _cfg(recovery=Recovery("rtx", copies=2))
    with pytest.raises(ConfigError, match="micro-batches"):
        _cfg(microbatches=11)
    with pytest.raises(ConfigError, match="pipelined"):
        _cfg(pipelined=False)
    with pytest.raises(ConfigError, match="microbatches"):
        _cfg(gpipe=False, microbatches=2)


def test_max_layers_partitions_into_groups_of_that_many(tiny: Dataset) -> None:
    cfg = RunConfig(
        allocation="hybrid", n_devices=6, hidden=(16,) * 4, max_layers=3, n_data=2, batch_size=10
    )
    prepared = prepare_run(cfg, tiny)
    assert prepared.alloc.allocated_layer == [[1, 2, 3], [4, 5, 6]]
    assert prepared.period == 2 * 3
    assert cfg.label == "hybrid_m3"
    with pytest.raises(ConfigError, match="max_layers"):
        RunConfig(allocation="vertical", max_layers=2, n_data=1)
