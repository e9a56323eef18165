"""Per-stage training schedules (GPipe, 1F1B-Sync), their warm-up counts and a simulator.

Pure: no I/O, no asyncio, no torch. A schedule is each stage's list of actions for one
round (one mini-batch of M micro-batches); the stage executor runs them in order, and
``simulate`` predicts how long the round takes and how much activation memory it holds.

P = 3 stages, M = 6 micro-batches, forward and backward one tick each, free transfers
(``simulate(...).diagram(tick_s=1)``; a column is one tick, ``.`` is a bubble)::

    gpipe: all forwards, then all backwards              peak live activations 6, 6, 6
    stage 0 |F0 F1 F2 F3 F4 F5 .  .  .  .  B0 B1 B2 B3 B4 B5
    stage 1 |.  F0 F1 F2 F3 F4 F5 .  .  B0 B1 B2 B3 B4 B5 .
    stage 2 |.  .  F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5 .  .

    1f1b, Asteroid warm-ups K = 5, 3, 1                   peak live activations 5, 3, 1
    stage 0 |F0 F1 F2 F3 F4 B0 F5 B1 .  B2 .  B3 .  B4 .  B5
    stage 1 |.  F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5 .
    stage 2 |.  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .

    1f1b, Eco-FL warm-ups P_s = 3, 2, 1 (no communication) peak live activations 3, 2, 1
    stage 0 |F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
    stage 1 |.  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5 .
    stage 2 |.  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .

All three take (M + P - 1) x (forward + backward) = 16 ticks; 1F1B holds fewer
activations. Stage p runs its warm-up K_p forwards, then one backward and one forward in
turn, then the remaining backwards; backwards run in micro-batch order in both schedules,
so GPipe is 1F1B with K_p = M. Warm-ups must not grow from one stage to the next, or two
neighbours wait for each other (``pipeline_actions`` checks; ``simulate`` reports it).

Each compute comes with explicit transfers: ``RECV_F3 F3 SEND_F3`` and ``RECV_B3 B3
SEND_B3``. A RECV waits until the message is there (the transport receives in the
background); a SEND queues it on the link and the stage goes on computing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from zpipe._errors import ConfigError

# Rounding guard: a ratio such as 0.1 * 3 / 0.3 must not ceil to the next integer.
_EPS = 1e-9


def _check_count(name: str, value: int, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def gpipe_warmup(num_microbatches: int) -> int:
    """GPipe runs every forward before the first backward: the warm-up is M."""
    _check_count("num_microbatches", num_microbatches)
    return num_microbatches


def asteroid_warmup(num_stages: int, stage: int, num_microbatches: int) -> int:
    """Asteroid's warm-up ``K_p = min(2 (P - p) - 1, M)`` for 0-indexed stage ``p``.

    Asteroid (MobiCom '24, section 3.2) finds that this is the smallest K_p that keeps
    the pipeline as busy as larger ones; for P = 3 it gives 5, 3, 1.
    """
    _check_stage(stage, num_stages)
    _check_count("num_microbatches", num_microbatches)
    return min(2 * (num_stages - stage) - 1, num_microbatches)


def torch_warmup(num_stages: int, stage: int, num_microbatches: int) -> int:
    """``torch.distributed.pipelining``'s ``Schedule1F1B`` warm-up ``min(P - p, M)`` for
    0-indexed stage ``p``: for P = 3, 3, 2, 1 (see :mod:`zpipe.training.warmup` for
    when zpipe uses it)."""
    _check_stage(stage, num_stages)
    _check_count("num_microbatches", num_microbatches)
    return min(num_stages - stage, num_microbatches)


def _check_times(name: str, values: Sequence[float], lengths: tuple[int, ...]) -> list[float]:
    if len(values) not in lengths:
        if len(lengths) == 1:
            want = f"one entry per stage ({lengths[0]})"
        else:
            want = f"one entry per link ({lengths[0]}) or per stage ({lengths[1]}, last ignored)"
        raise ConfigError(f"{name} needs {want}, got {len(values)}")
    out = [float(v) for v in values]
    for i, v in enumerate(out):
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name}[{i}] must be a finite time >= 0 s, got {values[i]!r}")
    return out


def _link_times(name: str, values: Sequence[float], num_stages: int) -> list[float]:
    """Per-link times: S - 1 entries, or S per-stage entries whose last one is dropped."""
    return _check_times(name, values, (num_stages - 1, num_stages))[: num_stages - 1]


def ecofl_warmup(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    send_forward_s: Sequence[float],
    send_backward_s: Sequence[float],
    num_microbatches: int,
) -> list[int]:
    """Eco-FL's forwards in flight per stage (ICPP '22, section 4, equation 3), capped at M.

    All times are for one micro-batch. ``forward_s[s]`` and ``backward_s[s]`` are the
    compute times of stage ``s`` (T_tf^s, T_tb^s); ``send_forward_s[s]`` and
    ``send_backward_s[s]`` are the transfer times on the link between stage ``s`` and
    ``s + 1`` (T_cf^s, T_cb^s), given per link (S - 1 entries) or per stage (S entries, the
    last one ignored because the last stage sends nothing downstream).

    The paper writes ``P_{s-1} >= P_s + (T_tf^s + T_tb^s + T_cf^s + T_cb^s) /
    (T_tf^{s+1} + T_tb^{s+1})`` with ``P_{S-1} = 1``. Read literally, the first step
    (s = S - 1) needs a stage S and a link S-1 -> S that do not exist, so we read the
    left-hand side as P_s, which makes every term exist::

        P_{S-1} = 1
        P_s     = ceil(P_{s+1} + (tf[s] + tb[s] + cf[s] + cb[s]) / (tf[s+1] + tb[s+1]))
                  for s = S-2 .. 0

    Stage s must keep enough micro-batches in flight to cover its own forward and
    backward plus both transfers, counted in cycles of the next stage. Both special cases
    the paper states hold: with equal compute and no communication P_s = S - s, and with
    communication as long as compute P_s = 2 (S - s) - 1 (Asteroid's K_p).
    """
    _check_count("num_microbatches", num_microbatches)
    num_stages = len(forward_s)
    if num_stages < 1:
        raise ConfigError("forward_s needs one entry per stage, got none")
    tf = _check_times("forward_s", forward_s, (num_stages,))
    tb = _check_times("backward_s", backward_s, (num_stages,))
    cf = _link_times("send_forward_s", send_forward_s, num_stages)
    cb = _link_times("send_backward_s", send_backward_s, num_stages)

    in_flight = [1] * num_stages
    for s in range(num_stages - 2, -1, -1):
        downstream_cycle = tf[s + 1] + tb[s + 1]
        if downstream_cycle <= 0:
            raise ConfigError(
                f"stage {s + 1} has zero forward + backward time; "
                "give every stage a positive compute time to compute Eco-FL warm-ups"
            )
        ratio = (tf[s] + tb[s] + cf[s] + cb[s]) / downstream_cycle
        in_flight[s] = math.ceil(in_flight[s + 1] + ratio - _EPS)
    return [max(1, min(p, num_microbatches)) for p in in_flight]


# --------------------------------------------------------------------------- actions

COMPUTE_KINDS = frozenset({"F", "B"})
SEND_KINDS = frozenset({"SEND_F", "SEND_B"})
RECV_KINDS = frozenset({"RECV_F", "RECV_B"})
ROUND_KINDS = frozenset({"ALLREDUCE", "STEP"})
ACTION_KINDS = COMPUTE_KINDS | SEND_KINDS | RECV_KINDS | ROUND_KINDS

_ACTION_RE = re.compile(r"(SEND_F|SEND_B|RECV_F|RECV_B|F|B)(0|[1-9][0-9]*)|ALLREDUCE|STEP")


@dataclass(frozen=True)
class Action:
    """One step of a stage's schedule; ``str()`` gives torch.distributed.pipelining's form.

    ``F``/``B`` compute a micro-batch's forward/backward; ``SEND_*`` hand a result to the
    link (the stage goes on computing while it transfers); ``RECV_*`` wait until that
    micro-batch's input has arrived; ``ALLREDUCE`` and ``STEP`` end the round and carry no
    micro-batch.
    """

    kind: str
    microbatch: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise ConfigError(
                f"unknown action kind {self.kind!r}; use one of {', '.join(sorted(ACTION_KINDS))}"
            )
        if self.kind in ROUND_KINDS:
            if self.microbatch is not None:
                raise ConfigError(f"{self.kind} takes no micro-batch, got {self.microbatch!r}")
        elif (
            isinstance(self.microbatch, bool)
            or not isinstance(self.microbatch, int)
            or self.microbatch < 0
        ):
            raise ConfigError(
                f"{self.kind} needs a micro-batch index >= 0, got {self.microbatch!r}"
            )

    def __str__(self) -> str:
        return self.kind if self.microbatch is None else f"{self.kind}{self.microbatch}"


def parse_action(text: str) -> Action:
    """The inverse of ``str(action)``: ``"F3"``, ``"SEND_B2"``, ``"ALLREDUCE"``, ``"STEP"``."""
    match = _ACTION_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ConfigError(
            f"cannot parse action {text!r}; write a kind and a micro-batch index without "
            "spaces or leading zeros (F3, B3, SEND_F3, RECV_F3, SEND_B3, RECV_B3), "
            "or ALLREDUCE or STEP"
        )
    if match.group(1) is None:
        return Action(match.group(0))
    return Action(match.group(1), int(match.group(2)))


def peak_live_activations(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward has run and whose backward has not, at once.

    This is what a stage's activation memory scales with: K_p for 1F1B, M for GPipe.
    """
    live = peak = 0
    for action in actions:
        if action.kind == "F":
            live += 1
            peak = max(peak, live)
        elif action.kind == "B":
            live -= 1
    return peak


# --------------------------------------------------------------------------- schedules

SCHEDULES = ("gpipe", "1f1b")


def _check_stage(stage: int, num_stages: int) -> None:
    _check_count("num_stages", num_stages)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ConfigError(f"stage must be in 0..{num_stages - 1}, got {stage!r}")


def _compute_order(num_microbatches: int, warmup: int) -> list[Action]:
    """K forwards, then one backward and one forward in turn, then the remaining backwards."""
    order = [Action("F", m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [Action("B", i), Action("F", warmup + i)]
    order += [Action("B", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def stage_actions(
    schedule: str,
    *,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    warmup: int | None = None,
    data_parallel: bool = False,
) -> list[Action]:
    """The actions stage ``stage`` runs in one round (one mini-batch) of ``schedule``.

    ``"gpipe"`` runs all M forwards and then all M backwards; ``"1f1b"`` runs ``warmup``
    forwards (default: Asteroid's K_p), then alternates one backward and one forward, then
    flushes the remaining backwards. Backwards run in micro-batch order in both, so GPipe
    is 1F1B with warm-up M. Every compute is wrapped in its transfers:
    ``RECV_F m, F m, SEND_F m`` and ``RECV_B m, B m, SEND_B m``, leaving out what has no
    peer (stage 0 receives no activations and sends no gradients; the last stage sends no
    activations and receives no gradients, its backward starts from the loss). The round
    ends with ``ALLREDUCE`` (only with ``data_parallel``, when a stage is replicated) and
    ``STEP``.
    """
    _check_stage(stage, num_stages)
    _check_count("num_microbatches", num_microbatches)
    name = schedule.lower() if isinstance(schedule, str) else schedule
    if name == "gpipe":
        if warmup is not None and warmup != num_microbatches:
            raise ConfigError(
                f"gpipe always runs all {num_microbatches} forwards first; leave warmup "
                f"unset (got {warmup!r}) or use the '1f1b' schedule"
            )
        warmup = num_microbatches
    elif name == "1f1b":
        if warmup is None:
            warmup = asteroid_warmup(num_stages, stage, num_microbatches)
        elif isinstance(warmup, bool) or not isinstance(warmup, int):
            raise ConfigError(f"warmup must be an integer, got {warmup!r}")
        elif not 1 <= warmup <= num_microbatches:
            raise ConfigError(
                f"warmup of stage {stage} must be in 1..{num_microbatches} "
                f"(the number of micro-batches), got {warmup}"
            )
    else:
        raise ConfigError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")

    first, last = stage == 0, stage == num_stages - 1
    actions: list[Action] = []
    for compute in _compute_order(num_microbatches, warmup):
        m = compute.microbatch
        if compute.kind == "F":
            before, after = ("RECV_F", first), ("SEND_F", last)
        else:
            before, after = ("RECV_B", last), ("SEND_B", first)
        if not before[1]:
            actions.append(Action(before[0], m))
        actions.append(compute)
        if not after[1]:
            actions.append(Action(after[0], m))
    if data_parallel:
        actions.append(Action("ALLREDUCE"))
    actions.append(Action("STEP"))
    return actions


def pipeline_actions(
    schedule: str,
    *,
    num_stages: int,
    num_microbatches: int,
    warmups: Sequence[int] | None = None,
    data_parallel: bool = False,
) -> list[list[Action]]:
    """Every stage's actions, checking that the warm-ups cannot deadlock.

    1F1B needs warm-ups that do not grow from one stage to the next: if stage p + 1
    wanted more forwards than stage p runs before its first backward, each would wait
    for the other. Asteroid's and Eco-FL's warm-ups never grow.
    """
    _check_count("num_stages", num_stages)
    if warmups is not None:
        if len(warmups) != num_stages:
            raise ConfigError(f"give one warm-up per stage ({num_stages}), got {len(warmups)}")
        for p in range(num_stages - 1):
            if warmups[p + 1] > warmups[p]:
                raise ConfigError(
                    f"warm-up of stage {p + 1} ({warmups[p + 1]}) exceeds that of stage {p} "
                    f"({warmups[p]}), which deadlocks 1F1B; make warm-ups non-increasing"
                )
    return [
        stage_actions(
            schedule,
            stage=p,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            warmup=None if warmups is None else warmups[p],
            data_parallel=data_parallel,
        )
        for p in range(num_stages)
    ]


def validate_stage_actions(actions: Sequence[Action], *, stage: int, num_stages: int) -> None:
    """Check that one stage's actions form a complete round in a causal order.

    Each micro-batch runs F and B once, B after F; a stage that has a peer receives
    before it computes and sends after it; ALLREDUCE and STEP come at most once, after
    every backward, STEP after ALLREDUCE. Raises ConfigError naming the first problem.
    """
    _check_stage(stage, num_stages)
    first, last = stage == 0, stage == num_stages - 1
    where: dict[Action, int] = {}
    for i, action in enumerate(actions):
        if not isinstance(action, Action):
            raise ConfigError(f"stage {stage}: item {i} is {action!r}, not an Action")
        if action in where:
            raise ConfigError(f"stage {stage}: {action} appears twice (at {where[action]}, {i})")
        where[action] = i
        if (first and action.kind in ("RECV_F", "SEND_B")) or (
            last and action.kind in ("SEND_F", "RECV_B")
        ):
            side = "first" if first and action.kind in ("RECV_F", "SEND_B") else "last"
            raise ConfigError(f"stage {stage} is the {side} stage and has no peer for {action}")

    microbatches = sorted({a.microbatch for a in where if a.microbatch is not None})
    needed = (
        ["F", "B"]
        + ([] if first else ["RECV_F", "SEND_B"])
        + ([] if last else ["SEND_F", "RECV_B"])
    )
    for m in microbatches:
        missing = [kind for kind in needed if Action(kind, m) not in where]
        if missing:
            raise ConfigError(
                f"stage {stage}: micro-batch {m} has no {', '.join(f'{k}{m}' for k in missing)}; "
                f"on this stage every micro-batch needs {', '.join(f'{k}{m}' for k in needed)}"
            )

    def must_precede(a: Action, b: Action) -> None:
        if where[a] > where[b]:
            raise ConfigError(
                f"stage {stage}: {a} (at {where[a]}) must come before {b} (at {where[b]})"
            )

    for m in microbatches:
        must_precede(Action("F", m), Action("B", m))
        if not first:
            must_precede(Action("RECV_F", m), Action("F", m))
            must_precede(Action("B", m), Action("SEND_B", m))
        if not last:
            must_precede(Action("F", m), Action("SEND_F", m))
            must_precede(Action("RECV_B", m), Action("B", m))
    backwards = [where[Action("B", m)] for m in microbatches]
    for kind in ROUND_KINDS:
        action = Action(kind)
        if action in where and backwards and where[action] < max(backwards):
            raise ConfigError(f"stage {stage}: {action} must come after every backward")
    allreduce, step = Action("ALLREDUCE"), Action("STEP")
    if allreduce in where and step in where and where[step] < where[allreduce]:
        raise ConfigError(f"stage {stage}: STEP must come after ALLREDUCE")


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class ActionTiming:
    """When an action ran, in seconds from the start of the round.

    Compute (F, B, ALLREDUCE, STEP) occupies the stage from start to end. A send's
    interval is its transfer on the link (from when the link is free to the arrival); the
    stage itself goes on at once. A receive's interval is the stage waiting for the
    arrival (empty if it had arrived already).
    """

    action: Action
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """One simulated round: its latency, and per stage its busy time, timeline and memory."""

    round_s: float
    busy_s: tuple[float, ...]
    timeline: tuple[tuple[ActionTiming, ...], ...]
    peak_live_activations: tuple[int, ...]

    @property
    def idle_s(self) -> tuple[float, ...]:
        """Per stage, the part of the round spent waiting (bubbles)."""
        return tuple(self.round_s - busy for busy in self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-time over all stage-time in the round; 0 for an empty round."""
        total = self.round_s * len(self.busy_s)
        return 0.0 if total <= 0 else 1.0 - sum(self.busy_s) / total

    def diagram(self, tick_s: float) -> str:
        """One row per stage, one 3-character column per ``tick_s`` seconds.

        A compute action is written in the column where it starts (ALLREDUCE as ``AR``,
        STEP as ``S``) and shown as ``=`` while it runs past that column; idle columns are
        ``.``. Exact when every duration is a multiple of ``tick_s``.
        """
        if not (tick_s > 0 and math.isfinite(tick_s)):
            raise ConfigError(f"tick_s must be a positive number of seconds, got {tick_s!r}")
        width = math.ceil(self.round_s / tick_s - _EPS)
        short = {"ALLREDUCE": "AR", "STEP": "S"}
        rows = []
        for p, timings in enumerate(self.timeline):
            cells = ["."] * width
            for t in timings:
                if t.action.kind not in COMPUTE_KINDS | ROUND_KINDS or t.end_s <= t.start_s:
                    continue
                begin = math.floor(t.start_s / tick_s + _EPS)
                end = max(begin + 1, math.ceil(t.end_s / tick_s - _EPS))
                cells[begin:end] = ["="] * (end - begin)
                cells[begin] = short.get(t.action.kind, str(t.action))
            rows.append(f"stage {p} |" + "".join(f"{c:<3}" for c in cells).rstrip())
        return "\n".join(rows)


def _per_stage(name: str, values: Sequence[float] | None, num_stages: int) -> list[float]:
    if values is None:
        return [0.0] * num_stages
    return _check_times(name, values, (num_stages,))


def simulate(
    schedules: Sequence[Sequence[Action]],
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    send_forward_s: Sequence[float],
    send_backward_s: Sequence[float],
    allreduce_s: Sequence[float] | None = None,
    *,
    step_s: Sequence[float] | None = None,
) -> SimResult:
    """Predict one round of a pipeline: ``schedules[p]`` is stage p's action list.

    Durations are per micro-batch and per stage (``forward_s``, ``backward_s``,
    ``allreduce_s``, ``step_s``; the last two default to 0) or per link
    (``send_forward_s[p]``, ``send_backward_s[p]`` for the link between stages p and
    p + 1; S - 1 entries, or S with the last ignored). The model:

    - a stage runs its actions in order, one at a time; F, B, ALLREDUCE and STEP take
      their duration, a RECV waits until that micro-batch's message has arrived;
    - a SEND hands the message to the link and the stage goes on, so sends overlap
      compute; each link carries one message at a time in each direction, in the order
      they were sent, and messages are matched to receives by micro-batch.

    Every stage's time follows from these dependencies alone, so stepping each stage as
    far as its received messages allow, until none can move, gives the exact times of
    the equivalent event-driven simulation. Raises ConfigError for a malformed schedule
    (see ``validate_stage_actions``) or when stages wait on each other forever, naming
    each stuck stage and the action it waits at.
    """
    num_stages = len(schedules)
    if num_stages < 1:
        raise ConfigError("simulate needs at least one stage's schedule")
    tf = _check_times("forward_s", forward_s, (num_stages,))
    tb = _check_times("backward_s", backward_s, (num_stages,))
    cf = _link_times("send_forward_s", send_forward_s, num_stages)
    cb = _link_times("send_backward_s", send_backward_s, num_stages)
    tar = _per_stage("allreduce_s", allreduce_s, num_stages)
    tstep = _per_stage("step_s", step_s, num_stages)
    for p, actions in enumerate(schedules):
        validate_stage_actions(actions, stage=p, num_stages=num_stages)
    sets = [
        sorted({a.microbatch for a in s if a.kind == "F" and a.microbatch is not None})
        for s in schedules
    ]
    for p in range(1, num_stages):
        if sets[p] != sets[0]:
            raise ConfigError(
                f"stage {p} runs micro-batches {sets[p]} but stage 0 runs {sets[0]}; "
                "every stage must run the same micro-batches in a round"
            )

    duration = {"F": tf, "B": tb, "ALLREDUCE": tar, "STEP": tstep}
    # (receiving stage, "F" or "B", micro-batch) -> arrival time of that message
    arrivals: dict[tuple[int, str, int | None], float] = {}
    link_free_f = [0.0] * num_stages  # link p -> p + 1, activations
    link_free_b = [0.0] * num_stages  # link p -> p - 1 (indexed by sender), gradients
    clock = [0.0] * num_stages
    busy = [0.0] * num_stages
    position = [0] * num_stages
    timings: list[list[ActionTiming]] = [[] for _ in range(num_stages)]

    moved = True
    while moved:
        moved = False
        for p, actions in enumerate(schedules):
            while position[p] < len(actions):
                action = actions[position[p]]
                m = action.microbatch
                start = clock[p]
                if action.kind in RECV_KINDS:
                    key = (p, action.kind[-1], m)
                    if key not in arrivals:
                        break  # its sender has not got there yet
                    end = clock[p] = max(start, arrivals[key])
                elif action.kind == "SEND_F":
                    start = max(clock[p], link_free_f[p])
                    end = link_free_f[p] = start + cf[p]
                    arrivals[(p + 1, "F", m)] = end
                elif action.kind == "SEND_B":
                    start = max(clock[p], link_free_b[p])
                    end = link_free_b[p] = start + cb[p - 1]
                    arrivals[(p - 1, "B", m)] = end
                else:
                    end = clock[p] = start + duration[action.kind][p]
                    busy[p] += end - start
                timings[p].append(ActionTiming(action, start, end))
                position[p] += 1
                moved = True

    stuck = [p for p in range(num_stages) if position[p] < len(schedules[p])]
    if stuck:
        waits = ", ".join(
            f"stage {p} at {schedules[p][position[p]]} (action {position[p]})" for p in stuck
        )
        raise ConfigError(
            f"the schedule deadlocks: {waits} wait for messages that never come; "
            "check that each stage's warm-up is at most the previous stage's"
        )

    ends = [t.end_s for stage_timings in timings for t in stage_timings]
    return SimResult(
        round_s=max(ends, default=0.0),
        busy_s=tuple(busy),
        timeline=tuple(tuple(t) for t in timings),
        peak_live_activations=tuple(peak_live_activations(s) for s in schedules),
    )
