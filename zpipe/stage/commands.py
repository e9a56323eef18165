"""What the stage's lifecycle controller asks its shell to do: the commands it returns.

:class:`~zpipe.stage.lifecycle.StageLifecycle` decides; :mod:`zpipe.stage.runtime`
carries these out (sends, jobs, connections, drops, restarts, exits), as the
coordinator's shell carries out :mod:`zpipe.coordinator.commands`. Each carries
protocol objects, never a kind string and a body.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zpipe._errors import ZpipeError
from zpipe.protocol import WireMessage
from zpipe.protocol.generation import GenSetup
from zpipe.protocol.lossy import LossyDead, LossyGo, LossyProbeRequest, LossyRemap, LossySetup
from zpipe.stage.peer_policy import FetchGrant


class StageJob(enum.Enum):
    """Requests that run beside the control loop, because they take long."""

    ASSIGN = "assign"
    PROFILE = "profile"
    LINK_PROBE = "link_probe"
    WEIGHTS = "weights"
    BACKUP = "backup"
    REPARTITION = "repartition"


# ----------------------------------------------------------------- commands


@dataclass(frozen=True)
class SendToCoordinator:
    message: WireMessage
    # the shell fills the message's ``metrics`` with its counters (heartbeats, metrics
    # replies: the controller leaves them empty)
    attach_metrics: bool = False
    # the shell fills ``timeline``: the run's spans and the clock offset
    attach_timeline: bool = False
    timeout_s: float | None = None  # None: the configured send timeout

    @property
    def kind(self) -> str:
        return self.message.KIND

    @property
    def body(self) -> dict[str, Any]:
        return self.message.body()

    @property
    def epoch(self) -> int:
        return self.message.epoch


@dataclass(frozen=True)
class StartJob:
    job: StageJob
    message: WireMessage
    # True: cancel a running job of the same kind; False: skip while one runs
    newest_wins: bool


@dataclass(frozen=True)
class AllowProbePeers:
    """Every cluster member's key, by name, may now reach the probe socket; ``fetches``
    (None: unchanged) the unit fetches the probe socket answers from now on."""

    keys: Mapping[str, str]
    fetches: tuple[FetchGrant, ...] | None = None


@dataclass(frozen=True)
class ConnectAssignment:
    """Connect the built assignment of ``run`` to its neighbours and start its data tasks."""

    run: int
    epoch: int
    ring: Any  # the all-reduce ring of a shared training stage (endpoints, keys), or None


@dataclass(frozen=True)
class LossyControl:
    """Hand a lossy run's control message to the lossy executor
    (:mod:`zpipe.stage.executors.lossy`)."""

    message: LossySetup | LossyGo | LossyDead | LossyRemap | LossyProbeRequest


@dataclass(frozen=True)
class GenerationControl:
    """Hand a generation run's set-up to the generation executor
    (:mod:`zpipe.stage.executors.generation`)."""

    message: GenSetup


@dataclass(frozen=True)
class Note:
    """Log ``event`` (a change the operator should see); nothing else to do."""

    level: str  # "info", "warning"
    event: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class DropMessage:
    peer: str
    reason: str


@dataclass(frozen=True)
class RestartTask:
    name: str


@dataclass(frozen=True)
class Exit:
    """Stop serving; ``error`` None is a clean shutdown, otherwise the process fails."""

    reason: str
    error: ZpipeError | None = None


Command = (
    SendToCoordinator
    | StartJob
    | AllowProbePeers
    | ConnectAssignment
    | DropMessage
    | RestartTask
    | Exit
    | Note
    | LossyControl
    | GenerationControl
)
