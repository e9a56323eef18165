"""FTPipeHD's live re-partition (section III-D): when to look, and whether to move.

Pure: events in, decisions out; no I/O. An asynchronous run's coordinator feeds
it the batches done and the stages' execution counters, and carries out what it
decides (:mod:`zpipe.coordinator.runs.async_repartition`).

- When: after ``first`` batches (FTPipeHD: 10, to reach a good partition soon),
  then every ``every`` batches (FTPipeHD: 100); with ``watch``, also as soon as
  the client sees its losses come back ``watch`` times slower than between the
  two looks before (:mod:`zpipe.training.repartition_watch`: a device that slows
  right after a look is not left on the old cuts for ``every`` slow batches).
- Execution profiling: each stage's compute time per batch since the last look
  (its counters' difference: FTPipeHD's per-worker average ``T_e^i``); with the
  stage's mini-batches one by one (``recent`` in its counters), their median, and
  when the window holds a change of the device's speed, the mini-batches after it
  only (:mod:`zpipe.training.repartition_window`): a look during the change moves
  in one step to the cuts of the new speed, not to a mix of the two. A look given
  a stage's own speed verdict (``verdicts``: the early look it asked for) measures
  that device at its new speed even before the window shows it
  (:func:`zpipe.training.repartition_window.verdict_time`); a verdict counts once,
  at the look it is given to, and only on the cuts it was about.
- Re-partition: capacities from those times (eqs. 1-3) and the cuts of eq. 5
  (:func:`zpipe.planner.ftpipehd.repartition_from_measurements`); with no time
  measured yet, eq. 7 on the reference times alone (every ``C_i = 1``). Eq. 5's
  ``2 * T_c`` term costs each cut's boundary: the unit's output per batch over
  the link between the two devices, as last measured (``output_bytes`` and
  ``bandwidths_bps``; the coordinator's are
  :mod:`zpipe.training.repartition_links`'s, the bandwidths renewed at each look
  with :meth:`RepartitionController.links_measured`). A cut's measured period
  (``tried`` below) is its compute; its links are costed from the latest
  bandwidths, so a link that changes is seen at once.
- Whether: the new cuts are taken when they shorten the predicted period by at
  least ``gain`` (a share of the current one, costed by the same model; 0 takes
  any different cut). ``bounds`` is a test hook: move to those cuts at the first
  look, whatever was measured.
- A stage's own cost per batch (the controller, across looks): eq. 3 scales a
  stage's whole time with its units, but a stage also pays a cost of its own per
  batch, which a slower device multiplies too; eq. 3 alone keeps a slow device at
  too few units and mistakes its cut-down stage's time for a slower device. The
  controller fits ``T = C_i * (phi + R)`` across the cuts each device ran
  (:mod:`zpipe.training.stage_cost`: ``phi`` the median of the devices' fits) and
  eq. 5 costs a stage ``F_i + C_i * R`` with ``F_i = C_i * phi``; with no fixed
  cost found it is eqs. 1-3 unchanged.
- Damping (the controller, across looks): measured times are noisy and the
  model is not exact, so two rules keep the cuts from oscillating: each device's
  capacity is averaged with its past looks (``smoothing``: the past's weight)
  unless its time is more than ``1 + deviation`` times either way what the model
  predicts for its units (Eco-FL's deviation check: a real change, taken at
  once); and cuts already run since the last such change are judged by
  the period they measured, not by the model (a move back needs a measured gain).
  Two more keep a fixed-cost fit that swings with the host's load from moving the
  cuts back and forth: a move back to cuts the pipeline left within the last
  ``revisit_looks`` looks, or to cuts within ``revisit_radius`` units of them at
  every boundary (under load the fit dithers between neighbouring cuts), needs a
  predicted gain of ``revisit_gain`` (hysteresis,
  kept through a real change: a swinging fit can fake one, while a true one, a
  device slowing or recovering for good, promises far more); and a move decided by
  a look without a flush counts the next look's window from the flush
  (:meth:`RepartitionController.rebase`), so the batches the old cuts drained are
  not read as the new cuts' (they looked like a device several times slower, a
  "real change" that threw the fit away).
- Weight redistribution: who fetches which units from whom
  (:func:`zpipe.recovery.plan_redistribution`, no failure: every unit's holder is
  its current stage; FTPipeHD's Algorithm 1 without the failed index).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from zpipe._errors import ConfigError
from zpipe.planner.capacity import estimate_capacities
from zpipe.planner.ftpipehd import ftpipehd_partition, repartition_from_measurements
from zpipe.recovery.redistribution import Redistribution, plan_redistribution
from zpipe.recovery.spans import StageSpan
from zpipe.training.repartition_period import links_s, period_at
from zpipe.training.repartition_reports import recent_times, stage_totals
from zpipe.training.repartition_settings import RepartitionSettings
from zpipe.training.repartition_window import SpeedVerdict, verdict_time, window_time
from zpipe.training.stage_cost import StageCosts


@dataclass(frozen=True)
class RepartitionDecision:
    """What a look found: the cuts to move to (``bounds``, None: stay) at batch ``at``;
    ``devices``: the devices of those cuts, in stage order, when eq. 5 left some out
    (None: the same devices)."""

    at: int
    current: tuple[int, ...]
    bounds: tuple[int, ...] | None
    period_s: float  # the current cuts' predicted period (measured, or eq. 7)
    new_period_s: float  # the best cuts' (eq. 5, or eq. 7)
    measured: bool  # False: eq. 7 (no time measured yet)
    capacities: dict[str, float] = field(default_factory=dict)
    fixed_s: dict[str, float] = field(default_factory=dict)  # each device's own cost per batch
    redistribution: Redistribution | None = None
    reason: str = ""
    devices: tuple[str, ...] | None = None

    def left_out(self, devices: Sequence[str]) -> tuple[str, ...]:
        """Of the pipeline's ``devices``, those the new cuts give no units."""
        if self.devices is None or self.bounds is None:
            return ()
        return tuple(d for d in devices if d not in self.devices)

    @property
    def moves(self) -> bool:
        return self.bounds is not None

    @property
    def gain(self) -> float:
        """The predicted period's share saved (0 when nothing is predicted)."""
        if self.period_s <= 0:
            return 0.0
        return 1.0 - self.new_period_s / self.period_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "current": list(self.current),
            "bounds": None if self.bounds is None else list(self.bounds),
            "period_s": round(self.period_s, 6),
            "new_period_s": round(self.new_period_s, 6),
            "gain": round(self.gain, 4),
            "measured": self.measured,
            "capacities": {d: round(c, 4) for d, c in self.capacities.items()},
            "fixed_s": {d: round(f, 6) for d, f in self.fixed_s.items()},
            "reason": self.reason,
            # only when some device is left out: a reader from before it sees none
            **({} if self.devices is None else {"devices": list(self.devices)}),
        }


