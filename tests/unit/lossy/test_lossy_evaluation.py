"""Test-time inference under loss (zpipe.lossy.evaluation): its passes, keys and scores."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ConfigError
from zpipe.lossy.engine import LinkChannel
from zpipe.lossy.evaluation import EvalSpec, accuracy, eval_steps, simulate_predictions
from zpipe.lossy.links import Recovery
from zpipe.lossy.mapping import partition_and_map
from zpipe.lossy.partial import init_mlp

SIZES = [6, 5, 4, 3]


def test_test_passes_cover_the_test_set_once_per_repeat_with_distinct_keys() -> None:
    spec = EvalSpec(n_test=7, batch=3, repeats=2, eval_index=1)
    steps = eval_steps(spec)
    assert [(t.start, t.stop) for t in steps] == [(0, 3), (3, 6), (6, 7)] * 2
    later = eval_steps(EvalSpec(n_test=7, batch=3, repeats=2, eval_index=2))
    keys = [t.step for t in steps] + [t.step for t in later]
    assert len(set(keys)) == len(keys)  # no two passes share drop keys
    with pytest.raises(ConfigError):
        EvalSpec(n_test=7, batch=3, repeats=1001)
    with pytest.raises(ConfigError):
        EvalSpec(n_test=0, batch=3)


def test_each_output_owners_view_counts_equally() -> None:
    spec = EvalSpec(n_test=4, batch=2)
    y = np.array([0, 1, 2, 0])
    s0, s1 = (t.step for t in eval_steps(spec))
    right, wrong = np.array([0, 1]), np.array([1, 0])
    predictions = {s0: [right, wrong], s1: [np.array([2, 0]), np.array([2, 0])]}
    assert accuracy(predictions, spec, y) == pytest.approx((1.0 + 2.0) / 4)
    # a pass that reached no view counts as all wrong
    assert accuracy({s0: [right]}, spec, y) == pytest.approx(2.0 / 4)


def test_lossless_test_passes_predict_as_the_whole_network_and_loss_changes_them() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(9, SIZES[0]))
    params = init_mlp(SIZES, seed=1)
    h = x
    for k, (w, b) in enumerate(params):
        h = h @ w.T + b
        h = np.maximum(h, 0.0) if k < len(params) - 1 else h
    whole = h.argmax(axis=1)
    alloc = partition_and_map(SIZES, "hybrid", 3, np.ones((3, 3)), mapping="identity", seed=0)
    spec = EvalSpec(n_test=9, batch=4, repeats=3)
    clean = LinkChannel(prr=np.full((3, 3), 0.3), seed=0, lossless=True)
    for t in eval_steps(spec):
        views = simulate_predictions(alloc, params, clean, x, spec)[t.step]
        assert len(views) == len(alloc.owners(alloc.n_layers - 1))
        for v in views:
            np.testing.assert_array_equal(v, whole[t.start : t.stop])
    lossy = LinkChannel(prr=np.full((3, 3), 0.3), seed=0, recovery=Recovery("none"))
    first = simulate_predictions(alloc, params, lossy, x, spec)
    assert 0 < lossy.traffic["test"].delivered < lossy.traffic["test"].messages
    # the same seed loses the same partials: the same predictions again
    again = simulate_predictions(
        alloc, params, LinkChannel(prr=np.full((3, 3), 0.3), seed=0), x, spec
    )
    assert all(np.array_equal(a, b) for k in first for a, b in zip(first[k], again[k], strict=True))
