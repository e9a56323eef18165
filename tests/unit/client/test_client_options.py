"""The client's run options, keyword mapping and typed failures, without processes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from zpipe._errors import (
    ConfigError,
    InfeasiblePlanError,
    PipelineError,
    StageLostError,
    UnitsLostError,
)
from zpipe.client import (
    CONSISTENCIES,
    DEFAULT_REPLICATE_EVERY,
    InferOptions,
    PipelineClient,
    TrainOptions,
)
from zpipe.client.batches import BatchSource
from zpipe.client.failures import run_failed_error
from zpipe.client.runs.fit import rebalance_request, resume_request, training_request
from zpipe.client.runs.inference import inference_request
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.planner.training_plan import TrainingPlan, TrainStage

SGD = {"name": "sgd", "lr": 0.1}
SPEC = ModelSpec("mlp", {"dims": [4, 8, 2]}, seed=0)


def test_infer_options_from_keywords_and_over_options() -> None:
    options = InferOptions.from_keywords(None, {"microbatch_size": 4, "stages": 3})
    assert options.microbatch_size == 4 and options.stages == 3
    changed = InferOptions.from_keywords(options, {"dtype": "bfloat16"})
    assert (changed.microbatch_size, changed.dtype) == (4, "bfloat16")
    assert InferOptions.from_keywords(options, {}) is options
    with pytest.raises(
        TypeError, match="infer_stream\\(\\) got an unexpected keyword argument 'microbatch'"
    ):
        InferOptions.from_keywords(None, {"microbatch": 4})


def test_options_are_frozen_and_copy_what_they_are_given() -> None:
    partition = [[0, 1], [1, 2]]
    options = InferOptions(partition=partition, stage_names=["a", "b"])
    partition[0][1] = 9
    assert options.partition == ((0, 1), (1, 2))
    assert options.stage_names == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = "bfloat16"  # type: ignore[misc]
    optimizer = dict(SGD)
    train = TrainOptions(optimizer=optimizer, num_microbatches=2)
    optimizer["lr"] = 5.0
    assert train.optimizer["lr"] == 0.1


@pytest.mark.parametrize(
    ("keywords", "problem"),
    [
        ({"recovery": "fastest"}, "unknown recovery 'fastest'"),
        ({"microbatch_size": 0}, "microbatch_size must be >= 1"),
        ({"max_in_flight": 0}, "max_in_flight must be >= 1"),
        ({"stages": 0}, "stages must be >= 1"),
        ({"wait_for_stages_s": float("inf")}, "wait_for_stages_s must be a number"),
        ({"stage_names": "s0"}, "stage_names must be a list"),
        ({"partition": [[0, "x"]]}, "partition must be unit ranges"),
    ],
)
def test_bad_infer_options_are_refused_with_the_field_named(
    keywords: dict[str, object], problem: str
) -> None:
    with pytest.raises(ConfigError, match=problem):
        InferOptions(**keywords)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keywords", "problem"),
    [
        ({"replication": "gossip"}, "unknown replication 'gossip'"),
        ({"consistency": "eventual"}, "unknown consistency 'eventual'"),
        ({"recovery": "pray"}, "unknown recovery 'pray'"),
        ({"replicate_every": 0}, "replicate_every must be >= 1"),
        ({"rebalance": 0.2}, "rebalance needs recover=True"),
        ({"recover": True, "rebalance": 1.5}, "rebalance needs recover=True"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
        ({"num_microbatches": True}, "num_microbatches must be >= 1"),
        ({"max_steps_in_flight": 0}, "max_steps_in_flight must be >= 1"),
        ({"loss": "hinge"}, "unknown loss"),
        ({"optimizer": {"name": "sgd"}}, "lr is required"),
    ],
)
def test_bad_train_options_are_refused_with_the_field_named(
    keywords: dict[str, object], problem: str
) -> None:
    settings: dict[str, object] = {"optimizer": SGD, "num_microbatches": 2, **keywords}
    with pytest.raises(ConfigError, match=problem):
        TrainOptions(**settings)  # type: ignore[arg-type]


def test_train_options_need_the_optimizer_and_the_microbatch_count() -> None:
    with pytest.raises(TypeError, match="fit\\(\\) needs the keyword arguments num_microbatches"):
        TrainOptions.from_keywords(None, {"optimizer": SGD})
    options = TrainOptions(optimizer=SGD, num_microbatches=2)
    assert TrainOptions.from_keywords(options, {"recover": True}).recover


def test_the_replica_period_follows_recover() -> None:
    assert TrainOptions(optimizer=SGD, num_microbatches=1).replica_period is None
    recovering = TrainOptions(optimizer=SGD, num_microbatches=1, recover=True)
    assert recovering.replica_period == DEFAULT_REPLICATE_EVERY
    every = dataclasses.replace(recovering, replicate_every=3)
    assert every.replica_period == 3
    assert CONSISTENCIES == ("exact", "fast")


def test_chain_and_global_periods_go_together_with_chain_replication() -> None:
    both = TrainOptions(
        optimizer=SGD, num_microbatches=1, recover=True, replication="chain",
        chain_every=2, global_every=6,
    )  # fmt: skip
    assert (both.replica_period, both.global_period) == (2, 6)
    assert dataclasses.replace(both, recover=False).global_period is None
    with pytest.raises(ConfigError, match="go with replication='chain' or 'topology'"):
        TrainOptions(optimizer=SGD, num_microbatches=1, recover=True, global_every=4)
    with pytest.raises(ConfigError, match="name the same period"):
        dataclasses.replace(both, replicate_every=3)
    with pytest.raises(ConfigError, match="global_every must be >= 1"):
        dataclasses.replace(both, global_every=0)


def test_the_batches_since_the_global_copy_are_kept_to_train_again() -> None:
    source = BatchSource([(torch.full((1,), float(i)), torch.zeros(1)) for i in range(7)])

    async def take(n: int) -> list[float]:
        out: list[float] = []
        async for batch in source.iterate():
            out.append(float(batch[0][0]))
            if len(out) == n:
                break
        return out

    source.replicated(0, 1, 0, global_copy=True, keep=True)
    assert asyncio.run(take(4)) == [0.0, 1.0, 2.0, 3.0]
    source.replicated(2, 1, 2, keep=True)  # a chain replica: 0-1 kept aside
    source.replicated(4, 1, 4, keep=True)
    assert (source.kept_from, source.global_step, len(source.since_global)) == (4, 0, 4)
    source.rewind_to_global()
    assert (source.kept_from, source.replica_step, source.resume) == (0, 0, (1, 0))
    # the next attempt trains 0-3 again, then goes on
    assert asyncio.run(take(6)) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    source.replicated(6, 2, 6)  # without keep (no global copies): nothing kept aside
    assert source.since_global == [] and source.global_step is None
    with pytest.raises(ConfigError, match="no global copy"):
        source.rewind_to_global()


def test_the_inference_request_is_the_wire_body_of_the_options() -> None:
    options = InferOptions(partition=[[0, 1], [1, 2]], stage_names=("a", "b"), max_in_flight=2)
    body = inference_request(SPEC, options, "tcp://127.0.0.1:9").body()
    assert body == {
        "model": SPEC.to_dict(),
        "partition": [[0, 1], [1, 2]],
        "stages": None,
        "stage_names": ["a", "b"],
        "dtype": "float32",
        "planner": "pipeedge",
        "microbatch_size": None,
        "profile": None,
        "sink_endpoint": "tcp://127.0.0.1:9",
        "wait_for_stages_s": 30.0,
        "recover": True,
        "recovery": "lightweight",
    }


def test_a_user_code_model_declares_its_unit_count_and_a_built_in_one_does_not() -> None:
    # The coordinator counts units without running a peer's factory (issue 19): the
    # client, which named the factory, counts them and says so; built-in families are
    # counted from their config, and their requests keep today's bytes.
    user = ModelSpec(
        "sequential", {"factory": "zpipe.models.examples:tiny_sequential", "input_shape": [8]}
    )
    options = InferOptions()
    body = inference_request(user, options, "tcp://127.0.0.1:9").body()
    assert body["num_units"] == load_layer_sequence(user).num_units > 1
    assert "num_units" not in inference_request(SPEC, options, "tcp://127.0.0.1:9").body()
    train = TrainOptions(optimizer=SGD, num_microbatches=1)
    trained = training_request(user, train, None, "tcp://127.0.0.1:9").body()
    assert trained["num_units"] == (body["num_units"])


def test_training_requests_for_a_start_a_recovery_and_a_rebalance() -> None:
    options = TrainOptions(
        optimizer=SGD, num_microbatches=2, partition=[[0, 1], [1, 2]], stage_names=["a", "b"]
    )
    request = training_request(SPEC, options, 4, "tcp://127.0.0.1:9")
    body = request.body()
    assert body["planner"] == "hpp" and body["microbatch_size"] == 4
    assert body["admit"] == ["a", "b"] and body["mode"] == "train"
    assert body["train"] == {
        "schedule": "1f1b",
        "num_microbatches": 2,
        "loss": "cross_entropy",
        "optimizer": SGD,
        "warmups": None,
        "plan": None,
    }
    assert training_request(SPEC, options, None, "e").body()["planner"] == "pipeedge"
    resumed = resume_request(request, ["a"], ["b"], "heavy", (3, 6), "exact").body()
    assert resumed["partition"] is None and resumed["stage_names"] == ["a"]
    assert resumed["planner"] == "hpp"  # the user's partition named the dead
    assert resumed["resume"] == {"run": 3, "step": 6, "dead": ["b"], "consistency": "exact"}
    plan = TrainingPlan(
        algo="even",
        schedule="1f1b",
        num_units=2,
        microbatch_size=2,
        num_microbatches=2,
        stages=(
            TrainStage(devices=("a",), start=0, end=1, shares=(2,), warmup=2),
            TrainStage(devices=("b",), start=1, end=2, shares=(2,), warmup=1),
        ),
    )
    moved = rebalance_request(request, plan, (3, 6)).body()
    assert moved["stage_names"] == ["a", "b"] and moved["resume"]["dead"] == []
    assert moved["train"]["plan"] == plan.to_dict()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("units [2, 4) are lost: b and the holder of their backup (c) are gone", UnitsLostError),
        ("stages ['b'] are gone; their weights are lost", StageLostError),
        ("stage 'b' died: no heartbeat for 2.6 s and no answer to a probe", StageLostError),
        ("stage 'b' failed: no heartbeat for 2.6 s", StageLostError),
        ("1 stages registered, 3 needed after waiting 30.0 s", InfeasiblePlanError),
        ("stages ['x'] are not registered after waiting 5 s", InfeasiblePlanError),
        ("the model needs 2 GB but 2 devices hold 1 GB; 1 GB short: add", InfeasiblePlanError),
        ("run 4 is not the current run", PipelineError),
    ],
)
def test_the_coordinators_failures_become_typed_errors(error: str, kind: type) -> None:
    raised = run_failed_error(error, "start the run")
    assert type(raised) is kind
    if isinstance(raised, UnitsLostError):
        assert raised.units == (2, 4) and "holder of their backup" in str(raised)
    elif isinstance(raised, StageLostError):
        assert raised.stage == "b"
    else:
        assert str(raised) == f"the coordinator could not start the run: {error}"


def test_a_client_that_is_not_open_says_so_after_the_options_are_checked() -> None:
    client = PipelineClient("tcp://127.0.0.1:1")
    with pytest.raises(PipelineError, match="open\\(\\) the client first"):
        asyncio.run(client.infer(SPEC, []))
    with pytest.raises(ConfigError, match="unknown recovery"):
        asyncio.run(client.infer(SPEC, [], options=InferOptions(), recovery="x"))
    with pytest.raises(PipelineError, match="open\\(\\) the client first"):
        asyncio.run(client.fit(SPEC, [], options=TrainOptions(optimizer=SGD, num_microbatches=1)))
