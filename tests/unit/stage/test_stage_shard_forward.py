"""Shard.forward: exact outputs, bfloat16 under autocast, and the emulated slowdown's
CPU clock read only when a slowdown is emulated."""

from __future__ import annotations

import pytest
import torch

from zpipe.stage import shard as shard_module
from zpipe.stage.shard import Shard
from zpipe.transport.slowdown import SlowdownClock, SlowdownSchedule


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def test_a_float32_forward_is_the_units_output_exactly_without_reading_the_cpu_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unit = _linear()
    shard = Shard([unit, torch.nn.ReLU()])
    x = torch.randn(3, 8)

    def no_clock() -> float:
        raise AssertionError("the CPU clock was read without an emulated slowdown")

    monkeypatch.setattr(shard_module.time, "thread_time", no_clock)
    (out,), took = shard.forward([x])
    with torch.no_grad():
        expected = torch.relu(unit(x))
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    assert out.is_inference()
    assert took >= 0.0


def test_a_bfloat16_shard_computes_under_autocast() -> None:
    shard = Shard([_linear()], dtype="bfloat16")
    (out,), _ = shard.forward([torch.randn(3, 8)])
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("slowdown", [3.0, "clock"])
def test_an_emulated_slowdown_holds_the_step_for_its_extra_cpu_work(
    monkeypatch: pytest.MonkeyPatch, slowdown: object
) -> None:
    if slowdown == "clock":
        slowdown = SlowdownClock(SlowdownSchedule(((0.0, 3.0),)))
    held: list[tuple[float, float, float | None]] = []

    def fake_emulate(factor: float, elapsed_s: float, cpu_s: float | None = None) -> float:
        held.append((factor, elapsed_s, cpu_s))
        return elapsed_s + 1.0

    monkeypatch.setattr(shard_module, "emulate_slowdown", fake_emulate)
    shard = Shard([_linear()], slowdown=slowdown)  # type: ignore[arg-type]
    _, took = shard.forward([torch.randn(3, 8)])
    assert len(held) == 1
    factor, elapsed, cpu = held[0]
    assert factor == 3.0
    assert took == elapsed + 1.0
    # one torch thread here? the compute thread's CPU time is the work; else the wall time
    if torch.get_num_threads() == 1:
        assert cpu is not None and cpu >= 0.0
