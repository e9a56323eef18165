"""Asynchronous 1F1B (PipeDream, FTPipeHD): schedules, the reference, a real pipeline.

The pure schedule is checked for validity; the single-process reference for the
weight versions of FTPipeHD's Fig. 2 (stashing, vertical sync, aggregation); a
multi-process run on the shared local cluster must equal the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._support.async_training import ADAM, SGD, SPEC, make_batches
from zpipe._errors import ConfigError
from zpipe.cluster import LocalCluster
from zpipe.models import build_full_model
from zpipe.planner.async_schedule import (
    aggregation_interval,
    async_global_order,
    async_stage_actions,
    async_warmup,
    forward_version,
)
from zpipe.training.async_reference import AsyncSettings, train_async_reference
from zpipe.training.objectives import make_optimizer
from zpipe.transport.slowdown import SlowdownClock, SlowdownSchedule, slowdown_factor

# ---------------------------------------------------------------- schedule


def test_stage_lists_follow_1f1b_with_warmup_n_minus_i() -> None:
    assert [async_warmup(i, 3) for i in range(3)] == [3, 2, 1]
    names = [str(a) for a in async_stage_actions(0, 3, 6)]
    # FTPipeHD Fig. 2: the backward of batch 1 follows the forward of batch 3 on stage 0
    assert names[:8] == ["F0", "F1", "F2", "B0", "STEP", "F3", "B1", "STEP"]
    assert names[-4:] == ["B4", "STEP", "B5", "STEP"]
    last = [str(a) for a in async_stage_actions(2, 3, 3)]
    assert last == ["F0", "B0", "STEP", "F1", "B1", "STEP", "F2", "B2", "STEP"]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [1, 2, None, 7])
def test_every_stage_runs_each_batch_once_forward_before_backward(
    stages: int, window: int | None
) -> None:
    batches = 9
    every = [aggregation_interval(i, stages) for i in range(stages)]
    order = async_global_order(stages, batches, max_in_flight=window, aggregate_every=every)
    for i in range(stages):
        mine = [a for s, a in order if s == i]
        forwards = [a.batch for a in mine if a.kind == "F"]
        backwards = [a.batch for a in mine if a.kind == "B"]
        assert forwards == list(range(batches)) and backwards == list(range(batches))
        assert sum(a.kind == "STEP" for a in mine) == batches
        # live forwards never exceed the warm-up (the stash holds at most n - i)
        live = peak = 0
        for a in mine:
            live += {"F": 1, "B": -1}.get(a.kind, 0)
            peak = max(peak, live)
        assert peak <= async_warmup(i, stages)
    # dependencies: a stage forwards a batch after its upstream did
    position = {(s, str(a)): k for k, (s, a) in enumerate(order)}
    for s in range(1, stages):
        for b in range(batches):
            assert position[(s, f"F{b}")] > position[(s - 1, f"F{b}")]
            assert position[(s - 1, f"B{b}")] > position[(s, f"B{b}")]


def test_aggregation_comes_every_multiple_of_n_minus_i_backwards() -> None:
    assert [aggregation_interval(i, 3) for i in range(3)] == [3, 2, None]
    assert aggregation_interval(0, 3, 2) == 6
    names = [str(a) for a in async_stage_actions(0, 3, 10, aggregate_every=3)]
    assert [names[k + 1] for k, a in enumerate(names) if a == "AGG"] == ["B3", "B6", "B9"]
    with pytest.raises(ConfigError, match="multiple"):
        aggregation_interval(0, 3, 0)


def test_forward_versions_with_and_without_vertical_sync() -> None:
    # stage 2 of 3 forwards batch 1 after its first update: version 1 on its own,
    # version 0 (the one stage 0 used) with vertical sync
    assert forward_version(2, 3, 1, vertical_sync=False) == 1
    assert forward_version(2, 3, 1, vertical_sync=True) == 0
    assert forward_version(0, 3, 3, vertical_sync=False) == 1
    with pytest.raises(ConfigError):
        forward_version(3, 3, 0, vertical_sync=True)


# ---------------------------------------------------------------- reference


def test_reference_with_one_stage_is_plain_training() -> None:
    batches = make_batches(5, 6)
    result = train_async_reference(SPEC, batches, bounds=[0, 4], optimizer=SGD)
    model = build_full_model(SPEC).train()
    optimizer = make_optimizer(SGD, model.parameters())
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x)[0], y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert result.losses == losses
    for key, value in model.state_dict().items():
        assert torch.equal(result.state_dict[key], value)


@pytest.mark.parametrize("vertical_sync", [True, False])
def test_reference_versions_are_fig2s(vertical_sync: bool) -> None:
    result = train_async_reference(
        SPEC,
        make_batches(7, 4),
        bounds=[0, 1, 3, 4],
        optimizer=SGD,
        settings=AsyncSettings(vertical_sync=vertical_sync),
    )
    stage0, stage2 = result.forward_versions[0], result.forward_versions[2]
    # stage 0 forwards batch 3 with version 1 and backwards batch 1 with version 0
    assert stage0[3] == 1 and result.backward_versions[0][1] == 0
    # weight stashing: every backward uses its forward's version
    assert result.backward_versions == result.forward_versions
    if vertical_sync:
        assert result.forward_versions[1] == stage0 and stage2 == stage0
        assert stage2[1] == 0
    else:
        assert stage2 == {b: b for b in range(7)}  # the newest: one update per batch
        assert stage2[1] == 1


def test_vertical_sync_and_aggregation_change_the_result() -> None:
    batches = make_batches(9, 4, seed=3)
    runs = {
        (vs, agg): train_async_reference(
            SPEC,
            batches,
            bounds=[0, 1, 3, 4],
            optimizer=SGD,
            settings=AsyncSettings(vertical_sync=vs, aggregate=agg),
        )
        for vs in (True, False)
        for agg in (True, False)
    }
    states = [r.state_dict for r in runs.values()]
    for a in range(len(states)):
        for b in range(a + 1, len(states)):
            assert not all(torch.equal(states[a][k], states[b][k]) for k in states[a])
    # the first batch sees only version 0, whatever the settings
    assert len({r.losses[0] for r in runs.values()}) == 1


def test_aggregation_averages_the_newest_versions_and_gets_no_version_of_its_own() -> None:
    from zpipe.models import load_layer_sequence
    from zpipe.training.async_stage import AsyncStageCompute

    units = load_layer_sequence(SPEC).build_units(0, 1)
    stage = AsyncStageCompute(units, first=True, last=False, loss="cross_entropy", optimizer=SGD)
    x = torch.randn(3, 12)
    snapshots = []
    for b in range(3):
        out, _ = stage.forward(b, 0, (x,))
        stage.backward(b, (torch.ones_like(out[0]),))
        stage.step(b)
        snapshots.append({k: v.clone() for k, v in units[0].state_dict().items()})
    stage.aggregate(3)
    for key, value in units[0].state_dict().items():
        torch.testing.assert_close(value, torch.stack([s[key] for s in snapshots]).mean(0))
    # version 3 still names the weights after the third update, not the aggregate
    out, _ = stage.forward(9, 3, (x,))
    fresh = load_layer_sequence(SPEC).build_units(0, 1)[0]
    fresh.load_state_dict(snapshots[2])
    torch.testing.assert_close(out[0], fresh(x))
    with pytest.raises(Exception, match="aggregate"):
        stage.aggregate(5)


# ---------------------------------------------------------------- real processes


@pytest.mark.parametrize(
    ("aggregate", "vertical_sync", "partition"),
    [
        (False, True, [[0, 1], [1, 3], [3, 4]]),
        (True, True, [[0, 1], [1, 3], [3, 4]]),
        (True, False, [[0, 2], [2, 4]]),
    ],
    ids=["3-stages", "3-stages-aggregate", "2-stages-aggregate-no-vsync"],
)
def test_cluster_async_run_equals_the_reference(
    cluster: LocalCluster, aggregate: bool, vertical_sync: bool, partition: list[list[int]]
) -> None:
    batches = make_batches(8, 5, seed=7)
    settings = AsyncSettings(vertical_sync=vertical_sync, aggregate=aggregate)
    bounds = [r[0] for r in partition] + [partition[-1][1]]
    want = train_async_reference(SPEC, batches, bounds=bounds, optimizer=ADAM, settings=settings)
    report = cluster.fit(
        SPEC,
        batches,
        optimizer=ADAM,
        num_microbatches=1,
        schedule="async-1f1b",
        partition=partition,
        aggregate=aggregate,
        vertical_sync=vertical_sync,
        progress=False,
    )
    assert report.steps == len(batches)
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    assert set(report.state_dict) == set(want.state_dict)
    for key, value in want.state_dict.items():
        torch.testing.assert_close(report.state_dict[key], value, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- slowdown schedule


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "seconds:factor"),
        ("0:1,60", "seconds:factor"),
        ("0:1,x:10", "numbers"),
        ("5:1", "starts at 0"),
        ("0:1,60:10,30:2", "increase"),
        ("0:0.5", "1..1000"),
        ("0:1,10:nan", "1..1000"),
    ],
)
def test_slowdown_schedule_refuses_bad_text(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        SlowdownSchedule.parse(text)


def test_slowdown_factor_changes_on_schedule_from_the_first_step() -> None:
    schedule = SlowdownSchedule.parse("0:1, 60:10 ,90:2.5")
    assert str(schedule) == "0:1,60:10,90:2.5"
    assert [schedule.factor_at(t) for t in (0, 59.9, 60, 89, 1e6)] == [1, 1, 10, 10, 2.5]
    now = [1000.0]
    clock = SlowdownClock(schedule, clock=lambda: now[0])
    assert slowdown_factor(clock) == 1  # the first step starts the clock
    now[0] += 61
    assert slowdown_factor(clock) == 10
    now[0] += 30
    assert slowdown_factor(clock) == 2.5
    assert slowdown_factor(3.0) == 3.0


def test_a_stage_takes_a_slowdown_schedule_instead_of_a_factor() -> None:
    from zpipe.cli.stage import build_parser
    from zpipe.stage.config import StageConfig

    args = build_parser().parse_args(
        ["--name", "s", "--coordinator", "tcp://127.0.0.1:1", "--slowdown-schedule", "0:1,60:10"]
    )
    assert args.slowdown_schedule == SlowdownSchedule.parse("0:1,60:10")
    config = StageConfig("s", "tcp://127.0.0.1:1", slowdown_schedule=args.slowdown_schedule)
    assert isinstance(config.emulated_slowdown(), SlowdownClock)
    with pytest.raises(ConfigError, match="not both"):
        StageConfig(
            "s", "tcp://127.0.0.1:1", slowdown=2.0, slowdown_schedule=args.slowdown_schedule
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["--name", "s", "--coordinator", "tcp://h:1", "--slowdown-schedule", "9:1"]
        )


# ---------------------------------------------------------------- options


def test_async_options_are_checked_before_anything_is_sent() -> None:
    from zpipe.client.options import TrainOptions
    from zpipe.training.objectives import check_train_settings

    with pytest.raises(ConfigError, match="num_microbatches=1"):
        TrainOptions(optimizer=SGD, num_microbatches=2, schedule="async-1f1b")
    with pytest.raises(ConfigError, match="recovers with vertical sync only"):
        TrainOptions(
            optimizer=SGD,
            num_microbatches=1,
            schedule="async-1f1b",
            recover=True,
            vertical_sync=False,
        )
    checked = check_train_settings(
        {
            "schedule": "async-1f1b",
            "num_microbatches": 1,
            "optimizer": SGD,
            "async": {"aggregate": True},
        },
        3,
    )
    assert checked["warmups"] == [3, 2, 1] and checked["async"]["aggregate"] is True
    with pytest.raises(ConfigError, match="unknown asynchronous"):
        check_train_settings(
            {
                "schedule": "async-1f1b",
                "num_microbatches": 1,
                "optimizer": SGD,
                "async": {"agg": 1},
            },
            3,
        )


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--schedule", "async-1f1b", "--microbatches", "2"], "--microbatches 1"),
        (["--schedule", "async-1f1b", "--recover", "--no-vertical-sync"], "vertical sync only"),
        (["--aggregate"], "need --schedule async-1f1b"),
    ],
)
def test_train_cli_refuses_async_flags_that_do_not_fit(
    flags: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from zpipe.cli.train import main

    with pytest.raises(SystemExit):
        main(["--local", "2", *flags])
    assert error in capsys.readouterr().err
