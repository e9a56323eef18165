"""Synchronous pipeline training: exact against single-process training.

In-process tests drive per-stage TrainShards through the schedules' action
lists; multi-process tests train on the shared local cluster.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from tests._support.training import (
    SGD,
    SPEC,
    assert_same_weights,
    make_batches,
    train_in_process,
    train_single_process,
)
from zpipe._errors import ConfigError, PipelineError, RemoteStageError
from zpipe.client import split_minibatch
from zpipe.cluster import LocalCluster
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.planner.training_plan import TrainingPlan
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.training.objectives import (
    check_optimizer,
    check_train_settings,
    microbatch_loss,
)
from zpipe.training.routing import route, split_rows

ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99]}


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
@pytest.mark.parametrize(
    ("schedule", "bounds", "m", "warmups"),
    [
        ("gpipe", [0, 2, 4], 4, None),
        ("1f1b", [0, 1, 2, 4], 4, None),
        ("1f1b", [0, 1, 2, 3, 4], 6, [2, 2, 1, 1]),
        ("1f1b", [0, 4], 3, None),
    ],
)
def test_pipelined_training_equals_single_process(
    optimizer: dict[str, object],
    schedule: str,
    bounds: list[int],
    m: int,
    warmups: list[int] | None,
) -> None:
    batches = make_batches(4, 7)  # 7 samples: uneven micro-batches
    want, want_losses = train_single_process(SPEC, batches, optimizer)
    got, losses, peaks = train_in_process(SPEC, batches, optimizer, bounds, schedule, m, warmups)
    assert_same_weights(got, want)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    expected = check_train_settings(
        {"schedule": schedule, "num_microbatches": m, "optimizer": optimizer, "warmups": warmups},
        len(bounds) - 1,
    )["warmups"]
    assert peaks == expected  # each stage held exactly K_p activations at its peak


def test_microbatch_losses_sum_to_the_minibatch_mean() -> None:
    out = torch.randn(10, 3)
    ce_target = torch.randint(0, 3, (10,))
    mse_target = torch.randn(10, 3)
    for name, target, whole in [
        ("cross_entropy", ce_target, F.cross_entropy(out, ce_target)),
        ("mse", mse_target, F.mse_loss(out, mse_target)),
    ]:
        parts = zip(torch.tensor_split(out, 3), torch.tensor_split(target, 3), strict=True)
        total = sum(microbatch_loss(name, o, t, 10) for o, t in parts)
        torch.testing.assert_close(total, whole)


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"name": "rmsprop", "lr": 0.1}, "unknown optimizer"),
        ({"name": "sgd"}, "lr is required"),
        ({"name": "sgd", "lr": -1}, "lr must be > 0"),
        ({"name": "sgd", "lr": 0.1, "betas": [0.9, 0.9]}, "unknown field 'betas'"),
        ({"name": "adam", "lr": 0.1, "betas": [0.9]}, "betas must be two numbers"),
        ({"name": "sgd", "lr": 0.1, "nesterov": 1}, "wrong type"),
        ({"name": "sgd", "lr": True}, "must be a number"),
    ],
)
def test_bad_optimizers_are_refused_with_the_field_named(
    config: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError, match=problem):
        check_optimizer(config)


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ({"schedule": "zigzag", "num_microbatches": 2, "optimizer": SGD}, "unknown schedule"),
        ({"num_microbatches": 0, "optimizer": SGD}, "num_microbatches"),
        ({"num_microbatches": 4, "optimizer": SGD, "warmups": [1, 2]}, "must not grow"),
        ({"num_microbatches": 4, "optimizer": SGD, "warmups": [5, 1]}, r"in 1\.\.4"),
        ({"num_microbatches": 4, "optimizer": SGD, "warmups": [1]}, "1 entries for 2 stages"),
        ({"num_microbatches": 4, "optimizer": SGD, "loss": "hinge"}, "unknown loss"),
        ({"num_microbatches": 4, "optimizer": SGD, "lr": 1}, "unknown training settings"),
    ],
)
def test_bad_training_settings_are_refused(settings: dict[str, object], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        check_train_settings(settings, 2)


def test_a_minibatch_smaller_than_the_microbatch_count_is_refused() -> None:
    with pytest.raises(ConfigError, match="drop_last"):
        split_minibatch((torch.zeros(3, 2), torch.zeros(3)), 4)
    with pytest.raises(ConfigError, match="same batch size"):
        split_minibatch((torch.zeros(4, 2), torch.zeros(3)), 2)
    with pytest.raises(ConfigError, match=r"inputs\.\.\., labels"):
        split_minibatch((torch.zeros(4, 2),), 2)


def test_a_backward_without_its_forward_is_an_error() -> None:
    units = load_layer_sequence(SPEC).build_units(0, 2)
    shard = TrainShard(units, start=0, first=True, last=False, loss="mse", optimizer=SGD)
    with pytest.raises(PipelineError, match="no saved forward"):
        shard.backward(3, ())
    shard.forward(0, (torch.randn(2, 12),))
    with pytest.raises(PipelineError, match="awaiting backward"):
        shard.step()


# ---------------------------------------------------------------- real processes


@pytest.mark.parametrize(
    ("schedule", "optimizer"), [("1f1b", ADAM), ("gpipe", SGD)], ids=["1f1b-adam", "gpipe-sgd"]
)
def test_cluster_training_equals_single_process(
    cluster: LocalCluster, schedule: str, optimizer: dict[str, object]
) -> None:
    batches = make_batches(3, 9, seed=5)
    want, want_losses = train_single_process(SPEC, batches, optimizer)
    report = cluster.fit(
        SPEC,
        batches,
        optimizer=optimizer,
        num_microbatches=3,
        schedule=schedule,
        partition=[[0, 1], [1, 3], [3, 4]],
        progress=False,
    )
    assert report.steps == 3
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)
    assert_same_weights(dict(report.model().state_dict()), want)
    assert set(report.stages) == {d.name for d in cluster.devices}


def test_a_training_failure_reaches_the_client_and_the_stages_keep_serving(
    cluster: LocalCluster,
) -> None:
    # class 9 of 4: the loss fails (fixed labels: random ones all below 4 would train)
    bad = [(torch.randn(4, 12), torch.tensor([9, 0, 1, 2]))]
    with pytest.raises(RemoteStageError, match="s2"):
        cluster.fit(
            SPEC,
            bad,
            optimizer=SGD,
            num_microbatches=2,
            partition=[[0, 2], [2, 3], [3, 4]],
            progress=False,
        )
    sequence = load_layer_sequence(SPEC)
    outputs, _ = cluster.infer(
        SPEC, [sequence.example_input(2, seed=1)], partition=[[0, 2], [2, 4]]
    )
    reference = build_full_model(SPEC)
    with torch.inference_mode():
        torch.testing.assert_close(outputs[0][0], reference(*sequence.example_input(2, seed=1))[0])


def test_activation_bytes_are_counted_per_live_forward_and_released_by_backward() -> None:
    units = load_layer_sequence(SPEC).build_units(1, 3)
    shard = TrainShard(units, start=1, first=False, last=False, loss="mse", optimizer=SGD)
    outputs = []
    for mb in range(3):
        out, _, _ = shard.forward(mb, (torch.randn(5, 24),))
        outputs.append(out)
    assert shard.live_activation_bytes > 0
    one = shard.live_activation_bytes // 3
    assert shard.live_activation_bytes == 3 * one  # equal shapes hold equal bytes
    # at least the two layers' inputs of 5 x 24 float32 are kept for the backward
    assert one >= 2 * 5 * 24 * 4
    for mb in range(3):
        shard.backward(mb, (torch.ones_like(outputs[mb][0]),))
    assert shard.live_activation_bytes == 0
    assert shard.peak_activation_bytes == 3 * one and shard.peak_live == 3


@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd-momentum", "adam"])
def test_a_shard_resumed_from_its_training_state_trains_on_identically(
    optimizer: dict[str, object],
) -> None:
    def one_step(shard: TrainShard, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        out, _, _ = shard.forward(0, (torch.randn(6, 12, generator=gen),))
        shard.backward(0, (torch.randn(out[0].shape, generator=gen),))
        shard.step()

    def build() -> TrainShard:
        units = load_layer_sequence(SPEC).build_units(0, 2)
        return TrainShard(units, start=0, first=True, last=False, loss="mse", optimizer=optimizer)

    original = build()
    for seed in range(3):
        one_step(original, seed)
    state = original.training_state()
    assert any("#opt." in key for key in state)  # momentum or moments, not only weights
    resumed = build()  # fresh initial weights and an optimizer that never stepped
    resumed.load_training_state(state)
    for seed in (3, 4):
        one_step(original, seed)
        one_step(resumed, seed)
    assert_same_weights(resumed.state_dict(), original.state_dict())
    # A replica for other units is refused rather than half applied.
    other = TrainShard(
        load_layer_sequence(SPEC).build_units(2, 4),
        start=2, first=False, last=True, loss="mse", optimizer=optimizer,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="does not match units"):
        other.load_training_state(state)


# ---------------------------------------------------------------- data-parallel groups


@given(
    total=st.integers(0, 40),
    shares=st.lists(st.integers(0, 9), min_size=1, max_size=5).filter(lambda s: sum(s) > 0),
)
def test_row_blocks_are_contiguous_and_proportional(total: int, shares: list[int]) -> None:
    blocks = split_rows(total, shares)
    assert blocks[0][0] == 0 and blocks[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    for (lo, hi), share in zip(blocks, shares, strict=True):
        assert abs((hi - lo) - total * share / sum(shares)) < 1  # rounding moves one row at most
    if total == sum(shares):
        assert [hi - lo for lo, hi in blocks] == shares  # the plan's micro-batch: exact shares


@given(
    total=st.integers(0, 30),
    senders=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    receivers=st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_routed_pieces_deliver_every_row_once_to_its_receiver(
    total: int, senders: list[int], receivers: list[int]
) -> None:
    pieces = route(total, senders, receivers)
    got: dict[int, list[int]] = {}
    for s, r, lo, hi in pieces:
        assert split_rows(total, senders)[s][0] <= lo < hi <= split_rows(total, senders)[s][1]
        got.setdefault(r, []).extend(range(lo, hi))
    for r, (lo, hi) in enumerate(split_rows(total, receivers)):
        assert sorted(got.get(r, [])) == list(range(lo, hi))


def group_plan(
    stages: list[dict[str, object]], m: int, microbatch: int, num_units: int = 4
) -> TrainingPlan:
    return TrainingPlan.from_dict(
        {
            "algo": "hpp",
            "schedule": "1f1b",
            "num_units": num_units,
            "microbatch_size": microbatch,
            "num_microbatches": m,
            "stages": stages,
            "predicted": {},
        }
    )


def test_hybrid_groups_train_like_a_single_process(cluster: LocalCluster) -> None:
    # s0 and s1 share the first two units 2:1; s2 runs the rest.
    plan = group_plan(
        [
            {"devices": ["s0", "s1"], "start": 0, "end": 2, "shares": [2, 1], "warmup": 3},
            {"devices": ["s2"], "start": 2, "end": 4, "shares": [3], "warmup": 1},
        ],
        m=4,
        microbatch=3,
    )
    batches = make_batches(3, 11, seed=8)  # 11 rows: micro-batches of 3, 3, 3, 2
    want, want_losses = train_single_process(SPEC, batches, SGD)
    report = cluster.fit(
        SPEC, batches, optimizer=SGD, num_microbatches=4, plan=plan, progress=False
    )
    # fit refuses replicas that differ, so equal weights here mean both replicas are right
    assert_same_weights(report.state_dict, want)
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert report.stages["s0"]["allreduce_s"] > 0 and report.stages["s2"]["allreduce_s"] == 0


def test_pure_data_parallelism_with_a_device_that_computes_nothing(cluster: LocalCluster) -> None:
    plan = group_plan(
        [{"devices": ["s0", "s1", "s2"], "start": 0, "end": 4, "shares": [2, 0, 1], "warmup": 1}],
        m=2,
        microbatch=3,
    )
    batches = make_batches(2, 6, seed=9)
    want, want_losses = train_single_process(SPEC, batches, ADAM)
    report = cluster.fit(
        SPEC, batches, optimizer=ADAM, num_microbatches=2, plan=plan, progress=False
    )
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    for key in want:  # Adam divides by small second moments: allow summation-order noise
        torch.testing.assert_close(report.state_dict[key], want[key], rtol=1e-4, atol=1e-4)
    assert report.stages["s1"]["microbatches"] == 0  # share 0: only the all-reduce


def test_a_deep_model_replicated_on_every_device_is_gathered_whole(
    cluster: LocalCluster,
) -> None:
    # 40 linear layers (80 tensors) on each of 3 devices: one checkpoint of 240 tensors,
    # more than a run with a smaller model or no replicas ever sends.
    deep = ModelSpec("mlp", {"dims": [12, *[6] * 39, 4], "activation": "relu"}, seed=3)
    plan = group_plan(
        [{"devices": ["s0", "s1", "s2"], "start": 0, "end": 40, "shares": [2, 2, 2], "warmup": 1}],
        m=1,
        microbatch=6,
        num_units=40,
    )
    batches = make_batches(2, 6, seed=4)
    want, want_losses = train_single_process(deep, batches, SGD)
    report = cluster.fit(
        deep, batches, optimizer=SGD, num_microbatches=1, plan=plan, progress=False
    )
    assert len(want) == 80
    assert report.losses == pytest.approx(want_losses, rel=1e-5)
    assert_same_weights(report.state_dict, want)


def test_the_coordinator_plans_hybrid_training_from_training_profiles(
    cluster: LocalCluster,
) -> None:
    batches = make_batches(2, 8, seed=12)
    want, _ = train_single_process(SPEC, batches, SGD)
    report = cluster.fit(SPEC, batches, optimizer=SGD, num_microbatches=2, progress=False)
    assert report.training_plan is not None and report.training_plan.algo == "hpp"
    assert report.training_plan.microbatch_size == 4  # 8 samples over 2 micro-batches
    assert report.training_plan.predicted["round_s"] > 0
    assert_same_weights(report.state_dict, want)
    assert '"training_planned"' in cluster.logs("coordinator")


def test_a_run_resumes_from_its_checkpoint(cluster: LocalCluster, tmp_path: Path) -> None:
    plain_sgd = {"name": "sgd", "lr": 0.1}  # no optimizer state: a checkpoint is all of it
    batches = make_batches(4, 6, seed=13)
    want, _ = train_single_process(SPEC, batches, plain_sgd)
    split = {"num_microbatches": 2, "partition": [[0, 2], [2, 4]], "progress": False}
    first = cluster.fit(SPEC, batches[:2], optimizer=plain_sgd, **split)
    checkpoint = tmp_path / "half.safetensors"
    first.save(checkpoint)
    resumed_spec = ModelSpec(
        SPEC.family, dict(SPEC.config), seed=SPEC.seed, weights=str(checkpoint)
    )
    second = cluster.fit(resumed_spec, batches[2:], optimizer=plain_sgd, **split)
    assert_same_weights(second.state_dict, want)


def test_a_group_keeps_batchnorm_statistics_identical_across_replicas(
    cluster: LocalCluster,
) -> None:
    cnn = ModelSpec("cnn", {"image_size": 8, "channels": [4, 8], "num_classes": 3}, seed=3)
    sequence = load_layer_sequence(cnn)
    before = build_full_model(cnn).state_dict()
    generator = torch.Generator().manual_seed(2)
    batches = [
        (sequence.example_input(6, seed=i)[0], torch.randint(0, 3, (6,), generator=generator))
        for i in range(2)
    ]
    n = sequence.num_units
    plan = TrainingPlan.from_dict(
        {
            "algo": "data-parallel",
            "schedule": "1f1b",
            "num_units": n,
            "microbatch_size": 3,
            "num_microbatches": 2,
            "stages": [
                {"devices": ["s0", "s1", "s2"], "start": 0, "end": n, "shares": [2, 0, 1],
                 "warmup": 1}
            ],
        }
    )  # fmt: skip
    # fit raises if any floating-point tensor differs between the replicas
    report = cluster.fit(cnn, batches, optimizer=SGD, num_microbatches=2, plan=plan, progress=False)
    means = [k for k in report.state_dict if k.endswith("running_mean")]
    assert means and all(not torch.equal(report.state_dict[k], before[k]) for k in means)
    # two micro-batches per round, two rounds: the counter holds the forwards of a replica
    counts = [k for k in report.state_dict if k.endswith("num_batches_tracked")]
    assert all(int(report.state_dict[k]) == 4 for k in counts)
