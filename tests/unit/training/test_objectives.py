"""Training objectives: AdamW, learning-rate schedules, user loss/optimizer callables,
and how a traced model is planned. In-process only (fast)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._support.coordinator_harness import Harness
from zpipe._errors import ConfigError, UntrustedCodeError
from zpipe.cli.train import build_parser
from zpipe.cli.train import main as train_main
from zpipe.client.runs.fit import check_traced_microbatches
from zpipe.coordinator.commands import PlanTraining
from zpipe.coordinator.decisions import check_plan_fits_model, training_planner_for
from zpipe.models import ModelSpec, build_full_model, load_layer_sequence
from zpipe.models.trust import FactoryAllowList, peer_factories_allowed
from zpipe.planner.training_plan import TrainingPlan
from zpipe.stage.executors.training_shard import TrainShard
from zpipe.training.lr_schedules import check_lr_schedule, lr_factor
from zpipe.training.objectives import check_optimizer, check_train_settings, make_optimizer

SPEC = ModelSpec("mlp", {"dims": [12, 24, 24, 4], "activation": "gelu"}, seed=3)
ADAMW = {"name": "adamw", "lr": 0.02, "weight_decay": 0.1, "betas": [0.8, 0.99]}
TORCH_CE = "torch.nn.functional:cross_entropy"
TORCH_SGD = "torch.optim:SGD"


def batches(count: int, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(9)
    return [
        (
            torch.randn(size, 12, generator=generator),
            torch.randint(0, 4, (size,), generator=generator),
        )
        for _ in range(count)
    ]


def two_stage_training(
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    optimizer: dict[str, Any],
    loss: str = "cross_entropy",
    lr_schedule: dict[str, Any] | None = None,
    micro: int = 2,
) -> dict[str, torch.Tensor]:
    """Two TrainShards (units [0, 2) and [2, 3)), each mini-batch split into ``micro``
    uneven micro-batches, tensors moved by hand."""
    sequence = load_layer_sequence(SPEC)
    stages = [
        TrainShard(sequence.build_units(0, 2), start=0, first=True, last=False, loss=loss,
                   optimizer=optimizer, lr_schedule=lr_schedule),
        TrainShard(sequence.build_units(2, 3), start=2, first=False, last=True, loss=loss,
                   optimizer=optimizer, lr_schedule=lr_schedule),
    ]  # fmt: skip
    for x, y in data:
        parts = list(zip(torch.tensor_split(x, micro), torch.tensor_split(y, micro), strict=True))
        for mb, (xs, ys) in enumerate(parts):
            hidden, _, _ = stages[0].forward(mb, (xs,))
            stages[1].forward(mb, hidden, ys, int(y.shape[0]))
            grads, _ = stages[1].backward(mb)
            stages[0].backward(mb, grads)
        for stage in stages:
            stage.step()
    return {**stages[0].state_dict(), **stages[1].state_dict()}


def single_process(
    data: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    scheduler: Any = None,
) -> dict[str, torch.Tensor]:
    for x, y in data:
        optimizer.zero_grad()
        F.cross_entropy(model(x)[0], y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model.state_dict()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)


# ------------------------------------------------------------------ AdamW


def test_adamw_is_accepted_and_per_stage_adamw_equals_one_over_the_model() -> None:
    assert check_optimizer(ADAMW)["name"] == "adamw"
    model = build_full_model(SPEC).train()
    optimizer = make_optimizer(ADAMW, model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW)
    data = batches(3)
    reference = torch.optim.AdamW(
        (model := build_full_model(SPEC).train()).parameters(),
        lr=0.02, weight_decay=0.1, betas=(0.8, 0.99),
    )  # fmt: skip
    assert_same(two_stage_training(data, optimizer=ADAMW), single_process(data, reference, model))
    with pytest.raises(ConfigError, match="unknown field 'momentum'"):
        check_optimizer({**ADAMW, "momentum": 0.9})


def test_the_plan_and_train_commands_offer_the_optimizers_fit_accepts() -> None:
    from zpipe.planner.training_cost import OPTIMIZER_STATE_COPIES

    for name in ("sgd", "adam", "adamw"):
        assert build_parser().parse_args(["--optimizer", name]).optimizer == name
        check_optimizer({"name": name, "lr": 0.1})
        assert name in OPTIMIZER_STATE_COPIES


# ------------------------------------------------------------------ learning-rate schedules


def test_cosine_after_warmup_matches_torchs_cosine_annealing() -> None:
    warmup, total = 3, 13
    schedule = check_lr_schedule({"name": "cosine", "warmup_steps": warmup, "total_steps": total})
    assert [lr_factor(schedule, s) for s in range(warmup)] == [1 / 3, 2 / 3, 1.0]
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    annealing = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warmup)
    for step in range(warmup, total + 1):
        assert math.isclose(lr_factor(schedule, step), optimizer.param_groups[0]["lr"],
                            abs_tol=1e-12)  # fmt: skip
        optimizer.step()
        annealing.step()
    assert lr_factor(schedule, total + 5) == 0.0  # stays at the end


def test_linear_and_constant_schedules() -> None:
    linear = check_lr_schedule({"name": "linear", "warmup_steps": 0, "total_steps": 4})
    assert [lr_factor(linear, s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    constant = check_lr_schedule({"name": "constant", "warmup_steps": 2})
    assert [lr_factor(constant, s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(None, 7) == 1.0


@pytest.mark.parametrize(
    ("schedule", "problem"),
    [
        ({"name": "cosine", "warmup_steps": 5, "total_steps": 5}, "total_steps must be"),
        ({"name": "linear"}, "total_steps must be"),
        ({"name": "step"}, "unknown lr schedule"),
        ({"name": "constant", "warmup_steps": -1}, "warmup_steps"),
        ({"name": "constant", "total_steps": 3}, "does not apply"),
        ({"name": "cosine", "total_steps": 3, "gamma": 0.1}, "unknown fields"),
    ],
)
def test_bad_schedules_are_refused(schedule: dict[str, Any], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        check_lr_schedule(schedule)
    with pytest.raises(ConfigError, match=problem):
        check_train_settings(
            {"num_microbatches": 2, "optimizer": {"name": "sgd", "lr": 0.1},
             "lr_schedule": schedule}, 2
        )  # fmt: skip


def test_scheduled_stages_train_like_torchs_scheduler() -> None:
    schedule = {"name": "linear", "warmup_steps": 1, "total_steps": 5}
    sgd = {"name": "sgd", "lr": 0.2, "momentum": 0.9}
    data = batches(4)
    model = build_full_model(SPEC).train()
    reference = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    # the same rates from torch's own LambdaLR: warm-up 1, then linear to 0 at 5
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        reference, lambda s: 1.0 if s < 1 else 1.0 - (s - 1) / 4
    )
    got = two_stage_training(data, optimizer=sgd, lr_schedule=schedule)
    assert_same(got, single_process(data, reference, model, scheduler))


# ------------------------------------------------------------------ user callables


def test_a_loss_callable_is_weighed_by_micro_batch_share() -> None:
    data = batches(2, size=7)  # micro-batches of 4 and 3 samples
    sgd = {"name": "sgd", "lr": 0.3}
    named = two_stage_training(data, optimizer=sgd, loss="cross_entropy")
    user = two_stage_training(data, optimizer=sgd, loss=TORCH_CE)
    assert_same(user, named)


def test_an_optimizer_callable_builds_the_stages_optimizer() -> None:
    data = batches(2)
    named = two_stage_training(data, optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.5})
    user = two_stage_training(data, optimizer={"name": TORCH_SGD, "lr": 0.1, "momentum": 0.5})
    assert_same(user, named)
    with pytest.raises(ConfigError, match=r"not a torch\.optim\.Optimizer"):
        make_optimizer({"name": "builtins:list"}, [])
    with pytest.raises(ConfigError, match="raised TypeError"):
        make_optimizer({"name": TORCH_SGD, "lr": 0.1, "nesterov_typo": True}, [])
    with pytest.raises(ConfigError, match="must be a number, string"):
        check_optimizer({"name": TORCH_SGD, "lr": {"nested": 1}})


def test_a_peers_loss_or_optimizer_callable_needs_the_stages_allow_list() -> None:
    peer_spec = ModelSpec.from_dict(SPEC.to_dict())  # as a stage receives it
    assert peer_spec.from_peer

    def build(loss: str, optimizer: dict[str, Any]) -> TrainShard:
        return TrainShard.build(
            peer_spec, 0, 3, first=True, last=True, loss=loss, optimizer=optimizer
        )

    with pytest.raises(UntrustedCodeError, match="--allow-factory"):
        build(TORCH_CE, {"name": "sgd", "lr": 0.1})
    with pytest.raises(UntrustedCodeError, match="--allow-factory"):
        build("cross_entropy", {"name": TORCH_SGD, "lr": 0.1})
    with peer_factories_allowed(FactoryAllowList.of(TORCH_CE, TORCH_SGD)):
        shard = build(TORCH_CE, {"name": TORCH_SGD, "lr": 0.1})
    assert isinstance(shard.optimizer, torch.optim.SGD)


def test_the_train_command_runs_user_code_only_with_allow_factory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        train_main(["--optimizer", TORCH_SGD, "--steps", "1"])
    assert exited.value.code == 2
    assert f"--allow-factory {TORCH_SGD}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--optimizer", "lamb"])
    assert "adamw" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main(["--warmup-steps", "3"])
    assert "--lr-schedule" in capsys.readouterr().err


# ------------------------------------------------------------------ traced models


TRACED = ModelSpec(
    "traced",
    {"factory": "zpipe.models.examples:tiny_residual", "input_shape": [8], "microbatch_size": 4},
)


def test_a_traced_model_is_planned_straight_or_refused_naming_the_planner() -> None:
    assert training_planner_for("traced", "hpp") == "straight"
    assert training_planner_for("traced", "even") == "even"
    assert training_planner_for("mlp", "hpp") == "hpp"
    assert training_planner_for("mlp", "data-parallel") == "data-parallel"
    with pytest.raises(ConfigError, match="planner 'straight'"):
        training_planner_for("traced", "data-parallel")
    grouped = TrainingPlan.from_dict(
        {
            "algo": "hpp", "schedule": "1f1b", "num_units": 4, "microbatch_size": 4,
            "num_microbatches": 2,
            "stages": [
                {"devices": ["a", "b"], "start": 0, "end": 2, "shares": [2, 2], "warmup": 2},
                {"devices": ["c"], "start": 2, "end": 4, "shares": [4], "warmup": 1},
            ],
        }
    )  # fmt: skip
    check_plan_fits_model("mlp", grouped)
    with pytest.raises(ConfigError, match=r"group \['a', 'b'\].*planner 'straight'"):
        check_plan_fits_model("traced", grouped)


def test_the_coordinator_plans_a_traced_run_straight_by_default() -> None:
    h = Harness()
    for name in ("a", "b"):
        h.register(name)
    train = {"num_microbatches": 2, "optimizer": {"name": "sgd", "lr": 0.1}}
    request = dict(
        model=TRACED.to_dict(), dtype="float32", sink_endpoint="tcp://client:9",
        wait_for_stages_s=0.0, mode="train", stage_names=["a", "b"], train=train,
        microbatch_size=4, num_units=4,
    )  # fmt: skip
    h.client("run_request", planner="hpp", **request)
    planned = [job for job in h.jobs if isinstance(job, PlanTraining)]
    assert [job.algo for job in planned] == ["straight"]
    h.client("run_request", planner="data-parallel", **request)
    failures = h.to_client("run_failed")
    assert failures and "planner 'straight'" in str(failures[-1].body["error"])
    assert len([job for job in h.jobs if isinstance(job, PlanTraining)]) == 1


def test_a_traced_models_micro_batches_must_match_its_trace() -> None:
    check_traced_microbatches(TRACED, 8, 2)
    check_traced_microbatches(SPEC, 7, 2)  # a built-in model takes any size
    with pytest.raises(ConfigError, match=r"traced at micro-batches of 4.*16 samples"):
        check_traced_microbatches(TRACED, 8, 4)
