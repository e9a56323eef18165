"""Asynchronous 1F1B takes what synchronous runs take: lr schedules, user losses and
optimizers, a device; each checked on real stage shards in one process against the
single-process reference with the same settings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._support.async_shards import run_shards, shard_weights
from tests._support.async_training import ADAM, SGD, SPEC, make_batches
from zpipe._errors import ConfigError, UntrustedCodeError
from zpipe.client.reports import TrainReport
from zpipe.devices import BoundaryMover, DeviceUnavailableError
from zpipe.models import ModelSpec, build_full_model
from zpipe.models.trust import FactoryAllowList, peer_factories_allowed
from zpipe.models.weights import read_matching, write_state
from zpipe.planner.async_schedule import AsyncSettings, versions_read_after
from zpipe.stage.executors.async_shard import AsyncShard
from zpipe.training.async_reference import train_async_reference
from zpipe.training.async_stage import AsyncStageCompute
from zpipe.training.lr_schedules import lr_factor
from zpipe.training.objectives import check_train_settings, make_optimizer

COSINE = {"name": "cosine", "warmup_steps": 2, "total_steps": 9}
TORCH_CE = "torch.nn.functional:cross_entropy"
TORCH_SGD = "torch.optim:SGD"


def build_shards(
    spec: ModelSpec,
    bounds: Sequence[int],
    *,
    optimizer: Mapping[str, Any],
    loss: str = "cross_entropy",
    lr_schedule: Mapping[str, Any] | None = None,
) -> list[AsyncShard]:
    n = len(bounds) - 1
    shards = []
    for i in range(n):
        shard = AsyncShard.build(
            spec,
            bounds[i],
            bounds[i + 1],
            first=i == 0,
            last=i == n - 1,
            loss=loss,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
        )
        assert isinstance(shard, AsyncShard)
        shards.append(shard)
    return shards


def assert_equal_state(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


# ---------------------------------------------------------------- lr schedules


def test_one_stage_with_a_schedule_is_plain_training_at_each_minibatchs_rate() -> None:
    batches = make_batches(9, 6)
    result = train_async_reference(SPEC, batches, bounds=[0, 4], optimizer=SGD, lr_schedule=COSINE)
    model = build_full_model(SPEC).train()
    optimizer = make_optimizer(SGD, model.parameters())
    losses = []
    for step, (x, y) in enumerate(batches):
        for group in optimizer.param_groups:
            group["lr"] = SGD["lr"] * lr_factor(COSINE, step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x)[0], y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert result.losses == losses
    assert_equal_state(result.state_dict, model.state_dict())


def test_a_stage_reads_the_schedule_at_its_own_update_count() -> None:
    """Update ``u`` uses lr(u): a stage adopted at 5 updates (a resumed or moved one)
    goes on with lr(5), whatever the other stages are at."""
    unit = nn.Linear(3, 2)
    compute = AsyncStageCompute(
        [unit], first=True, last=True, loss="mse", optimizer=SGD, lr_schedule=COSINE
    )
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    for batch in range(2):
        compute.forward(batch, compute.updates, (x,), y, 4)
        compute.backward(batch)
        compute.step(batch)
        assert compute.last_lrs == [SGD["lr"] * lr_factor(COSINE, batch)]
    moved = AsyncStageCompute.adopt(
        [state for state in compute.unit_states()],
        updates=2,
        first=True,
        last=True,
        loss="mse",
        optimizer=SGD,
        lr_schedule=COSINE,
    )
    moved.updates = 5  # as a run resumed after 5 mini-batches
    moved._versions[5] = moved._versions.pop(2)
    moved.forward(0, 5, (x,), y, 4)
    moved.backward(0)
    moved.step(0)
    assert moved.last_lrs == [SGD["lr"] * lr_factor(COSINE, 5)]
    assert lr_factor(COSINE, 5) not in (lr_factor(COSINE, 0), lr_factor(COSINE, 1))


@pytest.mark.parametrize(
    ("optimizer", "settings"),
    [
        (SGD, AsyncSettings()),
        (ADAM, AsyncSettings(aggregate=True)),
        (SGD, AsyncSettings(vertical_sync=False)),
    ],
    ids=["sgd", "adam-aggregate", "sgd-no-vsync"],
)
def test_shards_with_a_schedule_equal_the_reference_with_it(
    optimizer: dict[str, Any], settings: AsyncSettings
) -> None:
    batches = make_batches(9, 5, seed=3)
    bounds = [0, 1, 3, 4]
    want = train_async_reference(
        SPEC, batches, bounds=bounds, optimizer=optimizer, settings=settings, lr_schedule=COSINE
    )
    shards = build_shards(SPEC, bounds, optimizer=optimizer, lr_schedule=COSINE)
    assert run_shards(shards, batches, settings=settings) == want.losses
    assert_equal_state(shard_weights(shards), want.state_dict)
    # the schedule changed the run: without it the weights differ
    plain = train_async_reference(
        SPEC, batches, bounds=bounds, optimizer=optimizer, settings=settings
    )
    assert not all(torch.equal(plain.state_dict[k], v) for k, v in want.state_dict.items())


def test_async_settings_take_an_lr_schedule() -> None:
    checked = check_train_settings(
        {
            "schedule": "async-1f1b",
            "num_microbatches": 1,
            "optimizer": SGD,
            "lr_schedule": {"name": "linear", "total_steps": 10},
        },
        3,
    )
    assert checked["lr_schedule"] == {"name": "linear", "warmup_steps": 0, "total_steps": 10}


# ---------------------------------------------------------------- user code


def test_shards_with_a_user_loss_and_optimizer_equal_the_reference_with_them() -> None:
    batches = make_batches(7, 5, seed=5)
    bounds = [0, 2, 4]
    optimizer = {"name": TORCH_SGD, "lr": 0.05, "momentum": 0.9}
    want = train_async_reference(
        SPEC, batches, bounds=bounds, optimizer=optimizer, loss=TORCH_CE, lr_schedule=COSINE
    )
    peer_spec = ModelSpec.from_dict(SPEC.to_dict())  # as a stage receives it
    with pytest.raises(UntrustedCodeError, match="--allow-factory"):
        build_shards(peer_spec, bounds, optimizer=optimizer, loss="cross_entropy")
    with pytest.raises(UntrustedCodeError, match="--allow-factory"):
        build_shards(peer_spec, bounds, optimizer=SGD, loss=TORCH_CE)
    with peer_factories_allowed(FactoryAllowList.of(TORCH_CE, TORCH_SGD)):
        shards = build_shards(
            peer_spec, bounds, optimizer=optimizer, loss=TORCH_CE, lr_schedule=COSINE
        )
    assert all(isinstance(s.compute.optimizer, torch.optim.SGD) for s in shards)
    assert run_shards(shards, batches) == want.losses
    assert_equal_state(shard_weights(shards), want.state_dict)


def test_a_user_loss_is_what_the_last_stage_computes() -> None:
    """The reference calls the user's function on the last stage's output, once per
    mini-batch, and trains on what it returns."""
    batches = make_batches(4, 5, seed=5)
    calls: list[int] = []

    def counting_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(len(target))
        return F.cross_entropy(output, target) * 2.0

    import tests._support.async_shards as module

    module.counting_loss = counting_loss  # type: ignore[attr-defined]
    try:
        user = train_async_reference(
            SPEC,
            batches,
            bounds=[0, 2, 4],
            optimizer=SGD,
            loss="tests._support.async_shards:counting_loss",
        )
    finally:
        del module.counting_loss  # type: ignore[attr-defined]
    builtin = train_async_reference(SPEC, batches, bounds=[0, 2, 4], optimizer=SGD)
    assert calls == [5, 5, 5, 5]
    # batches 0 and 1 forward with version 0 everywhere (two stages): twice the loss;
    # later ones see weights that twice the gradients moved
    assert user.losses[:2] == pytest.approx([2 * v for v in builtin.losses[:2]], rel=1e-6)
    assert user.losses[3] != pytest.approx(2 * builtin.losses[3], rel=1e-4)


def test_async_settings_take_user_code() -> None:
    checked = check_train_settings(
        {
            "schedule": "async-1f1b",
            "num_microbatches": 1,
            "optimizer": {"name": TORCH_SGD, "lr": 0.1},
            "loss": TORCH_CE,
        },
        2,
    )
    assert checked["loss"] == TORCH_CE and checked["optimizer"]["name"] == TORCH_SGD


# ---------------------------------------------------------------- device


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))
        self.seen: list[torch.device] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.device)
        return x * self.weight * 2


class _MetaMover(BoundaryMover):
    """Plays an accelerator with the meta device (as tests/unit/test_devices.py does):
    onto it as usual, back to the host as zeros of the right shape."""

    def __init__(self) -> None:
        super().__init__("meta")
        self.to_host_calls: list[list[torch.device]] = []

    def _onto_host(self, t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape, dtype=t.dtype)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        self.to_host_calls.append([t.device for t in tensors])
        return super().to_host(tensors)


def test_an_async_shard_computes_on_its_device_and_crosses_its_edges_on_the_host() -> None:
    unit = _Recorder()
    shard = AsyncShard(
        [unit],
        start=0,
        first=False,
        last=False,
        loss="mse",
        optimizer={"name": "sgd", "lr": 0.1},
        device="meta",
    )
    mover = _MetaMover()
    shard.mover = mover
    assert unit.weight.device.type == "meta"  # the weights moved with the shard
    assert all(t.device.type == "meta" for t in shard.compute._versions[0][0].values())
    sent, _, _ = shard.forward_at(0, 0, [torch.randn(4, 3)], None, 4, 1)
    assert unit.seen == [torch.device("meta")]
    assert [t.device.type for t in sent] == ["cpu"] and sent[0].shape == (4, 3)
    assert mover.to_host_calls == [[torch.device("meta")]]
    grads, _ = shard.backward(0, [torch.ones(4, 3)])
    assert [g.device.type for g in grads] == ["cpu"] and grads[0].shape == (4, 3)
    assert mover.to_host_calls[-1] == [torch.device("meta")]
    shard.step_batch(0)
    assert shard.updates == 1 and unit.weight.device.type == "meta"


def test_the_cpu_stays_the_default_and_the_identity() -> None:
    shard = build_shards(SPEC, [0, 4], optimizer=SGD)[0]
    assert shard.device == torch.device("cpu") and shard.mover.is_host
    x, y = make_batches(1, 3)[0]
    _, loss, _ = shard.forward_at(0, 0, [x], y, 3, 1)
    assert loss is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_an_unavailable_device_is_refused_by_name(device: str) -> None:
    with pytest.raises(DeviceUnavailableError, match=f"--device {device}"):
        AsyncShard(
            [nn.Linear(2, 2)],
            start=0,
            first=True,
            last=True,
            loss="mse",
            optimizer={"name": "sgd", "lr": 0.1},
            device=device,
        )


# ---------------------------------------------------------------- resume


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A whole checkpoint, less its step count (``start_state``'s form)."""
    return read_matching(path, lambda key: key != "#steps")


