"""A training stage's forward watch: a verdict becomes the ``speed_changed`` it sends
the coordinator, naming the cuts' epoch; a move's commit starts the watch again.

Pure (:class:`zpipe.stage.speed_watch.StageSpeedWatch`), plus the training settings
that turn it on (``forward_watch``, parsed where the stage reads its assignment).
"""

from __future__ import annotations

import pytest

from zpipe._errors import ProtocolError
from zpipe.protocol import REGISTRY
from zpipe.protocol.repartition import SpeedChanged
from zpipe.stage.executors.training_plane import _forward_watch
from zpipe.stage.speed_watch import StageSpeedWatch


def _watch() -> StageSpeedWatch:
    return StageSpeedWatch(run=7, name="b", epoch=3, factor=2.0)


def _verdicts(watch: StageSpeedWatch, times: list[float], first: int = 0) -> list[SpeedChanged]:
    out = []
    for step, seconds in enumerate(times, start=first):
        verdict = watch.observe(step, seconds)
        if verdict is not None:
            out.append(verdict)
    return out


def test_a_tenfold_slowdown_is_reported_at_its_third_forward() -> None:
    watch = _watch()
    assert _verdicts(watch, [0.1, 0.11, 0.09, 0.1, 0.1, 0.12, 0.1, 0.1]) == []
    slow = [1.0, 1.02, 0.98, 1.01, 1.0, 1.0]
    verdicts = _verdicts(watch, slow, first=8)
    assert len(verdicts) == 1  # a device that stays slow is reported once
    (verdict,) = verdicts
    # the third slow forward (8, 9, 10): each is beyond 4x the factor over the median,
    # which no host hiccup reaches (ForwardWatch's far rule; a milder step takes four)
    assert verdict.step == 10
    assert (verdict.run, verdict.name, verdict.plan_epoch, verdict.epoch) == (7, "b", 0, 3)
    assert verdict.ratio == pytest.approx(10.0, rel=0.05)
    assert verdict.baseline_s == pytest.approx(0.1)
    # what the stage sends is what the coordinator parses, values checked
    parsed = REGISTRY.parse(SpeedChanged.from_message(verdict.to_message()).to_message())
    assert parsed == verdict
    assert verdict.checked() is verdict


def _passes(
    watch: StageSpeedWatch, forwards: list[float], backwards: list[float], first: int, lag: int = 2
) -> list[tuple[str, SpeedChanged]]:
    """A middle stage's 1F1B: the forward of mini-batch ``b``, then the backward of
    ``b - lag`` (its gradient back from the stages after it)."""
    out = []
    for b, (forward, backward) in enumerate(zip(forwards, backwards, strict=True), start=first):
        for kind, step, seconds in (("forward", b, forward), ("backward", b - lag, backward)):
            verdict = watch.observe(step, seconds, kind)  # type: ignore[arg-type]
            if verdict is not None:
                out.append((kind, verdict))
    return out


def test_a_tenfold_slowdown_is_reported_at_its_third_pass_forwards_and_backwards() -> None:
    watch = _watch()
    assert _passes(watch, [0.1, 0.11, 0.09, 0.1, 0.1, 0.12, 0.1, 0.1], [0.2] * 8, first=2) == []
    slow = _passes(
        watch, [1.0, 1.02, 0.98, 1.01, 1.0, 1.0], [2.0, 2.1, 1.9, 2.0, 2.0, 2.0], first=10
    )
    assert len(slow) == 1  # a device that stays slow is reported once
    ((kind, verdict),) = slow
    # forward 10, backward 8, forward 11: the third slow pass, in the second slow
    # mini-batch (forwards alone: the third, forward 12)
    assert (kind, verdict.step) == ("forward", 11)
    assert verdict.ratio == pytest.approx(10.0, rel=0.05)
    # in forward seconds: the backwards' 2x is not part of the ratio
    assert verdict.baseline_s == pytest.approx(0.1)
    assert verdict.now_s == pytest.approx(verdict.baseline_s * verdict.ratio)
    assert REGISTRY.parse(verdict.to_message()) == verdict and verdict.checked() is verdict


