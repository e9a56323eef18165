"""A flood of bad input writes a bounded number of log lines (zpipe/log_limits.py)."""

from __future__ import annotations

import structlog

from zpipe.log_limits import FloodLimit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def passed(limit: FloodLimit, event: str, peer: str = "p") -> dict[str, object] | None:
    try:
        return dict(limit(None, "warning", {"event": event, "peer": peer}))
    except structlog.DropEvent:
        return None


def test_a_flood_from_one_peer_is_cut_to_its_burst_then_its_rate() -> None:
    clock = Clock()
    limit = FloodLimit(burst=5, per_second=2.0, clock=clock)
    lines = [passed(limit, "dropped_message") for _ in range(100)]
    assert sum(line is not None for line in lines) == 5
    clock.now += 1.0  # two more lines' worth of tokens
    again = [passed(limit, "dropped_message") for _ in range(10)]
    kept = [line for line in again if line is not None]
    assert len(kept) == 2
    # the first line after the cut says how many were left out, once
    assert kept[0]["suppressed"] == 95 and "suppressed" not in kept[1]


def test_other_peers_and_other_events_are_never_held_back() -> None:
    limit = FloodLimit(burst=3, per_second=1.0, clock=Clock())
    for _ in range(50):
        passed(limit, "dropped_message", peer="mallory")
    assert passed(limit, "dropped_message", peer="mallory") is None
    assert passed(limit, "dropped_message", peer="honest") is not None
    assert passed(limit, "probe_dropped", peer="mallory") is not None
    assert all(passed(limit, "stage_registered", peer="mallory") for _ in range(50))


def test_lines_written_grow_with_time_not_with_the_flood() -> None:
    clock = Clock()
    limit = FloodLimit(burst=4, per_second=3.0, clock=clock)
    written = 0
    for i in range(1000):  # a thousand drops over two seconds
        clock.now = 100.0 + i * 0.002
        written += passed(limit, "fl_message_dropped") is not None
    assert written <= 4 + 3 * 2 + 1


def test_a_trickle_is_written_whole() -> None:
    clock = Clock()
    limit = FloodLimit(burst=4, per_second=3.0, clock=clock)
    for i in range(30):  # one a second: below the rate, every line is written
        clock.now = 100.0 + i
        line = passed(limit, "dropped_message")
        assert line is not None and "suppressed" not in line