def _saved(
    shards: Sequence[AsyncShard], steps: int, path: Path, *, vertical_sync: bool = True
) -> ModelSpec:
    """Write what a run's ``TrainReport.save`` writes from these shards (each stage's
    reply to a weights request with the optimizer: its versioned state, as the
    executor's ``replica_state``), and the spec that resumes from it."""
    state: dict[str, torch.Tensor] = {}
    n = len(shards)
    for i, shard in enumerate(shards):
        versions = versions_read_after(i, n, shard.updates, vertical_sync=vertical_sync)
        state.update(shard.saved_state(versions))
    report = TrainReport(
        run=1,
        plan=None,  # type: ignore[arg-type]  # save() reads the spec and the state only
        model_spec=SPEC,
        schedule="async-1f1b",
        num_microbatches=1,
        losses=[0.0] * steps,
        state_dict=state,
        with_optimizer_state=True,
    )
    report.save(path)
    return ModelSpec(SPEC.family, SPEC.config, seed=SPEC.seed, weights=str(path))


@pytest.mark.parametrize(
    ("optimizer", "settings", "schedule"),
    [
        (ADAM, AsyncSettings(aggregate=True), COSINE),
        (SGD, AsyncSettings(vertical_sync=False), None),
    ],
    ids=["adam-aggregate-cosine", "sgd-no-vsync"],
)
def test_n_then_a_checkpoint_then_n_more_equals_2n(
    tmp_path: Path,
    optimizer: dict[str, Any],
    settings: AsyncSettings,
    schedule: dict[str, Any] | None,
) -> None:
    batches = make_batches(10, 5, seed=9)
    bounds = [0, 1, 3, 4]
    want = train_async_reference(
        SPEC, batches, bounds=bounds, optimizer=optimizer, settings=settings, lr_schedule=schedule
    )
    first = build_shards(SPEC, bounds, optimizer=optimizer, lr_schedule=schedule)
    losses = run_shards(first, batches[:5], settings=settings)
    resumed_spec = _saved(
        first, 5, tmp_path / "ckpt.safetensors", vertical_sync=settings.vertical_sync
    )
    second = [
        AsyncShard.build(
            resumed_spec,
            bounds[i],
            bounds[i + 1],
            first=i == 0,
            last=i == 2,
            loss="cross_entropy",
            optimizer=optimizer,
            lr_schedule=schedule,
            start_step=5,
            resume_optimizer=True,
        )
        for i in range(3)
    ]
    assert [s.updates for s in second] == [5, 5, 5]
    losses += run_shards(second, batches[5:], settings=settings)
    assert losses == want.losses
    assert_equal_state(shard_weights(second), want.state_dict)
    # the reference resumes from the same file the same way
    half = train_async_reference(
        SPEC,
        batches[5:],
        bounds=bounds,
        optimizer=optimizer,
        settings=settings,
        lr_schedule=schedule,
        start_state=read_state(tmp_path / "ckpt.safetensors"),
    )
    assert half.losses == want.losses[5:]
    assert_equal_state(half.state_dict, want.state_dict)


