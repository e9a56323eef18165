"""The 1F1B warm-up policy: Asteroid's or torch's counts, and "auto" choosing between them."""

from __future__ import annotations

import pytest
import torch

from tests._support.training import SGD, SPEC, assert_same_weights, make_batches, train_in_process
from zpipe._errors import ConfigError
from zpipe.client.options import TrainOptions
from zpipe.client.runs.fit import training_request
from zpipe.models import load_layer_sequence
from zpipe.planner.schedules import peak_live_activations, pipeline_actions, simulate
from zpipe.training.objectives import check_train_settings
from zpipe.training.warmup import (
    check_warmup_policy,
    resolve_warmup_policy,
    warmup_counts,
)


def test_the_two_rules_give_asteroids_and_torchs_counts() -> None:
    assert warmup_counts("asteroid", 4, 8) == [7, 5, 3, 1]
    assert warmup_counts("torch", 4, 8) == [4, 3, 2, 1]
    # both capped at M; with one stage both are 1
    assert warmup_counts("asteroid", 4, 3) == [3, 3, 3, 1]
    assert warmup_counts("torch", 4, 3) == [3, 3, 2, 1]
    assert warmup_counts("asteroid", 1, 5) == warmup_counts("torch", 1, 5) == [1]
    with pytest.raises(ConfigError, match="resolve"):
        warmup_counts("auto", 2, 2)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 6), (4, 8), (5, 3)])
@pytest.mark.parametrize("policy", ["asteroid", "torch"])
def test_both_policies_make_valid_schedules_that_hold_k_activations(
    policy: str, stages: int, microbatches: int
) -> None:
    counts = warmup_counts(policy, stages, microbatches)
    actions = pipeline_actions(
        "1f1b", num_stages=stages, num_microbatches=microbatches, warmups=counts
    )
    assert [peak_live_activations(a) for a in actions] == counts
    # and they run to the end (simulate raises when stages wait on each other forever)
    result = simulate(
        actions, [1.0] * stages, [2.0] * stages, [0.5] * (stages - 1), [0.5] * (stages - 1)
    )
    assert result.round_s > 0


def test_torch_counts_are_never_deeper_and_differ_past_the_last_stage() -> None:
    for stages in range(2, 7):
        asteroid = warmup_counts("asteroid", stages, 16)
        torch_counts = warmup_counts("torch", stages, 16)
        assert all(t <= a for t, a in zip(torch_counts, asteroid, strict=True))
        assert torch_counts[:-1] != asteroid[:-1]
        assert torch_counts[-1] == asteroid[-1] == 1


def test_auto_takes_asteroids_counts() -> None:
    # chosen by measurement (zpipe/training/warmup.py): never slower on shared cores
    assert resolve_warmup_policy("auto") == "asteroid"
    assert resolve_warmup_policy("asteroid") == "asteroid"
    assert resolve_warmup_policy("torch") == "torch"
    with pytest.raises(ConfigError, match="warmup must be one of"):
        check_warmup_policy("deep")


def test_run_settings_fill_in_the_policys_counts() -> None:
    base = {"num_microbatches": 8, "optimizer": SGD}
    assert check_train_settings(base, 3)["warmups"] == [5, 3, 1]  # auto: Asteroid's
    shallow = {**base, "warmup": "torch"}
    assert check_train_settings(shallow, 3)["warmups"] == [3, 2, 1]
    forced = {**base, "warmup": "asteroid"}
    assert check_train_settings(forced, 3)["warmups"] == [5, 3, 1]
    given = {**base, "warmup": "torch", "warmups": [4, 4, 1]}
    assert check_train_settings(given, 3)["warmups"] == [4, 4, 1]  # explicit counts win
    gpipe = {**base, "schedule": "gpipe", "warmup": "torch"}
    assert check_train_settings(gpipe, 3)["warmups"] == [8, 8, 8]
    with pytest.raises(ConfigError, match="warmup must be one of"):
        check_train_settings({**base, "warmup": "deep"}, 3)


def test_the_client_sends_the_policy_only_when_it_is_not_auto() -> None:
    auto = TrainOptions(optimizer=SGD, num_microbatches=4)
    torch_counts = TrainOptions(optimizer=SGD, num_microbatches=4, warmup="torch")
    assert "warmup" not in training_request(SPEC, auto, 4, "tcp://127.0.0.1:1").body()["train"]
    sent = training_request(SPEC, torch_counts, 4, "tcp://127.0.0.1:1").body()["train"]
    assert sent["warmup"] == "torch"
    with pytest.raises(ConfigError):
        TrainOptions(optimizer=SGD, num_microbatches=4, warmup="deep")


def test_training_results_do_not_depend_on_the_warmup_policy() -> None:
    # Synchronous 1F1B: one optimizer step per mini-batch after every backward, so the
    # warm-up depth changes when the work happens, never what it computes.
    torch.manual_seed(0)
    units = load_layer_sequence(SPEC).num_units
    bounds = [0, 1, 2, 3, units]
    batches = make_batches(3, 8)
    runs = {
        policy: train_in_process(
            SPEC, batches, SGD, bounds, "1f1b", 6, warmup_counts(policy, len(bounds) - 1, 6)
        )
        for policy in ("asteroid", "torch")
    }
    (a_state, a_losses, a_peaks), (t_state, t_losses, t_peaks) = runs.values()
    assert a_peaks == [6, 5, 3, 1] and t_peaks == [4, 3, 2, 1]
    assert_same_weights(t_state, a_state)
    assert t_losses == pytest.approx(a_losses, rel=1e-6)