def spans_of(devices: Sequence[str], bounds: Sequence[int]) -> list[StageSpan]:
    return [StageSpan((d,), int(bounds[i]), int(bounds[i + 1])) for i, d in enumerate(devices)]


def decide_repartition(
    settings: RepartitionSettings,
    *,
    at: int,
    devices: Sequence[str],
    bounds: Sequence[int],
    reference_unit_s: Sequence[float],
    measured_s: Mapping[str, float] | None = None,
    output_bytes: Sequence[float] | None = None,
    bandwidths_bps: Sequence[float] | None = None,
    capacities: Mapping[str, float] | None = None,
    tried: Mapping[tuple[int, ...], float] | None = None,
    fixed_s: Mapping[str, float] | None = None,
    left: Sequence[tuple[int, ...]] = (),
) -> RepartitionDecision:
    """Whether the pipeline of ``devices`` (in stage order) cut at ``bounds`` moves
    after batch ``at``. ``measured_s``: each device's compute seconds per batch since
    the last look (eq. 7 when a device has none); ``output_bytes``: each unit's
    output per batch (``D_j``), ``bandwidths_bps``: each link between consecutive
    devices in bytes per second (eq. 6; both or neither: without them links are
    free); ``capacities``: every device's
    ``C_i`` when already estimated (the controller's smoothed ones), instead of
    eqs. 1-2 on ``measured_s``; ``tried``: the compute period each of these cuts
    measured when run (a best cut found there is costed no lower than that, with
    its links as given now); ``fixed_s``: each
    device's own seconds per batch whatever its units, with ``capacities`` (eq. 7
    and eqs. 1-3 keep none); ``left``: cuts the pipeline left lately (a move back to
    them, or to cuts within ``settings.revisit_radius`` units of them at every
    boundary, needs ``settings.revisit_gain``)."""
    current = tuple(int(b) for b in bounds)
    n = len(devices)
    if len(current) != n + 1:
        raise ConfigError(f"{n} stages need {n + 1} bounds, got {list(current)}")
    times = {d: float(t) for d, t in (measured_s or {}).items() if t and t > 0}
    measured = all(d in times for d in devices)
    own: dict[str, float] = {}
    if capacities is not None and all(d in capacities for d in devices):
        measured = True
        caps = {d: float(capacities[d]) for d in devices}
        own = {d: float((fixed_s or {}).get(d, 0.0)) for d in devices}
        best = ftpipehd_partition(
            reference_unit_s,
            capacities=list(caps.values()),
            output_bytes=output_bytes,
            bandwidths_bps=bandwidths_bps,
            fixed_s=list(own.values()),
            leave_out=settings.leave_out,
            leave_out_gain=settings.gain,
            keep_ends=True,  # the client's feed and sink are wired to the ends
        )
    elif measured:
        best = repartition_from_measurements(
            times,
            devices,
            current,
            reference_unit_s,
            output_bytes=output_bytes,
            bandwidths_bps=bandwidths_bps,
            leave_out=settings.leave_out,
            leave_out_gain=settings.gain,
            keep_ends=True,  # the client's feed and sink are wired to the ends
        )
        caps = dict(
            zip(devices, _capacities(times, devices, current, reference_unit_s), strict=True)
        )
    else:
        best = ftpipehd_partition(
            reference_unit_s,
            num_stages=n,
            output_bytes=output_bytes,
            bandwidths_bps=bandwidths_bps,
        )
        caps = dict.fromkeys(devices, 1.0)
    fixed_list = [own.get(d, 0.0) for d in devices]
    period = period_at(
        current, reference_unit_s, list(caps.values()), output_bytes, bandwidths_bps, fixed_list
    )
    target: tuple[int, ...] | None = tuple(best.bounds)
    # the devices the best cuts keep, when eq. 5 left some out (settings.leave_out)
    kept = tuple(devices[w] for w in best.workers) if len(best.workers) < n else None
    reason = "eq. 5 on measured capacities" if measured else "eq. 7: nothing measured yet"
    new_period = best.period_s
    if settings.bounds is not None:
        target, kept = tuple(settings.bounds), None
        if len(target) != n + 1 or target[0] != 0 or target[-1] != current[-1]:
            raise ConfigError(f"bounds {list(target)} do not cut the same units into {n} stages")
        new_period = period_at(
            target,
            reference_unit_s,
            list(caps.values()),
            output_bytes,
            bandwidths_bps,
            fixed_list,
        )
        reason = "forced by the settings' bounds"
    elif target == current and kept is None:
        target, reason = None, "the best cuts are the current ones"
    elif target is not None:
        # cuts that left a device out never ran: nothing measured them
        ran = (tried or {}).get(target, 0.0) if kept is None else 0.0
        if ran > 0:
            # what the cuts measured is their compute; their links are costed as
            # last measured (a link may have changed since they ran)
            ran = max(ran, links_s(target, output_bytes, bandwidths_bps))
        if kept is not None:
            reason = f"eq. 5 leaves {[devices[w] for w in best.left_out(n)]} out"
        if ran > new_period:
            # eq. 3 flatters cuts it has seen run: judge them by what they measured
            new_period = ran
            reason = "the best cuts, costed by the period they measured when run"
        back = any(_near(target, cuts, settings.revisit_radius) for cuts in left)
        needed = max(settings.gain, settings.revisit_gain) if back else settings.gain
        if period > 0 and 1.0 - new_period / period < needed:
            target = None
            reason = (
                f"predicted gain below {needed:g}"
                + (" (the best cuts measured slower when run)" if ran >= new_period > 0 else "")
                + (" (a move back to cuts left lately)" if back else "")
            )
    if target == current and kept is None:
        target = None
    if target is None:
        kept = None
    redistribution = None
    if target is not None:
        redistribution = plan_redistribution(
            spans_of(devices, current),
            spans_of(kept or devices, target),
            failed=(),
            live_version=at,
        )
    return RepartitionDecision(
        at, current, target, period, new_period, measured, caps, own, redistribution, reason, kept
    )


