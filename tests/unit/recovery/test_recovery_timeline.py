"""The recovery timeline: phases in order, durations, a log event and a per-policy summary."""

from __future__ import annotations

import pytest

from zpipe._errors import ConfigError
from zpipe.recovery.timeline import RecoveryTimeline, summarize_recoveries


def timeline(policy: str = "lightweight") -> RecoveryTimeline:
    return RecoveryTimeline(run="r1", cause="failure", devices=("b",), policy=policy, epoch=3)


def test_durations_between_marked_phases():
    t = (
        timeline()
        .mark("failed", 10.0)
        .mark("detected", 12.5)
        .mark("replanned", 12.6)
        .mark("weights_moved", 13.6, units_moved=4, bytes_moved=4000)
        .mark("first_step", 14.0)
    )
    assert t.complete
    assert t.summary() == pytest.approx(
        {
            "detection_s": 2.5,
            "replan_s": 0.1,
            "weights_s": 1.0,
            "resume_s": 0.4,
            "recovery_s": 1.5,
            "downtime_s": 4.0,
        }
    )
    fields = t.log_fields()
    assert fields["recovery_s"] == 1.5 and fields["units_moved"] == 4 and fields["epoch"] == 3
    assert fields["devices"] == ["b"] and fields["policy"] == "lightweight"


def test_unknown_failure_time_leaves_detection_unknown_and_inference_resumes_after_replan():
    t = timeline().mark("detected", 5.0).mark("replanned", 5.5).mark("first_step", 6.0)
    s = t.summary()
    assert "detection_s" not in s and "downtime_s" not in s and "weights_s" not in s
    assert s["resume_s"] == pytest.approx(0.5) and s["recovery_s"] == pytest.approx(1.0)
    assert not timeline().mark("detected", 1.0).complete


def test_phases_must_be_marked_in_order_once():
    t = timeline().mark("detected", 5.0)
    with pytest.raises(ConfigError, match="comes before 'detected'"):
        t.mark("replanned", 4.0)
    with pytest.raises(ConfigError, match="already marked"):
        t.mark("detected", 6.0)
    with pytest.raises(ConfigError, match="unknown recovery phase"):
        t.mark("celebrated", 7.0)
    with pytest.raises(ConfigError, match="cause"):
        RecoveryTimeline(run="r", cause="meteor", devices=(), policy="heavy")
    # mark returns a new timeline: the logged one is unchanged
    assert t.replanned_at is None and t.mark("replanned", 6.0).replanned_at == 6.0


def test_round_trip_through_dict():
    t = timeline().mark("failed", 1.0).mark("detected", 2.0)
    assert RecoveryTimeline.from_dict(t.to_dict()) == t
    with pytest.raises(ConfigError, match="unknown key"):
        RecoveryTimeline.from_dict({**t.to_dict(), "extra": 1})


def test_summary_per_policy():
    light = [
        timeline().mark("detected", 0.0).mark("first_step", 1.0),
        timeline().mark("detected", 0.0).mark("first_step", 3.0),
    ]
    heavy = [timeline("heavy").mark("detected", 0.0).mark("replanned", 20.0)]
    summary = summarize_recoveries([*light, *heavy])
    assert summary["lightweight"]["count"] == 2 and summary["lightweight"]["completed"] == 2
    assert summary["lightweight"]["mean_recovery_s"] == pytest.approx(2.0)
    assert summary["lightweight"]["max_recovery_s"] == pytest.approx(3.0)
    assert summary["heavy"]["completed"] == 0 and "mean_recovery_s" not in summary["heavy"]
    assert summary["heavy"]["mean_replan_s"] == pytest.approx(20.0)
