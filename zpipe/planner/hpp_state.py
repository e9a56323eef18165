"""The states of Asteroid's HPP dynamic program (:mod:`zpipe.planner.hpp`): a stage's
group, Pareto points of sub-pipelines, the per-group stage tables and one level's
states as flat arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class HppGroup:
    """What the DP needs of a stage's group: its shares and eq. 8's and eq. 5's times."""

    devices: tuple[str, ...]
    shares: tuple[int, ...]
    step_s: float  # E_f + E_b
    backward_s: float  # E_b
    allreduce_s: float  # T_a


@dataclass(frozen=True, slots=True)
class Stage:
    start: int
    end: int
    group: HppGroup


# Not frozen: the DP makes millions of points, and a frozen dataclass's __init__ costs
# several times a plain one's. Points are never changed after they are made.
@dataclass(slots=True)
class Point:
    """One Pareto point of a DP state: a sub-pipeline, head stage first."""

    aligned_s: float  # A: the dominant step's aligned execution time (eq. 11)
    allreduce_s: float  # R: max_s (T_a^s - backward time before s)
    head: Stage
    rest: Point | None
    num_devices: int
    num_stages: int

    @property
    def round_s(self) -> float:
        return self.aligned_s + self.allreduce_s

    def stages(self) -> list[Stage]:
        out = [self.head]
        rest = self.rest
        while rest is not None:
            out.append(rest.head)
            rest = rest.rest
        return out


# A state's Pareto front, with the group of its head stage: (g, h, front).
FrontEntry = tuple[int, int, list[Point]]


class GroupTable:
    """A run of devices' stages at one warm-up, filled in as the DP asks for them.

    Stage ``[i, j)`` sits at ``[i, j - i - 1]``: a band that widens as the DP asks for
    longer stages (its bounds keep them short). ``status``: 0 not evaluated yet, 1 the
    group runs the stage, 2 it cannot (memory).
    """

    __slots__ = ("_most", "allreduce", "backward", "shares", "status", "step", "width")

    def __init__(self, num_units: int, size: int) -> None:
        self._most = num_units  # j - i - 1 < num_units
        self.width = 0
        self.status = np.zeros((num_units + 1, 0), dtype=np.int8)
        self.step = np.zeros((num_units + 1, 0))  # E_f + E_b
        self.backward = np.zeros((num_units + 1, 0))  # E_b
        self.allreduce = np.zeros((num_units + 1, 0))  # T_a
        self.shares = np.zeros((num_units + 1, 0, size), dtype=np.int64)

    def widen(self, width: int) -> None:
        """Make room for columns ``0..width - 1``."""
        if width <= self.width:
            return
        width = min(max(width, 2 * self.width, 16), self._most)

        def grown(old: np.ndarray) -> np.ndarray:
            new = np.zeros((old.shape[0], width, *old.shape[2:]), dtype=old.dtype)
            new[:, : self.width] = old
            return new

        self.status, self.step, self.backward = (
            grown(self.status),
            grown(self.step),
            grown(self.backward),
        )
        self.allreduce, self.shares = grown(self.allreduce), grown(self.shares)
        self.width = width


@dataclass(frozen=True, slots=True)
class Level:
    """The states of one number of stages, as flat arrays of their Pareto points in the
    order the DP made them: by first unit, then group ``(g, h)``, then front order."""

    offsets: np.ndarray  # the points of states that start at unit j: [offsets[j], offsets[j+1])
    last_group: np.ndarray  # per unit: the first device g of its last state's group; -1: none
    unit: np.ndarray  # per point: the first unit of its state
    first: np.ndarray  # g of its head stage's group
    pair: np.ndarray  # (g, h) of its head stage's group, as an index of HppSolver.pairs
    aligned: np.ndarray  # A
    allreduce: np.ndarray  # R
    num_devices: np.ndarray
    points: list[Point]