def _near(a: Sequence[int], b: Sequence[int], radius: int) -> bool:
    """Whether cuts ``a`` and ``b`` differ by at most ``radius`` units at every boundary."""
    return len(a) == len(b) and all(abs(x - y) <= radius for x, y in zip(a, b, strict=True))


def _capacities(
    times: Mapping[str, float],
    devices: Sequence[str],
    bounds: Sequence[int],
    reference_unit_s: Sequence[float],
) -> list[float]:
    ranges = {d: (int(bounds[i]), int(bounds[i + 1])) for i, d in enumerate(devices)}
    caps = estimate_capacities({d: times[d] for d in devices}, ranges, reference_unit_s)
    return [caps[d] for d in devices]


class RepartitionController:
    """One run's re-partitioning: fed the batches done and the stages' cumulative
    counters, it says when to look and what to do; told of a commit, it moves on."""

    def __init__(
        self,
        settings: RepartitionSettings,
        *,
        devices: Sequence[str],
        bounds: Sequence[int],
        reference_unit_s: Sequence[float],
        output_bytes: Sequence[float] | None = None,
        bandwidths_bps: Sequence[float] | None = None,
    ) -> None:
        self.settings = settings
        self.devices = tuple(devices)
        self.bounds = tuple(int(b) for b in bounds)
        self.reference_unit_s = [float(t) for t in reference_unit_s]
        if len(self.reference_unit_s) != self.bounds[-1]:
            raise ConfigError(
                f"{len(self.reference_unit_s)} reference unit times for {self.bounds[-1]} units"
            )
        if (output_bytes is None) != (bandwidths_bps is None):
            raise ConfigError("give a re-partition both boundary sizes and bandwidths, or neither")
        if output_bytes is not None and len(output_bytes) != len(self.reference_unit_s):
            raise ConfigError(
                f"{len(output_bytes)} boundary sizes for {len(self.reference_unit_s)} units"
            )
        self.output_bytes = None if output_bytes is None else [float(b) for b in output_bytes]
        self.bandwidths_bps: list[float] | None = None
        if bandwidths_bps is not None:
            self.links_measured(bandwidths_bps)
        self.plan_epoch = 0  # commits so far
        self.decisions: list[RepartitionDecision] = []
        # counters at the last look: compute seconds, of them forwards, batches
        self._seen: dict[str, tuple[float, float, int]] = {}
        self._since_mb = 0  # the window's first mini-batch (the last look's)
        # devices whose last look's window held a change of speed (measured after it)
        self.changed_in_window: list[str] = []
        self.verdicts_taken: list[str] = []  # devices the last look measured by a verdict
        # the last look's window per device: its seconds per batch, the mini-batches
        # they were measured on and the mini-batches the stage gave one by one
        self.window: dict[str, tuple[float, int, int]] = {}
        self.capacities: dict[str, float] = {}  # smoothed across looks
        # each device's own cost per batch, fitted across looks; at most an even
        # stage's units (a fit of loaded looks once read ten units of 24, and eq. 5
        # then gave 21 units to the slowest device)
        self.costs = StageCosts(most=math.fsum(self.reference_unit_s) / max(len(self.devices), 1))
        self._units_s: dict[str, float] = {}  # reference seconds each device held at its last look
        # the compute period each cut measured since the last real change of a
        # capacity (its links are costed at each look from the latest bandwidths)
        self.tried: dict[tuple[int, ...], float] = {}
        # the cuts each look found (the latest last); kept through a real change, which
        # a swinging fit can fake (a true one promises far more than revisit_gain)
        self.held: list[tuple[int, ...]] = []

    def due(self, done: int) -> bool:
        return self.settings.due(done)

    def links_measured(self, bandwidths_bps: Sequence[float]) -> None:
        """The links between consecutive devices as last measured (bytes per second,
        ``math.inf``: unlimited): the next looks cost eq. 6 with them. Taken as they
        come, not averaged: a probe is a median already, and the compute the cuts
        measured (``tried``) does not depend on them."""
        if self.output_bytes is None:
            raise ConfigError("a re-partition without boundary sizes has no links to cost")
        links = [float(b) for b in bandwidths_bps]
        if len(links) != len(self.devices) - 1:
            raise ConfigError(
                f"{len(self.devices)} stages have {len(self.devices) - 1} links, got {len(links)}"
            )
        bad = [b for b in links if not b > 0]
        if bad:
            raise ConfigError(f"link bandwidths must be > 0, got {links}")
        self.bandwidths_bps = links

    def look(
        self,
        at: int,
        counters: Mapping[str, Mapping[str, Any]],
        *,
        bandwidths_bps: Sequence[float] | None = None,
        verdicts: Mapping[str, SpeedVerdict] | None = None,
    ) -> RepartitionDecision:
        """The decision after batch ``at`` from each device's cumulative counters
        (``forward_s``, ``backward_s``, ``step_s``, ``microbatches``); with
        ``bandwidths_bps``, the links as measured now (:meth:`links_measured`); with
        ``verdicts``, the stages' speed verdicts since the last look (by device; the
        caller hands each to one look only): one about these cuts measures its device
        at its new speed; one about older cuts, or a device left out, is ignored."""
        if bandwidths_bps is not None:
            self.links_measured(bandwidths_bps)
        measured: dict[str, float] = {}
        self.changed_in_window, self.window, self.verdicts_taken = [], {}, []
        valid = {d: v for d, v in (verdicts or {}).items() if v.plan_epoch == self.plan_epoch}
        limit = 1.0 + self.settings.deviation
        for device in self.devices:
            c = counters.get(device) or {}
            seconds, spans, batches = stage_totals(c)
            before_s, before_spans, before_n = self._seen.get(device, (0.0, 0.0, 0))
            self._seen[device] = (seconds, spans, batches)
            if batches > before_n and seconds > before_s:
                # the window's mini-batches one by one: those fed since the last look
                one_by_one = recent_times(c.get("recent"), self._since_mb)
                window = (seconds - before_s, spans - before_spans, batches - before_n)
                if device in valid:
                    found = verdict_time(*window, one_by_one, valid[device])
                    self.verdicts_taken.append(device)
                else:
                    found = window_time(*window, one_by_one, limit=limit)
                measured[device] = found.seconds
                self.window[device] = (found.seconds, found.kept, len(one_by_one or ()))
                if found.changed:
                    self.changed_in_window.append(device)
        self._since_mb = at
        settings = self.settings
        if self.plan_epoch > 0 and settings.bounds is not None:
            settings = replace(settings, bounds=None)
        smoothed, fixed = None, None
        if all(d in measured for d in self.devices):
            smoothed = self._smooth(measured)
            fixed = {d: smoothed[d] * self.costs.share() for d in self.devices}
            self.tried[self.bounds] = period_at(
                self.bounds,
                self.reference_unit_s,
                [smoothed[d] for d in self.devices],
                None,
                None,
                [fixed[d] for d in self.devices],
            )
        elif self.capacities and all(d in self.capacities for d in self.devices):
            # nothing new in this window for some device (a look right after another
            # look's move: its flush rebased the counters): the capacities measured
            # before stand; eq. 7's "nothing measured yet" would undo the cuts they found
            smoothed = dict(self.capacities)
            fixed = {d: smoothed[d] * self.costs.share() for d in self.devices}
        looks = self.settings.revisit_looks
        if self.verdicts_taken:
            # the cuts left before a stage's own verdict were judged at its old speed:
            # no hysteresis against them (unlike a fitted "real change", which a
            # swinging fit can fake, a verdict is the stage's passes, a streak of them)
            self.held = []
        recent = self.held[-looks:] if looks else []
        decision = decide_repartition(
            settings,
            at=at,
            devices=self.devices,
            bounds=self.bounds,
            reference_unit_s=self.reference_unit_s,
            measured_s=measured,
            output_bytes=self.output_bytes,
            bandwidths_bps=self.bandwidths_bps,
            capacities=smoothed,
            tried=self.tried,
            fixed_s=fixed,
            left=[b for b in recent if b != self.bounds],
        )
        self.held = [*self.held, self.bounds][-max(looks, 1) :]
        self.decisions.append(decision)
        return decision

    def window_logged(self) -> dict[str, Any]:
        """What the last look measured of each device (seconds per batch, the
        mini-batches kept of those given one by one), where its window held a change
        of speed, and which devices it measured by their stage's verdict."""
        return {
            "window": {d: [round(s, 6), kept, given] for d, (s, kept, given) in
                       self.window.items()},
            "changed_in_window": list(self.changed_in_window),
            "verdicts_taken": list(self.verdicts_taken),
        }  # fmt: skip

    def rebase(self, counters: Mapping[str, Mapping[str, Any]]) -> None:
        """The stages' cumulative counters at the flush of a move decided before it
        (a look without a flush): the next look's window starts here, so the batches
        the old cuts drained after that look are not counted as the new cuts'."""
        for device in self.devices:
            c = counters.get(device)
            if c is None:
                continue
            self._seen[device] = stage_totals(c)

    def _smooth(self, measured: Mapping[str, float]) -> dict[str, float]:
        """Each device's capacity (its fixed cost taken out) averaged with its past
        looks; a time beyond ``1 + deviation`` times what the model predicts for its
        units replaces it, and forgets what every cut measured."""
        keep, limit = self.settings.smoothing, 1.0 + self.settings.deviation
        units_s = {
            d: math.fsum(self.reference_unit_s[self.bounds[i] : self.bounds[i + 1]])
            for i, d in enumerate(self.devices)
        }
        before = self.costs.share()
        real: set[str] = set()
        for device, value in measured.items():
            past = self.capacities.get(device)
            # a change found inside the window gave the speed after it; whether that is
            # a real change is the model's test as for any look (forcing it made every
            # load swing that looked like a change inside a window clear the measured
            # cuts and the smoothing: a bench run then moved 12 times)
            if past is not None:
                ratio = value / (past * (before + units_s[device]))
                if max(ratio, 1.0 / ratio) > limit:
                    real.add(device)
                    self.costs.changed(device)
        for device, value in measured.items():
            # a look whose window straddles a real change mixes two speeds: no point
            if device not in real:
                self.costs.observe(device, units_s[device], value)
        changed = bool(real)
        after = self.costs.share()
        for device, value in measured.items():
            now = self.costs.capacity(units_s[device], value)
            past = self.capacities.get(device)
            if past is None or device in real:
                self.capacities[device] = now
            else:
                # the past in the refitted share's terms, at the units it was measured on
                then = self._units_s.get(device, units_s[device])
                past *= (before + then) / (after + then)
                self.capacities[device] = keep * past + (1.0 - keep) * now
            self._units_s[device] = units_s[device]
        if changed:
            self.tried.clear()
        return dict(self.capacities)

    def measured(self) -> tuple[dict[str, float], dict[str, float]]:
        """Each device's capacity ``C_i`` and own cost per batch ``F_i`` as the looks
        measured them (smoothed, ``F_i = C_i * phi`` as the looks cost it); both empty
        until a look measured every device. What a fast recovery's eq. 5 re-cuts the
        survivors with (:mod:`zpipe.recovery.fast_recovery_inputs`)."""
        if not self.capacities or not all(d in self.capacities for d in self.devices):
            return {}, {}
        share = self.costs.share()
        caps = {d: float(self.capacities[d]) for d in self.devices}
        return caps, {d: c * share for d, c in caps.items()}

    def links_by_pair(self) -> dict[tuple[str, str], float]:
        """The links between consecutive devices as last measured, by pair (bytes per
        second); empty when the controller costs no links."""
        if self.bandwidths_bps is None:
            return {}
        return dict(zip(pairwise(self.devices), self.bandwidths_bps, strict=True))

    def committed(self, decision: RepartitionDecision) -> int:
        """Every stage switched to ``decision``'s cuts: the new plan epoch."""
        if decision.bounds is None:
            raise ConfigError("a decision to stay has nothing to commit")
        if decision.devices is not None and decision.devices != self.devices:
            self._leave_out(decision.devices)
        self.bounds = decision.bounds
        self.plan_epoch += 1
        return self.plan_epoch

    def _leave_out(self, devices: tuple[str, ...]) -> None:
        """The pipeline goes on over ``devices`` (a subsequence of this one's): the
        others are no longer looked at, nor counted (they stay registered and idle).
        The link between two devices a left-out one separated is costed as eq. 5
        costed it, the slower of the two it replaces, until the next probe."""
        if not set(devices) <= set(self.devices):
            raise ConfigError(f"a move to devices {list(devices)} not all of {list(self.devices)}")
        if self.bandwidths_bps is not None:
            where = {d: i for i, d in enumerate(self.devices)}
            self.bandwidths_bps = [
                min(self.bandwidths_bps[where[a] : where[b]]) for a, b in pairwise(devices)
            ]
        gone = set(self.devices) - set(devices)
        self.devices = devices
        for device in gone:
            self._seen.pop(device, None)
            self.window.pop(device, None)
            self.capacities.pop(device, None)
            self._units_s.pop(device, None)
        # its fitted own cost stays: phi is the stages' share, in reference seconds
        # cuts of the old pipeline: a different number of stages, nothing to compare
        self.tried.clear()
        self.held = []
