"""The simulated-time clock (fl-sim's loop, shared with the Flower ServerApp) fed by hand:
results merge in simulated-time order, a failed client is dropped out of its group and
never trained again, ticks ask for profiles, and out-of-turn answers are refused."""

from __future__ import annotations

import numpy as np
import pytest

from zpipe._errors import ProtocolError
from zpipe.federated.grouping import ClientProfile, GroupingPolicy
from zpipe.federated.server import ServerConfig, make_server
from zpipe.federated.virtual_time import (
    ClockConfig,
    Finished,
    NeedProfiles,
    NeedResult,
    VirtualClock,
    task_spread,
)

N_CLASSES = 4


def _profiles() -> list[ClientProfile]:
    # two latency tiers of six clients, each client holding two classes
    return [ClientProfile(c, (1.0 if c < 6 else 5.0) + 0.05 * c, _counts(c)) for c in range(12)]


def _counts(c: int) -> tuple[int, ...]:
    counts = [0] * N_CLASSES
    counts[c % N_CLASSES] += 5
    counts[(c + 1) % N_CLASSES] += 5
    return tuple(counts)


def _clock(method: str = "ecofl", **clock: float) -> VirtualClock:
    profiles = _profiles()
    server = make_server(
        profiles,
        np.zeros(3),
        ServerConfig(method=method, max_concurrent=4, grouping=GroupingPolicy(n_groups=2)),
    )
    config = ClockConfig(
        **{"budget_s": 40.0, "eval_every_s": 10.0, "change_every_s": 25.0, **clock}
    )  # type: ignore[arg-type]
    return VirtualClock(
        server,
        {p.client_id: p.latency_s for p in profiles},
        config,
        evaluate=lambda w: float(w.sum()),
    )


def test_results_are_merged_in_simulated_time_order_and_ticks_ask_for_profiles() -> None:
    clock = _clock()
    assert len(clock.take_dispatched()) == 4  # two groups, two clients each
    seen: list[float] = []
    ticks: list[int] = []
    while True:
        step = clock.advance()
        if isinstance(step, Finished):
            break
        if isinstance(step, NeedProfiles):
            ticks.append(step.tick)
            clock.on_profiles({c: clock.latency[c] for c in range(12)})
            continue
        assert isinstance(step, NeedResult)
        seen.append(step.now)
        sent = step.now - clock.latency[step.task.client_id] * task_spread(
            0, step.task.task_id, 0.05
        )
        assert sent >= -1e-9  # it completes one (jittered) latency after it was sent
        clock.on_result(step.task.weights + 1.0, 10)
    assert seen == sorted(seen) and len(seen) > 8
    assert ticks == [1]  # one change tick at 25 s in a 40 s budget
    assert clock.log.curve_t == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert clock.log.curve_acc[-1] > clock.log.curve_acc[0]  # the model moved
    assert clock.server.version > 0


def test_a_failed_client_is_dropped_out_and_never_trained_again() -> None:
    clock = _clock()
    first = clock.take_dispatched()
    victim = first[0].client_id
    assert not clock.server.is_dropped(victim)
    trained_after: list[int] = []
    failed = False
    while not isinstance(step := clock.advance(), Finished):
        if isinstance(step, NeedProfiles):
            # the dead client answers no profiling: it keeps its last latency
            clock.on_profiles({c: clock.latency[c] for c in range(12) if c != victim})
            continue
        assert isinstance(step, NeedResult)
        if step.task.client_id == victim:
            assert not failed, "a dropped client got another task"
            failed = True
            clock.on_result(None)
            continue
        if failed:
            trained_after.append(step.task.client_id)
        clock.on_result(step.task.weights + 1.0, 10)
    assert failed and clock.log.failed_tasks == 1
    assert clock.server.is_dropped(victim)
    assert trained_after and victim not in trained_after


def test_a_failure_that_ends_a_round_does_not_pick_the_failed_client_again() -> None:
    # one group of three, K = 3: every round takes all three; the slowest one fails last
    profiles = [ClientProfile(c, 1.0 + 0.1 * c, _counts(c)) for c in range(3)]
    server = make_server(
        profiles,
        np.zeros(3),
        ServerConfig(method="ecofl", max_concurrent=3, grouping=GroupingPolicy(n_groups=1)),
    )
    clock = VirtualClock(
        server,
        {p.client_id: p.latency_s for p in profiles},
        ClockConfig(budget_s=10.0, eval_every_s=10.0, change_every_s=100.0, jitter=0.0),
        evaluate=lambda w: 0.0,
    )
    assert sorted(t.client_id for t in clock.take_dispatched()) == [0, 1, 2]
    for expected in (0, 1):
        step = clock.advance()
        assert isinstance(step, NeedResult) and step.task.client_id == expected
        assert clock.on_result(step.task.weights + 1.0, 10) == []
    step = clock.advance()
    assert isinstance(step, NeedResult) and step.task.client_id == 2
    next_round = clock.on_result(None)
    assert sorted(t.client_id for t in next_round) == [0, 1]
    assert server.is_dropped(2)


def test_answers_out_of_turn_are_refused() -> None:
    clock = _clock("fedavg")
    with pytest.raises(ProtocolError):
        clock.on_result(np.zeros(3), 1)
    with pytest.raises(ProtocolError):
        clock.on_profiles({})
    step = clock.advance()
    assert isinstance(step, NeedResult)
    with pytest.raises(ProtocolError):
        clock.advance()  # the awaited result first
