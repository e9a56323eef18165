"""Seeded lossy training runs: reproducible, lossless when asked, and equal to
plain SGD when nothing is pipelined."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.data import Dataset
from zpipe.lossy.engine import LinkChannel, PartitionedMLP
from zpipe.lossy.links import Recovery
from zpipe.lossy.partial import init_mlp, mlp_forward_backward
from zpipe.lossy.partition import partition
from zpipe.lossy.radio import uniform_topology
from zpipe.lossy.schedule import events
from zpipe.lossy.simulate import RunConfig, run_training


@pytest.fixture(scope="module")
def tiny() -> Dataset:
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(4, 12)) * 2
    y = rng.integers(0, 4, size=300)
    x = centers[y] + rng.normal(size=(300, 12))
    return Dataset("blobs", x[:240], y[:240], x[240:], y[240:])


def _cfg(**kw: object) -> RunConfig:
    base: dict[str, object] = {
        "hidden": (16, 16),
        "batch_size": 20,
        "n_data": 40,
        "eval_points": 4,
        "test_repeats": 2,
        "lr": 0.05,
    }
    base.update(kw)
    return RunConfig(**base)  # type: ignore[arg-type]


def test_naive_schedule_is_plain_sgd() -> None:
    sizes = [12, 16, 16, 4]
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(5, 12)), rng.integers(0, 4, size=5)) for _ in range(6)]
    alloc = partition("naive", sizes, 1)
    model = PartitionedMLP(
        alloc, init_mlp(sizes, seed=2), LinkChannel(uniform_topology(1, 1.0), 0), lr=0.1
    )
    for ev in events(alloc, len(batches)):
        x, y = batches[ev.data - 1]
        if ev.kind == "F":
            model.forward(ev.data, ev.layer, x)
        else:
            model.backward(ev.data, ev.layer, y)
    params = init_mlp(sizes, seed=2)
    for x, y in batches:
        _, _, grads = mlp_forward_backward(params, x, y)
        params = [
            (w - 0.1 * gw, b - 0.1 * gb) for (w, b), (gw, gb) in zip(params, grads, strict=True)
        ]
    for (w, b), (w_ref, b_ref) in zip(model.full_params(), params, strict=True):
        np.testing.assert_allclose(w, w_ref, atol=1e-12)
        np.testing.assert_allclose(b, b_ref, atol=1e-12)


def test_hybrid_pipeline_uses_stale_weights_as_equation_3_says() -> None:
    # With pipelining, mini-batch 2 enters before mini-batch 1's gradient is applied,
    # so the pipelined run differs from sequential SGD (but only by staleness: one
    # mini-batch alone is identical, as test_lossy_partial checks).
    sizes = [12, 16, 16, 16, 16, 4]
    rng = np.random.default_rng(1)
    batches = [(rng.normal(size=(5, 12)), rng.integers(0, 4, size=5)) for _ in range(4)]
    alloc = partition("hybrid", sizes, 6)
    model = PartitionedMLP(
        alloc, init_mlp(sizes, seed=2), LinkChannel(uniform_topology(6, 1.0), 0), lr=0.1
    )
    seen_versions: list[int] = []
    for ev in events(alloc, len(batches)):
        x, y = batches[ev.data - 1]
        if ev.kind == "F":
            if ev.layer == 1 and ev.data == 2:
                # stage 1's forward of data 2 runs before data 1's backward reached it
                w0 = model.weights[(1, alloc.owners(1)[0][0])][0]
                seen_versions.append(
                    int(np.allclose(w0, init_mlp(sizes, seed=2)[0][0][: w0.shape[0]]))
                )
            model.forward(ev.data, ev.layer, x)
        else:
            model.backward(ev.data, ev.layer, y)
    assert seen_versions == [1]


def test_runs_are_reproducible(tiny: Dataset) -> None:
    a = run_training(_cfg(allocation="hybrid", seed=3), tiny)
    b = run_training(_cfg(allocation="hybrid", seed=3), tiny)
    assert a["curve"] == b["curve"] and a["traffic"] == b["traffic"]
    c = run_training(_cfg(allocation="hybrid", seed=4), tiny)
    assert c["curve"] != a["curve"]


def test_lossless_and_naive_propagate_everything(tiny: Dataset) -> None:
    lossless = run_training(_cfg(allocation="horizontal", n_devices=4, lossless=True), tiny)
    assert lossless["propagation_rate"] == 1.0 and lossless["complete_rate"] == 1.0
    assert lossless["final_test_acc"] == lossless["final_test_acc_lossless"]
    naive = run_training(_cfg(allocation="naive"), tiny)
    assert naive["propagation_rate"] == 1.0 and naive["traffic"] == {}
    assert naive["final_test_acc"] > 0.6  # separable blobs: it learns


def test_lossy_runs_lose_messages_and_recovery_costs_traffic(tiny: Dataset) -> None:
    cfg = {"allocation": "horizontal", "n_devices": 4, "region_m": 80.0, "seed": 1}
    plain = run_training(_cfg(**cfg), tiny)
    rtx = run_training(_cfg(**cfg, recovery=Recovery("rtx")), tiny)
    ack = run_training(_cfg(**cfg, recovery=Recovery("ack")), tiny)
    assert plain["propagation_rate"] < 1.0
    assert plain["tx_factor"] == 1.0 and rtx["tx_factor"] == 2.0 and ack["tx_factor"] > 1.0
    assert rtx["propagation_rate"] > plain["propagation_rate"]
    assert ack["propagation_rate"] > plain["propagation_rate"]
    # the same messages exist under every scheme; only their fate differs
    assert plain["traffic"]["forward"]["messages"] == rtx["traffic"]["forward"]["messages"]


def test_time_budget_sets_the_mini_batches(tiny: Dataset) -> None:
    out = run_training(_cfg(n_data=None, budget_s=60.0, allocation="vertical"), tiny)
    assert out["train_time_s"] <= 60.0
    assert out["train_time_s"] + out["pipeline_period"] * out["timeslot_ms"] / 1000 > 60.0
    assert out["curve"]["data_done"][-1] == out["n_data"]
    assert len(out["curve"]["time_s"]) == 4


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"allocation": "diagonal"}, "unknown allocation"),
        ({"n_data": None}, "exactly one"),
        ({"budget_s": 10.0}, "exactly one"),
        ({"n_data": 0}, "n_data"),
        ({"lr": 0.0}, "learning rate"),
        ({"hidden": (0,)}, "hidden"),
        ({"n_devices": 0}, "n_devices"),
    ],
)
def test_bad_run_configs(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cfg(**kw)


def test_batch_larger_than_the_data(tiny: Dataset) -> None:
    with pytest.raises(ConfigError, match="batch size"):
        run_training(_cfg(batch_size=1000), tiny)
