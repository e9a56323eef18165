"""Test-time inference under loss: which test passes a run makes and what they score.

A lossy test pass runs the test set through the partitioned network over the
same lossy links as training (EdgePipe tests over the links it trains on). Each
test mini-batch is one inference pass with its own drop key (its *test step*,
:func:`eval_steps`), so the in-process simulation
(:func:`zpipe.lossy.simulate.run_training`, via :func:`lossy_predictions`) and a
run on stages (:mod:`zpipe.stage.executors.lossy_passes`, which runs the same steps) lose the
same partials and predict the same classes.

Each output owner assembles its own view of the logits from the shared slices
(a lost slice is null-filled), so every output owner predicts; a test row's
score is the mean over the views of whether each predicted right.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from zpipe._errors import ConfigError
from zpipe.lossy.cnn import CnnSpec
from zpipe.lossy.engine import LinkChannel, PartitionedMLP
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import Allocation

IntArray = npt.NDArray[np.int64]
#: each output owner's predicted classes, in owner order, by test step
Predictions = dict[int, list[IntArray]]

# Test steps of one evaluation point are (point * STEPS_PER_POINT + repeat) * batches
# + batch: distinct across points and repeats as long as repeats stay within this.
STEPS_PER_POINT = 1000


@dataclass(frozen=True)
class EvalSpec:
    """Which test passes a run makes: ``repeats`` passes over the test set in mini-batches
    of ``batch`` rows, keyed as evaluation point ``eval_index``."""

    n_test: int
    batch: int
    repeats: int = 1
    eval_index: int = 0

    def __post_init__(self) -> None:
        if self.n_test < 1 or self.batch < 1:
            raise ConfigError(
                f"a test needs rows and a batch size, got {self.n_test}, {self.batch}"
            )
        if not 1 <= self.repeats <= STEPS_PER_POINT or self.eval_index < 0:
            raise ConfigError(
                f"test repeats must be in [1, {STEPS_PER_POINT}] and the evaluation index "
                f">= 0, got {self.repeats} and {self.eval_index}"
            )

    @property
    def n_batches(self) -> int:
        return -(-self.n_test // self.batch)


@dataclass(frozen=True)
class EvalStep:
    """One test pass: its drop-key step and the test rows ``[start, stop)`` it reads."""

    step: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def eval_steps(spec: EvalSpec) -> list[EvalStep]:
    """Every test pass of ``spec``, in the order both sides run them."""
    n = spec.n_batches
    return [
        EvalStep(
            (spec.eval_index * STEPS_PER_POINT + r) * n + k,
            k * spec.batch,
            min((k + 1) * spec.batch, spec.n_test),
        )
        for r in range(spec.repeats)
        for k in range(n)
    ]


def lossy_predictions(
    model: PartitionedMLP, x_test: FloatArray, spec: EvalSpec, *, absent: Collection[int] = ()
) -> Predictions:
    """Every output owner's predictions of each test pass of ``spec`` on ``model``, but
    those of ``absent`` devices (dead ones: they predict nothing)."""
    owners = [d for d, _ in model.owners[model.n_layers - 1]]  # predict_views' order
    predictions: Predictions = {}
    for t in eval_steps(spec):
        views = model.predict_views(x_test[t.start : t.stop], t.step)
        predictions[t.step] = [
            v.argmax(axis=1) for d, v in zip(owners, views, strict=True) if d not in absent
        ]
    return predictions


def accuracy(
    predictions: Mapping[int, Sequence[IntArray]], spec: EvalSpec, y_test: IntArray
) -> float:
    """The mean over test passes and output owners' views of the right predictions
    (a pass no view reached counts as all wrong)."""
    correct = 0.0
    for t in eval_steps(spec):
        views = predictions.get(t.step, [])
        ys = y_test[t.start : t.stop]
        if views:
            correct += float(np.mean([np.sum(np.asarray(v) == ys) for v in views]))
    return correct / (spec.repeats * spec.n_test)


def simulate_predictions(
    alloc: Allocation,
    params: Sequence[tuple[FloatArray, FloatArray]],
    channel: LinkChannel,
    x_test: FloatArray,
    spec: EvalSpec,
    *,
    cnn: CnnSpec | None = None,
    absent: Collection[int] = (),
) -> Predictions:
    """The in-process test passes of weights ``params`` (e.g. a run's final ones) over
    ``channel``'s links; its traffic counts them under ``"test"`` (``cnn``: the
    layers are that CNN's; ``absent``: devices whose predictions are left out)."""
    if cnn is not None:
        from zpipe.lossy.torch_cnn import TorchCnnShard  # torch only for the CNN

        model = PartitionedMLP(
            alloc,
            params,
            channel,
            lr=0.0,
            shard_factory=TorchCnnShard.factory(cnn),
            weight_shapes=[w for w, _ in cnn.param_shapes()],
        )
        return lossy_predictions(model, x_test, spec, absent=absent)
    model = PartitionedMLP(alloc, params, channel, lr=0.0)
    return lossy_predictions(model, x_test, spec, absent=absent)
