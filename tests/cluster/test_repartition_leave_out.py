"""A live re-partition that leaves a device out (eq. 5's ``l = j``), on real stage
processes over loopback: the run finishes on one stage fewer and computes what the
same run without the leave-out computes (vertical sync, the run's depth kept)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from zpipe.cluster import DeviceSpec, LocalCluster
from zpipe.models import ModelSpec
from zpipe.training.async_reference import train_async_reference
from zpipe.transport import security

SPEC = ModelSpec("mlp", {"dims": [12, 24, 24, 24, 20, 4], "activation": "gelu"}, seed=5)
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.99]}


def make_batches(count: int, size: int = 4, *, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(count)]  # fmt: skip


def _logged(text: str, event: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            out.append(record)
    return out


@pytest.fixture(scope="module")
def slow_middle() -> Iterator[LocalCluster]:
    # lb computes 60 times slower: even one unit there costs more than the other two
    # devices running all five units between them
    devices = [DeviceSpec("la"), DeviceSpec("lb", slowdown=60.0), DeviceSpec("lc")]
    with LocalCluster(
        devices, heartbeat_interval_s=0.5, suspect_after=6, probe_intervals=4, log_level="info"
    ) as running:
        yield running


def test_a_device_too_slow_for_one_unit_is_left_out_and_the_run_stays_exact(
    slow_middle: LocalCluster,
) -> None:
    cluster = slow_middle
    batches = make_batches(12, 5, seed=11)
    report = cluster.fit(
        SPEC,
        batches,
        optimizer=ADAM,
        num_microbatches=1,
        schedule="async-1f1b",
        partition=[[0, 2], [2, 3], [3, 5]],
        repartition={"first": 4, "every": 100, "gain": 0.1, "leave_out": True},
        progress=False,
    )
    assert report.steps == len(batches)
    looks = report.repartitions
    assert [r["at"] for r in looks] == [4]
    look = looks[0]
    assert look["moved"] and look["devices"] == ["la", "lc"], look
    # one stage fewer after the move: two stages' cuts, each kept stage holding its units
    assert len(look["bounds"]) == 3 and look["plan_epoch"] == 1
    assert set(look["held"]) == {"la", "lc"}
    a, b, c = look["bounds"]
    assert look["held"] == {"la": [a, b], "lc": [b, c]}
    # lb stays registered and idle: it prepared (its snapshot gave its unit away) and
    # got no commit
    lb = cluster.logs("lb")
    assert [e["step"] for e in _logged(lb, "repartition_prepared")] == [4]
    assert _logged(lb, "repartition_committed") == []
    # what the same run computes without the leave-out (the move changes nothing)
    want = train_async_reference(SPEC, batches, bounds=[0, 2, 3, 5], optimizer=ADAM)
    assert report.losses == want.losses
    assert set(report.state_dict) == set(want.state_dict)
    for key, value in want.state_dict.items():
        assert torch.equal(report.state_dict[key], value), key


def test_a_stage_that_dies_after_a_leave_out_is_recovered_exactly(
    slow_middle: LocalCluster,
) -> None:
    cluster = slow_middle
    batches = make_batches(12, 5, seed=13)
    since = len(cluster.logs("coordinator"))
    killed: list[str] = []

    def on_step(step: int, _loss: float) -> None:
        if step == 6 and not killed:
            killed.append("lc")
            cluster.kill("lc")

    try:
        # the look before 4 leaves lb out (a replica follows the move there); lc, the
        # last stage of the shorter chain, dies after 6: the run resumes from 4
        report = cluster.fit(
            SPEC, batches, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
            partition=[[0, 2], [2, 3], [3, 5]], progress=False, recover=True,
            replicate_every=4, on_step=on_step,
            repartition={"first": 4, "every": 100, "gain": 0.1, "leave_out": True},
        )  # fmt: skip
    finally:
        assert killed == ["lc"]
        cluster.start_stage(DeviceSpec("lc"))
        cluster.wait_for_stages(3, timeout_s=120)
    assert report.steps == len(batches)
    log = cluster.logs("coordinator")[since:]
    moved = _logged(log, "repartitioned")
    assert len(moved) == 1 and moved[0]["step"] == 4 and len(moved[0]["bounds"]) == 3
    (recovery,) = report.recoveries
    assert (recovery["dead"], recovery["resumed_from"], recovery["depth"]) == ("lc", 4, 3)
    # the survivors of the shorter chain: lb, left out, is not taken back by the recovery
    assert report.training_plan is not None and list(report.training_plan.devices) == ["la"]
    # vertical sync and the depth kept through both: the run without either
    want = train_async_reference(SPEC, batches, bounds=[0, 2, 3, 5], optimizer=ADAM)
    assert report.losses == pytest.approx(want.losses, rel=1e-6)
    for key, value in want.state_dict.items():
        torch.testing.assert_close(report.state_dict[key], value, rtol=1e-6, atol=1e-7)


@pytest.fixture(scope="module")
def secure_slow_middle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    keys = tmp_path_factory.mktemp("keys") / "trusted"
    security.generate_keys(keys, ["coordinator", "client", "la", "lb", "lc"])
    devices = [DeviceSpec("la"), DeviceSpec("lb", slowdown=60.0), DeviceSpec("lc")]
    with LocalCluster(devices, keys_dir=Path(keys), heartbeat_interval_s=0.5) as running:
        yield running


def test_a_leave_out_under_curve_admits_the_new_neighbours_before_the_commit(
    secure_slow_middle: LocalCluster,
) -> None:
    # la and lc were not neighbours: each admits the other's key at the move's fetch,
    # before either commits and connects (a refused handshake is not tried again)
    batches = make_batches(10, 5, seed=3)
    report = secure_slow_middle.fit(
        SPEC, batches, optimizer=ADAM, num_microbatches=1, schedule="async-1f1b",
        partition=[[0, 2], [2, 3], [3, 5]], progress=False,
        repartition={"first": 3, "every": 100, "gain": 0.1, "leave_out": True},
    )  # fmt: skip
    assert report.steps == len(batches)
    assert [(r["at"], r.get("devices")) for r in report.repartitions] == [(3, ["la", "lc"])]
    want = train_async_reference(SPEC, batches, bounds=[0, 2, 3, 5], optimizer=ADAM)
    assert report.losses == want.losses
