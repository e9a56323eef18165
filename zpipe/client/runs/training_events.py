"""What goes into and comes out of a fit's attempts controller
(:class:`zpipe.client.runs.training_attempts.TrainingAttempts`): its events and its
commands, plain data. The table of which event answers with which command is in that
module's docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zpipe._errors import StageFailedError
from zpipe.client.reports import TrainReport
from zpipe.planner.async_schedule import ASYNC_SCHEDULE
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.client_control import RunRequest

# ---------------------------------------------------------------------------- events


@dataclass(frozen=True)
class AttemptReady:
    """The coordinator answered the run request (``run_ready``); ``resumed``: the older
    global copy it resumed from instead of the replica asked for, if it did."""

    resumed: dict[str, Any] | None = None
    now: float = 0.0
    # an asynchronous run's fast recovery: the coordinator's plan summary (run_ready's)
    fast_recovery: dict[str, Any] | None = None


@dataclass(frozen=True)
class AttemptStarted:
    """The attempt's sockets are open on ``training_plan`` (None: not said)."""

    training_plan: TrainingPlan | None
    now: float = 0.0


@dataclass(frozen=True)
class FeedAt:
    """The feed is about to send mini-batch ``step`` (of the whole fit)."""

    step: int


@dataclass(frozen=True)
class Acknowledged:
    """Every mini-batch before ``step`` (of the fit) has its loss back: what no
    recovery trains again is let go of (:meth:`TrainingAttempts.releases_acknowledged`);
    ``now``: when (the client's monotonic clock; what an early look watches)."""

    step: int
    now: float | None = None


@dataclass(frozen=True)
class Looked:
    """The re-partition look before ``step`` is done; ``moved``: units moved;
    ``period_s``: the period per mini-batch the look predicted for the cuts it moved
    to (None: not said), the loss watch's next baseline."""

    step: int
    moved: bool
    period_s: float | None = None
    # the cuts' plan epoch after the look (None: not said): older speed verdicts drop
    plan_epoch: int | None = None


@dataclass(frozen=True)
class SpeedNoticed:
    """The coordinator relayed stage ``stage``'s verdict that its forwards changed speed
    for good (``speed_changed``: ``ratio`` new over old) on the cuts of ``plan_epoch``:
    an early look is due (``RepartitionSettings.forward_watch``)."""

    stage: str
    plan_epoch: int
    ratio: float


@dataclass(frozen=True)
class ReplicaKept:
    """The coordinator keeps a replica taken before mini-batch ``step`` (of the fit):
    run ``run``'s own step ``run_step``; ``rebalance``: a better-balanced plan."""

    step: int
    run: int
    run_step: int
    global_copy: bool = False
    rebalance: TrainingPlan | None = None


@dataclass(frozen=True)
class ReplicaRefused:
    """The coordinator could not keep the replica before ``step``: the last one stands."""

    step: int


@dataclass(frozen=True)
class AttemptEnded:
    """An attempt ended without an error of its own: it finished (``failure`` and
    ``rebalance_to`` None), a stage died (``failure``), or it stops at the replica just
    kept to go on on ``rebalance_to``. ``report``: the attempt's; ``started``: when
    its training began (the fit's clock); ``now``: when it ended."""

    report: TrainReport
    started: float
    failure: StageFailedError | None = None
    rebalance_to: TrainingPlan | None = None
    now: float = 0.0


Event = (
    AttemptReady
    | AttemptStarted
    | FeedAt
    | Acknowledged
    | Looked
    | SpeedNoticed
    | ReplicaKept
    | ReplicaRefused
    | AttemptEnded
)

# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class RequestRun:
    """Send ``request`` (``run_request``): the next attempt, from mini-batch ``offset``.
    ``recovery``: the record of the recovery that starts it, if one does."""

    request: RunRequest
    offset: int
    recovery: dict[str, Any] | None = None


@dataclass(frozen=True)
class StartAttempt:
    """Open the attempt: feed from mini-batch ``offset``, the kept ones first."""

    schedule: str
    num_microbatches: int
    offset: int
    replicate_every: int | None
    global_every: int | None

    @property
    def asynchronous(self) -> bool:
        return self.schedule == ASYNC_SCHEDULE


@dataclass(frozen=True)
class RepartitionLook:
    """Have the coordinator look for a re-partition before mini-batch ``step``."""

    step: int


@dataclass(frozen=True)
class KeepReplica:
    """Drain the pipeline and have a replica kept before ``step`` (``global_copy``:
    of every unit at the coordinator too)."""

    step: int
    global_copy: bool


@dataclass(frozen=True)
class SendMiniBatch:
    step: int


@dataclass(frozen=True)
class EndAttempt:
    """The attempt stops feeding here: the next one goes on on ``rebalance_to``."""

    rebalance_to: TrainingPlan


@dataclass(frozen=True)
class FinishFit:
    """Every mini-batch is trained: end the run, then report
    (:meth:`TrainingAttempts.complete`)."""


@dataclass(frozen=True)
class FailFit:
    error: BaseException


Command = (
    RequestRun
    | StartAttempt
    | RepartitionLook
    | KeepReplica
    | SendMiniBatch
    | EndAttempt
    | FinishFit
    | FailFit
)
