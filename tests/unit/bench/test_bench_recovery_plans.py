"""bench/recovery.py's training lines: the plans before and after, and the planners'
prediction, as a trial line shows them."""

from __future__ import annotations

from bench._recovery_rebalance import _measured, _predicted, _stages
from zpipe.planner.training_plan import TrainingPlan, TrainStage


def _plan(**predicted: float) -> TrainingPlan:
    stages = (TrainStage(("nx-b",), 0, 8, (2,), 3), TrainStage(("tx2", "nano"), 8, 18, (1, 1), 1))
    return TrainingPlan(
        algo="respipe", schedule="1f1b", num_units=18, microbatch_size=2, num_microbatches=4,
        stages=stages, predicted=predicted,
    )  # fmt: skip


def test_a_plan_is_its_devices_and_ranges() -> None:
    assert _stages(_plan()) == [["nx-b", 0, 8], ["tx2+nano", 8, 18]]
    assert _stages(None) is None


def test_the_prediction_is_the_planners_samples_per_second() -> None:
    assert _predicted(_plan(round_s=1.5516, samples_per_s=5.1563)) == 5.16
    assert _predicted(_plan()) is None  # a plan made without profiles predicts nothing
    assert _predicted(None) is None


def test_each_stage_measured_compute_per_microbatch() -> None:
    stages = {
        "nx-b": {"busy_s": 2.0, "microbatches": 40, "utilisation": 0.91234},
        "tx2": {"busy_s": 1.0, "microbatches": 40, "utilisation": 0.4},
        "nano": {"busy_s": 0.0, "microbatches": 0},  # took no part in the run
        "note": "not a stage",
    }
    assert _measured(stages) == {
        "nx-b": {"busy_ms_per_mb": 50.0, "utilisation": 0.912, "microbatches": 40},
        "tx2": {"busy_ms_per_mb": 25.0, "utilisation": 0.4, "microbatches": 40},
    }