def test_the_reference_checkpoint_is_what_the_stages_save(tmp_path: Path) -> None:
    batches = make_batches(4, 5, seed=2)
    want = train_async_reference(SPEC, batches, bounds=[0, 2, 4], optimizer=ADAM)
    shards = build_shards(SPEC, [0, 2, 4], optimizer=ADAM)
    run_shards(shards, batches)
    saved = {}
    for shard in shards:
        saved.update(shard.repartition_snapshot(2))
    assert_equal_state(saved, want.checkpoint)
    # the weights in it are the model's: a plain model loads the saved file
    spec = _saved(shards, 4, tmp_path / "ckpt.pt")
    model = build_full_model(spec)
    assert_equal_state(model.state_dict(), want.state_dict)


def test_a_resume_needs_an_asynchronous_checkpoint_at_its_start_step(tmp_path: Path) -> None:
    batches = make_batches(3, 5)
    shards = build_shards(SPEC, [0, 2, 4], optimizer=SGD)
    run_shards(shards, batches)
    spec = _saved(shards, 3, tmp_path / "ckpt.safetensors")

    def resume(spec: ModelSpec, start_step: int) -> AsyncShard:
        return AsyncShard.build(
            spec,
            0,
            2,
            first=True,
            last=False,
            loss="cross_entropy",
            optimizer=SGD,
            start_step=start_step,
            resume_optimizer=True,
        )

    assert resume(spec, 3).updates == 3
    with pytest.raises(ConfigError, match=r"saved after 3 mini-batches.*start_step=3, not 2"):
        resume(spec, 2)
    # a synchronous run's checkpoint has no versions: refused, with what to do instead
    plain = {k: v for k, v in read_state(tmp_path / "ckpt.safetensors").items()
             if "#v" not in k and "#live_versions" not in k}  # fmt: skip
    write_state(plain, tmp_path / "sync.safetensors")
    sync_spec = ModelSpec(SPEC.family, SPEC.config, seed=SPEC.seed,
                          weights=str(tmp_path / "sync.safetensors"))  # fmt: skip
    with pytest.raises(ConfigError, match="not a checkpoint of an asynchronous run"):
        resume(sync_spec, 3)
    with pytest.raises(ConfigError, match="only with resume_optimizer"):
        check_train_settings(
            {"schedule": "async-1f1b", "num_microbatches": 1, "optimizer": SGD, "start_step": 3},
            2,
        )
    checked = check_train_settings(
        {
            "schedule": "async-1f1b",
            "num_microbatches": 1,
            "optimizer": SGD,
            "start_step": 3,
            "resume_optimizer": True,
        },
        2,
    )
    assert checked["start_step"] == 3 and checked["resume_optimizer"] is True


def test_a_checkpoint_of_fewer_stages_cannot_feed_a_deeper_pipeline(tmp_path: Path) -> None:
    """Two stages keep versions N-1..N; three read N-2 first: refused before any forward,
    naming what is missing (three stages' checkpoint on two is fine)."""
    batches = make_batches(4, 5)
    shards = build_shards(SPEC, [0, 2, 4], optimizer=SGD)
    run_shards(shards, batches)
    spec = _saved(shards, 4, tmp_path / "two.safetensors")
    resumed = AsyncShard.build(spec, 0, 1, first=True, last=False, loss="cross_entropy",
                               optimizer=SGD, start_step=4, resume_optimizer=True)  # fmt: skip
    assert isinstance(resumed, AsyncShard)
    resumed.check_versions(versions_read_after(0, 2, 4, vertical_sync=True), stages=2)
    with pytest.raises(ConfigError, match=r"reads \[2, 3, 4\] next \(missing \[2\]\)"):
        resumed.check_versions(versions_read_after(0, 3, 4, vertical_sync=True), stages=3)
