"""bench/transport.py's round-by-round ratios and round-trip steps (pure arithmetic)."""

from __future__ import annotations

import pytest

from bench._transport_results import (
    RTT_STEPS,
    Result,
    paired_ratio,
    round_ratios,
    round_trip_steps,
    size_ratios,
)


def test_the_ratio_is_the_median_of_each_rounds_own_ratio() -> None:
    # The load doubled every path's time in the second round: the ratio within each
    # round is 0.5, 0.5 and 0.6, whatever the ratio of the paths' medians says.
    zpipe = [1.0, 2.0, 3.0]
    raw = [2.0, 4.0, 5.0]
    assert paired_ratio(zpipe, raw) == pytest.approx(0.5)
    assert round_ratios(zpipe, raw) == [0.5, 0.5, 0.6]
    assert paired_ratio([], []) is None
    with pytest.raises(ValueError):  # rounds that do not pair up are a bench bug
        paired_ratio([1.0], [1.0, 2.0])


def test_round_trip_steps_come_from_both_processes_clock_readings() -> None:
    # sender: started, sent, received, decoded; echo: received, sent
    sender = [(10.0, 10.5, 14.0, 14.25), (20.0, 20.25, 23.0, 23.5)]
    echo = [(11.0, 12.0), (21.0, 22.5)]
    steps = round_trip_steps(sender, echo)
    assert steps == [(0.5, 0.5, 1.0, 2.0, 0.25), (0.25, 0.75, 1.5, 0.5, 0.5)]
    result = Result("zpipe", 1 << 20)
    result.rtt_steps.extend(steps)
    result.rtts.extend([4.25, 3.5])
    medians = result.rtt_steps_us()
    assert list(medians) == list(RTT_STEPS)
    assert medians["echo"] == pytest.approx(1.25e6)
    with pytest.raises(ValueError):  # a trip the echo did not stamp
        round_trip_steps(sender, echo[:1])


def _runs(path: str, gbps: list[float], rtts: list[float]) -> Result:
    size = 1 << 20
    result = Result(path, size, count=10)
    result.seconds.extend(10 * size / (g * 1e9) for g in gbps)
    result.rtt_rounds.extend(rtts)
    return result


def test_zpipe_is_compared_with_asyncio_raw_round_by_round_and_asyncio_raw_with_raw() -> None:
    results = {
        "raw": _runs("raw", [4.0, 2.0, 4.0], [1.0, 2.0, 1.0]),
        "raw_asyncio": _runs("raw_asyncio", [2.0, 1.0, 3.0], [2.0, 3.0, 2.0]),
        "zpipe": _runs("zpipe", [1.0, 1.0, 3.0], [3.0, 3.0, 2.0]),
    }
    out = size_ratios("1mb", results, None)
    assert out["ratio_rounds_1mb_vs_asyncio_raw"] == [0.5, 1.0, 1.0]
    assert out["ratio_1mb_vs_asyncio_raw"] == pytest.approx(1.0)
    assert out["rtt_ratio_1mb_vs_asyncio_raw"] == pytest.approx(1.0)  # 1.5, 1.0, 1.0
    assert out["asyncio_raw_over_raw_1mb"] == pytest.approx(0.5)  # 0.5, 0.5, 0.75
    assert out["rtt_asyncio_raw_over_raw_1mb"] == pytest.approx(2.0)  # 2.0, 1.5, 2.0
    assert out["ratio_1mb"] == pytest.approx(0.5)  # against raw, unchanged: 0.25, 0.5, 0.75
    # without the baseline its keys are there, and null
    del results["raw_asyncio"]
    out = size_ratios("1mb", results, None)
    assert out["ratio_1mb_vs_asyncio_raw"] is None and out["asyncio_raw_over_raw_1mb"] is None
