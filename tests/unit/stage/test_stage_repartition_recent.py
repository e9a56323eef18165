"""A stage's newest mini-batches' forwards, one by one, for a look's window (pure; see
:func:`zpipe.stage.executors.async_repartition.recent_compute`)."""

from __future__ import annotations

from zpipe.stage.executors.async_repartition import recent_compute
from zpipe.stage.metrics import StageCounters


def test_the_newest_forwards_oldest_first_whether_or_not_backwarded() -> None:
    counters = StageCounters()
    t = 0.0
    for mb in range(6):
        counters.timeline.record(mb, "forward", t, t + 0.1 * (mb + 1))
        t += 1.0
        counters.timeline.record(-1, "step", t, t + 5.0)  # no mini-batch: left out
        counters.timeline.record(mb, "send", t, t + 7.0)  # not compute
        if mb < 5:  # the newest one still awaits its backward: its forward counts
            counters.timeline.record(mb, "backward", t, t + 0.2)
        t += 1.0
    recent = recent_compute(counters, newest=3)
    assert [mb for mb, _ in recent] == [3, 4, 5]
    assert [round(s, 6) for _, s in recent] == [0.4, 0.5, 0.6]
    assert [mb for mb, _ in recent_compute(counters)] == [0, 1, 2, 3, 4, 5]
    assert recent_compute(StageCounters()) == []


def test_the_timeline_gives_its_newest_spans_first_without_copying_the_ring() -> None:
    counters = StageCounters()
    for mb in range(3):
        counters.timeline.record(mb, "forward", mb, mb + 0.5)
    newest = counters.timeline.newest()
    assert next(newest).mb == 2
    assert [span.mb for span in newest] == [1, 0]
