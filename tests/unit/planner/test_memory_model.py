"""The one memory model (zpipe.planner.memory): the tight forward rule, training's parts,
the process base and the safety margin, and the matrices the planners search with."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zpipe._errors import ConfigError
from zpipe.planner.cluster import ClusterDevice, ClusterSpec
from zpipe.planner.memory import (
    COMPUTE_RUNTIME_BYTES,
    DEFAULT_MEMORY_MARGIN,
    DEFAULT_STAGE_BASE_BYTES,
    TRAINING_RUNTIME_BYTES,
    StageMemory,
    check_margin,
    inference_need_matrix,
    model_room_bytes,
    predict_stage,
    profile_need_matrix,
    profile_stage_memory,
    tight_forward_bytes,
)
from zpipe.planner.profile import ModelProfile, UnitProfile
from zpipe.planner.training_cost import TrainingCosts

MB = 10**6


def test_the_forward_peak_is_the_largest_unit_plus_the_stage_input_not_the_sum() -> None:
    # unit peaks count their own input; the stage's input stays alive behind later units
    assert tight_forward_bytes([100, 40, 70], stage_input=10) == 100
    assert tight_forward_bytes([30, 40, 70], stage_input=10) == 80
    assert tight_forward_bytes([30], stage_input=10) == 30  # one unit: its peak alone
    with pytest.raises(ConfigError):
        tight_forward_bytes([], stage_input=10)


def test_inference_is_weights_plus_forward_plus_base() -> None:
    need = predict_stage(weights=1000, unit_peaks=[30, 40], stage_input=10, base=5000)
    assert need == StageMemory(weights=1000, forward=50, base=5000, runtime=COMPUTE_RUNTIME_BYTES)
    assert need.model == 1050 and need.total == 6050 + COMPUTE_RUNTIME_BYTES
    assert StageMemory(weights=1000, forward=50, base=5000).with_margin(0.1) == 6655


@pytest.mark.parametrize(
    ("optimizer", "copies", "step_copies"),
    # Adam's step runs torch's fused kernel, in place: no temporaries
    [("sgd", 0, 0), ("sgd-momentum", 1, 1), ("adam", 2, 0), ("adamw", 2, 0)],
)
def test_training_adds_gradients_optimizer_state_and_saved_per_micro_batch(
    optimizer: str, copies: int, step_copies: int
) -> None:
    need = predict_stage(
        weights=1000,
        unit_peaks=[30, 40],
        stage_input=10,
        training=True,
        optimizer=optimizer,
        saved=200,
        in_flight=3,
    )
    assert (need.gradients, need.optimizer, need.saved) == (1000, copies * 1000, 600)
    # the step's temporaries (copies of the weights) or the forward, whichever is larger
    assert need.step == step_copies * 1000
    assert need.model == 1000 + max(50, step_copies * 1000) + 1000 + copies * 1000 + 600
    assert need.total == need.model + COMPUTE_RUNTIME_BYTES + TRAINING_RUNTIME_BYTES
    with pytest.raises(ConfigError, match="unknown optimizer"):
        predict_stage(weights=1, unit_peaks=[1], stage_input=0, training=True, optimizer="x")


def test_the_room_for_the_model_takes_the_margin_and_the_base_off_the_budget() -> None:
    budget = 1024 * 2**20
    room = model_room_bytes(budget, base_bytes=DEFAULT_STAGE_BASE_BYTES, margin=0.1)
    assert room == int(budget / 1.1) - DEFAULT_STAGE_BASE_BYTES - COMPUTE_RUNTIME_BYTES
    # a stage fits its budget exactly when its model fits the room
    base, runtime = DEFAULT_STAGE_BASE_BYTES, COMPUTE_RUNTIME_BYTES
    fits = StageMemory(weights=room, forward=0, base=base, runtime=runtime)
    assert fits.with_margin(0.1) <= budget
    over = StageMemory(weights=room + 2**20, forward=0, base=base, runtime=runtime)
    assert over.with_margin(0.1) > budget
    assert model_room_bytes(100 * 2**20, base_bytes=DEFAULT_STAGE_BASE_BYTES, margin=0) == 1
    assert 0 <= DEFAULT_MEMORY_MARGIN < 1


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 11.0, True, "0.1"])
def test_a_margin_is_a_sane_fraction(bad: object) -> None:
    with pytest.raises(ConfigError, match="margin"):
        check_margin(bad)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    units=st.lists(
        st.tuples(st.integers(0, 50), st.integers(0, 90), st.integers(0, 40)),
        min_size=1,
        max_size=7,
    ),
    model_input=st.integers(0, 40),
)
def test_the_planners_matrix_is_the_scalar_rule_for_every_stage(
    units: list[tuple[int, int, int]], model_input: int
) -> None:
    params = [u[0] for u in units]
    peaks = [u[1] for u in units]
    outputs = [u[2] for u in units]
    need = inference_need_matrix(params, peaks, model_input, outputs)
    n = len(units)
    for i, k in itertools.combinations(range(n + 1), 2):
        stage_input = model_input if i == 0 else outputs[i - 1]
        scalar = predict_stage(
            weights=sum(params[i:k]), unit_peaks=peaks[i:k], stage_input=stage_input
        )
        assert need[i, k] == scalar.model
    # the planners' "break" (a longer stage never needs less) holds
    assert (np.diff(need, axis=1)[np.triu_indices(n)] >= 0).all()


def _profile() -> ModelProfile:
    sizes = (1, 2, 4)
    units = tuple(
        UnitProfile(
            f"u{k}",
            param_bytes=10 * MB,
            time_s=(0.01, 0.02, 0.04),
            output_bytes=tuple(MB * s for s in sizes),
            memory_bytes=tuple((3 + k) * MB * s for s in sizes),
            backward_time_s=(0.02, 0.04, 0.08),
            activation_bytes=tuple(2 * MB * s for s in sizes),
        )
        for k in range(3)
    )
    return ModelProfile(batch_sizes=sizes, units=units, input_bytes=(MB, 2 * MB, 4 * MB))


def test_a_profile_gives_the_same_figures_as_the_training_planners_costs() -> None:
    profile = _profile()
    assert profile_need_matrix(profile, 2)[0, 3] == profile_stage_memory(profile, 0, 3, 2).model
    cluster = ClusterSpec((ClusterDevice("d"),))
    costs = TrainingCosts(profile, cluster, microbatch_size=4, optimizer="adam")
    for (start, end), share, warmup in itertools.product(
        [(0, 3), (1, 3), (2, 3)], [1, 2, 4], [1, 3]
    ):
        scalar = profile_stage_memory(
            profile, start, end, share, training=True, optimizer="adam", in_flight=warmup
        )
        assert costs.memory_bytes(start, end, share, warmup) == pytest.approx(scalar.model)
    # a share between profiled sizes reads between them, never below the smaller
    assert (
        costs.memory_bytes(0, 3, 2, 1)
        < costs.memory_bytes(0, 3, 3, 1)
        < costs.memory_bytes(0, 3, 4, 1)
    )


def test_the_training_planners_capacity_is_the_prediction_inverted() -> None:
    profile = _profile()
    need = {
        y: profile_stage_memory(profile, 0, 3, y, training=True, in_flight=2).model
        for y in (1, 2, 4)
    }
    for room, expected in [(need[1] - 1, 0), (need[1], 1), (need[2], 2), (need[4] + 1, 4)]:
        cluster = ClusterSpec((ClusterDevice("d", memory_bytes=room),))
        costs = TrainingCosts(profile, cluster, microbatch_size=4)
        device = cluster.device("d")
        assert costs.max_share(device, 0, 3, 2) == expected
        vector = costs.max_shares(device, np.array([0]), np.array([3]), 2)
        assert vector.tolist() == [expected]
