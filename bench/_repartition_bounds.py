"""What FTPipeHD's live cuts can gain over PipeDream's even ones, from zpipe's own cost model.

Pure arithmetic for ``bench/training_async.py``'s repartition section. A set-up is
four devices of emulated slowdowns (capacities ``C_i``, eq. 3: a unit takes
``C_i`` times its reference time), a model of equal units (or of the units'
relative costs, ``Setup.weights``), and one device slowing 10x at ``change_s``.
The bound of a phase is the even partition's bottleneck period over the best
integer partition's (eq. 5 on those units,
:func:`zpipe.planner.ftpipehd.ftpipehd_partition`, the planner the coordinator
re-partitions with). The bound of a run follows both pipelines at those periods
through the change (each to the same mini-batch: with vertical sync both
compute the same losses step by step): a faster pipeline does more of its
mini-batches before the change, so a run's bound is not simply between the two
phases' bounds.

``leave_out``: the best cuts may leave a middle device out, as the run's DP does
with the setting (:class:`~zpipe.training.repartition.RepartitionSettings`
``leave_out``: the same call, the run's ``gain`` as the share it must gain and the
ends kept), so a run that leaves a device out is measured against the bound of the
planner it ran, not flattered by a bound that keeps every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zpipe.planner.ftpipehd import ftpipehd_partition

SLOWING_FACTOR = 10.0
# the run's gain (bench/training_async.py): what leaving a device out must gain too
LEAVE_OUT_GAIN = 0.1


def best_cuts(
    reference: Sequence[float],
    capacities: Sequence[float],
    fixed_s: Sequence[float],
    *,
    leave_out: bool,
) -> tuple[float, tuple[int, ...]]:
    """Eq. 5's best period and cuts, as the run's controller calls it."""
    best = ftpipehd_partition(
        reference,
        capacities=capacities,
        fixed_s=fixed_s,
        leave_out=leave_out,
        leave_out_gain=LEAVE_OUT_GAIN,
        keep_ends=True,
    )
    return best.period_s, best.bounds


@dataclass(frozen=True)
class Setup:
    """One repartition set-up: ``units`` equal units; device ``slowing`` (0: the
    best) turns 10x slower ``change_s`` after its first step; ``steps`` mini-batches;
    ``residual``: the MLP's hidden units are residual blocks; ``weights``: each unit's
    cost relative to the others (empty: all alike)."""

    name: str
    units: int
    slowing: int
    steps: int
    change_s: float
    activation: str = "gelu"
    residual: bool = False
    weights: tuple[float, ...] = ()

    def reference(self) -> list[float]:
        """Each unit's reference cost for the bounds."""
        if self.weights and len(self.weights) != self.units:
            raise ValueError(f"{len(self.weights)} unit weights for {self.units} units")
        return list(self.weights) if self.weights else [1.0] * self.units


def residual_unit_weights(dims: Sequence[int]) -> tuple[float, ...]:
    """Multiply-adds per unit of a residual MLP (``dims``: in, hidden..., out; a hidden
    unit is a block of two ``h x h`` Linears), relative to one block."""
    hidden = dims[1]
    block = 2.0 * hidden * hidden
    last = len(dims) - 2
    return tuple(
        1.0 if 0 < i < last and dims[i] == dims[i + 1] else dims[i] * dims[i + 1] / block
        for i in range(len(dims) - 1)
    )


@dataclass(frozen=True)
class PhaseBound:
    """Periods in unit-times (one unit on a device of capacity 1)."""

    even_period: float
    best_period: float
    best_bounds: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.even_period / self.best_period


def even_bounds(units: int, stages: int) -> list[int]:
    """PipeDream's even start: ``units // stages`` each, the rest on the last stage."""
    per = units // stages
    return [i * per for i in range(stages)] + [units]


def after_change(capacities: Sequence[float], slowing: int) -> list[float]:
    out = [float(c) for c in capacities]
    out[slowing] *= SLOWING_FACTOR
    return out


def phase_bound(
    capacities: Sequence[float],
    units: int,
    reference: Sequence[float] = (),
    *,
    fixed_units: float = 0.0,
    leave_out: bool = False,
) -> PhaseBound:
    """The even cuts' period and the best integer cuts' (eq. 5), equal units unless
    ``reference`` gives each unit's cost; ``fixed_units``: each stage's own cost per
    batch in units (a device's speed scales it as it scales its units: stage ``i``
    pays ``C_i * (fixed_units + its units)``; 0: eq. 5 as the paper states it)."""
    reference = list(reference) or [1.0] * units
    fixed = [c * fixed_units for c in capacities]
    period, bounds = best_cuts(reference, capacities, fixed, leave_out=leave_out)
    cuts = even_bounds(units, len(capacities))
    even = max(
        (fixed_units + sum(reference[a:b])) * c
        for a, b, c in zip(cuts, cuts[1:], capacities, strict=False)
    )
    return PhaseBound(even, period, bounds)


def fitted_phase_bound(
    capacities: Sequence[float], fixed_s: Sequence[float], units: int, *, leave_out: bool = False
) -> PhaseBound:
    """:func:`phase_bound` with each stage's own cost per batch (``fixed_s``, seconds,
    as a look fitted it; ``capacities`` then in seconds per unit): the bound a stage
    that pays ``F_i`` whatever it holds leaves."""
    reference = [1.0] * units
    period, bounds = best_cuts(reference, capacities, fixed_s, leave_out=leave_out)
    cuts = even_bounds(units, len(capacities))
    even = max(
        f + (b - a) * c for a, b, c, f in zip(cuts, cuts[1:], capacities, fixed_s, strict=False)
    )
    return PhaseBound(even, period, bounds)


def time_to_step(step: int, *, before_s: float, after_s: float, change_s: float) -> float:
    """Seconds to finish ``step`` mini-batches at one period before ``change_s`` and
    another after it."""
    if step * before_s <= change_s:
        return step * before_s
    done = change_s / before_s
    return change_s + (step - done) * after_s


def run_bound(
    capacities: Sequence[float],
    setup: Setup,
    *,
    unit_s: float,
    step: int,
    fixed_units: float = 0.0,
    leave_out: bool = False,
) -> tuple[PhaseBound, PhaseBound, float]:
    """The phases' bounds and the run's: PipeDream's time to ``step`` over FTPipeHD's,
    each at its ideal period (``unit_s`` seconds per unit-time) around the change;
    ``fixed_units``: each stage's own cost per batch (:func:`phase_bound`)."""
    before = phase_bound(
        capacities, setup.units, setup.reference(), fixed_units=fixed_units, leave_out=leave_out
    )
    after = phase_bound(
        after_change(capacities, setup.slowing),
        setup.units,
        setup.reference(),
        fixed_units=fixed_units,
        leave_out=leave_out,
    )
    even = time_to_step(
        step,
        before_s=before.even_period * unit_s,
        after_s=after.even_period * unit_s,
        change_s=setup.change_s,
    )
    best = time_to_step(
        step,
        before_s=before.best_period * unit_s,
        after_s=after.best_period * unit_s,
        change_s=setup.change_s,
    )
    return before, after, even / best
