"""A stage's time per mini-batch as a fixed cost plus its units' cost, from its looks.

Pure: numbers in, numbers out. FTPipeHD's eq. 3 scales a stage's time with its
units, ``T_i = C_i * R_i`` (``R_i``: its units' reference seconds). A stage also
pays a cost of its own per mini-batch (the shard's call overhead, stashing,
optimizer bookkeeping), and an emulated or a real slower device multiplies it as
it multiplies the units' work. The model here is therefore

    T_i(R) = C_i * (phi_i + R)        fixed_i = C_i * phi_i

with ``phi_i`` the fixed cost in reference seconds. With ``phi_i = 0`` it is
eqs. 1-3 unchanged.

Why a fit across looks: a stage reports only cumulative ``forward_s``,
``backward_s`` and ``step_s`` (one call each per mini-batch, over all its units
at once), so no single look splits the fixed cost from the units' cost. Looks
at different cuts do: each gives one ``(R, T)`` point, and a line through the
points since the device's last real change has intercept ``C_i * phi_i`` and
slope ``C_i``. ``phi_i`` is kept across a real change (a device k times slower
is slower at both), so only the scale ``C_i`` must be measured again.

One ``phi`` for every device: the median of the devices' own fits (0 before
any). The fixed cost is the same code's on every stage (the shard's calls, the
optimizer's bookkeeping), and a device's speed scales it through ``C_i``, so
``F_i = C_i * phi`` still differs per stage. The median matters under load: two
looks' times can swing 1.5x, and a fit through two cuts one unit apart then
reads a stage as nearly all fixed cost (a huge ``phi``, a capacity near 0 that
would pile units on it); one device's wild fit does not move the median of
four. A device that has run one cut only gets the others' ``phi``.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

# points whose unit sums differ by less than this share of the larger are one cut
_DISTINCT = 1e-9


def fit_fixed_share(points: Sequence[tuple[float, float]]) -> float | None:
    """``phi`` from ``(R, T)`` points by a Theil-Sen line ``T = a + b R`` (the median
    of the slopes between points of different cuts, the median intercept at that
    slope), ``phi = a / b``; None when the points span one cut only or the slope is
    not positive (noise); 0 when the intercept is not above rounding. A median, not
    least squares: under load one look's time can be 1.5x its cut's others, and a
    least-squares line through it tilts (a huge ``phi`` or none at all)."""
    if len(points) < 2:
        return None
    xs = [float(r) for r, _ in points]
    if max(xs) - min(xs) <= _DISTINCT * max(abs(x) for x in xs):
        return None
    ys = [float(t) for _, t in points]
    apart = _DISTINCT * max(abs(x) for x in xs)
    slopes = [
        (y2 - y1) / (x2 - x1)
        for (x1, y1), (x2, y2) in itertools.combinations(zip(xs, ys, strict=True), 2)
        if abs(x2 - x1) > apart
    ]
    slope = statistics.median(slopes)
    if not slope > 0:
        return None
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys, strict=True))
    if intercept <= _DISTINCT * statistics.median(ys):  # none, or rounding of none
        return 0.0
    return intercept / slope


@dataclass
class StageCosts:
    """Each device's ``(R, T)`` points since its last real change and its ``phi``."""

    points: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    fitted: dict[str, float] = field(default_factory=dict)  # phi from the device's own points
    most: float = math.inf  # the largest phi taken (reference seconds)

    def share(self) -> float:
        """``phi``: the median of the devices' own fits (at most ``most``), else 0."""
        return min(statistics.median(self.fitted.values()), self.most) if self.fitted else 0.0

    def observe(self, device: str, units_s: float, measured_s: float) -> None:
        """One look: ``device`` took ``measured_s`` per mini-batch over units of
        ``units_s`` reference seconds; refit its ``phi`` when it can."""
        points = self.points.setdefault(device, [])
        points.append((float(units_s), float(measured_s)))
        phi = fit_fixed_share(points)
        if phi is not None:
            self.fitted[device] = phi

    def changed(self, device: str) -> None:
        """A real change of ``device``'s speed: its old points are of another scale
        (its ``phi`` stays: the change multiplies both parts)."""
        self.points.pop(device, None)

    def capacity(self, units_s: float, measured_s: float) -> float:
        """``C_i = T / (phi + R)``: eqs. 1-2 with the fixed cost taken out."""
        return measured_s / (self.share() + units_s)