def test_a_device_that_slows_during_a_move_is_seen_on_the_new_cuts_from_both_passes() -> None:
    watch = _watch()
    _passes(watch, [0.6] * 8, [1.2] * 8, first=2)  # six units
    watch.committed(1, scale=7 / 6)  # seven units from here: each kind's median scaled
    verdicts = _passes(watch, [7.0] * 6, [14.0] * 6, first=10)
    # judged at twice the factor (not far): the k rule's fourth pass, backward 9
    assert [(kind, v.step, v.plan_epoch) for kind, v in verdicts] == [("backward", 9, 1)]
    assert verdicts[0][1].ratio == pytest.approx(10.0)


def test_a_device_that_slows_during_a_move_is_seen_on_the_new_cuts() -> None:
    # r24_middle: the device slows during the first move's pause, so no forward of the
    # new cuts is fast; the old median, scaled by the units, is the baseline meanwhile
    watch = _watch()
    _verdicts(watch, [0.6] * 8)  # six units at 0.1 s each
    watch.committed(1, scale=7 / 6)  # seven units from here
    (verdict,) = _verdicts(watch, [7.0] * 6, first=8)
    assert verdict.step == 11 and verdict.plan_epoch == 1
    assert verdict.ratio == pytest.approx(10.0)


def test_a_scale_that_is_off_is_not_taken_for_a_change() -> None:
    # seven units to one: a fixed cost per forward makes it a fifth, not a seventh, and
    # a few forwards of the new cuts are in before the watch has its own baseline
    watch = _watch()
    _verdicts(watch, [0.7] * 8)
    watch.committed(1, scale=1 / 7)
    assert _verdicts(watch, [0.14, 0.15, 0.13, 0.14, 0.14, 0.15, 0.14, 0.14], first=8) == []
    # then its own: a 10x slowdown from there is seen as any other
    (verdict,) = _verdicts(watch, [1.4] * 4, first=16)
    assert verdict.ratio == pytest.approx(10.0, rel=0.05)


def test_one_slow_forward_is_not_a_change() -> None:
    watch = _watch()
    times = [0.1] * 8 + [1.0] + [0.1] * 4 + [1.0, 1.0, 0.1] * 3
    assert _verdicts(watch, times) == []


def test_a_move_starts_the_watch_again_on_its_new_epoch() -> None:
    watch = _watch()
    _verdicts(watch, [0.1] * 8)
    watch.committed(1, scale=3.0)  # three times the units: three times the forward
    assert _verdicts(watch, [0.3] * 10, first=8) == []
    (verdict,) = _verdicts(watch, [3.0] * 4, first=18)
    assert verdict.plan_epoch == 1
    assert verdict.ratio == pytest.approx(10.0)


def test_a_commit_that_leaves_this_stage_alone_keeps_its_forwards() -> None:
    watch = _watch()
    _verdicts(watch, [0.1] * 8)
    watch.committed(2)  # other stages' cuts moved
    (verdict,) = _verdicts(watch, [1.0] * 4, first=8)  # no new baseline to wait for
    assert verdict.plan_epoch == 2


@pytest.mark.parametrize(
    "values",
    [
        {"ratio": 0.0},
        {"ratio": float("nan")},
        {"baseline_s": -1.0},
        {"now_s": float("inf")},
        {"step": -1},
        {"plan_epoch": -2},
    ],
)
def test_a_verdict_whose_values_mean_none_is_a_protocol_error(values: dict[str, float]) -> None:
    fields = {"run": 1, "name": "b", "step": 3, "plan_epoch": 0, "ratio": 10.0}
    message = SpeedChanged(**{**fields, "baseline_s": 0.1, "now_s": 1.0, **values})  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="speed_changed"):
        message.checked()


def test_the_forward_watch_setting_is_a_factor_above_one() -> None:
    assert _forward_watch(None) is None
    assert _forward_watch(2) == 2.0
    for bad in (1.0, 0.5, True, "2", float("nan")):
        with pytest.raises(ValueError, match="forward_watch"):
            _forward_watch(bad)
