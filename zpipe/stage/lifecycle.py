"""The stage's lifecycle controller: events in, commands out, no sockets and no asyncio.

Every decision of a stage's run control is made here and tested by feeding
events (``tests/unit/stage/test_stage_lifecycle.py``), the way h11 is tested by feeding
bytes; :mod:`zpipe.stage.runtime` owns the sockets and tasks and carries out
the commands this returns::

    REGISTERING ──registered──> IDLE ──assign──> ASSIGNING ──built──> ASSIGNED
                                 ^                  │ failed             │ connect
                                 └──────────────────┴─────────<─── RUNNING ──data──> compute
    any phase ──shutdown / refused / coordinator silent / a task dying too often──> STOPPING

A coordinator that goes silent is *away* after a few heartbeat intervals (cut
off, paused, restarting): the stage says so once and serves its run on, and
keeps sending heartbeats (fewer after a while), which reach the coordinator
when it is back; the first word from it ends the absence (a heartbeat goes at
once, and a coordinator that no longer knows the stage asks it to register
again, which leaves the run as it is). Only ``silence_limit_s`` of silence
makes it exit, counted from the coordinator's last word or from the last sign of
its process on the control connection, whichever is later (:meth:`link_up`):
a coordinator whose receive queue is flooded may read a stage's heartbeats late,
but libzmq's ZMTP heartbeats on the control connection are answered by its I/O
thread, and a reconnection completes its handshake, while its process lives. A
coordinator that stays silent with its connection up exits the stage only after
``LIVE_LINK_SILENCE_FACTOR`` times the limit (a hung coordinator).

Which data message reaches compute is decided here too (:meth:`data_verdict`):
only a message from a sender the running assignment names, of the running
assignment's plan epoch. Every other is dropped (a wrong sender or kind) or
counted stale (another epoch), so after a re-partition nothing of an older
plan is computed.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from zpipe._errors import ConfigError, ZpipeError
from zpipe.protocol import WireMessage
from zpipe.protocol.data_plane import Data, Grad, Labels, MicroBatchError
from zpipe.protocol.generation import GenSetup
from zpipe.protocol.lossy import LossyDead, LossyGo, LossyProbeRequest, LossyRemap, LossySetup
from zpipe.protocol.repartition import RepartitionRequest
from zpipe.protocol.stage_control import (
    Assign,
    AssignFailed,
    BackupRequest,
    Connect,
    Connected,
    Heartbeat,
    HeartbeatAck,
    LinkPeers,
    LinkPeersOk,
    LinkProbeRequest,
    Metrics,
    MetricsRequest,
    Probe,
    ProbeAck,
    ProfileRequest,
    Ready,
    Refused,
    Register,
    RegisterAgain,
    Registered,
    Shutdown,
    WeightsRequest,
)
from zpipe.stage.commands import (
    AllowProbePeers,
    Command,
    ConnectAssignment,
    DropMessage,
    Exit,
    GenerationControl,
    LossyControl,
    Note,
    RestartTask,
    SendToCoordinator,
    StageJob,
    StartJob,
)
from zpipe.stage.peer_policy import fetch_grants

# The client feeds the last training stage its labels on the data port.
CLIENT = "client"


class CoordinatorLost(ZpipeError):
    """The coordinator could not be reached, or went silent, or refused this stage."""


class StageTaskFailed(ZpipeError):
    """A task the stage cannot serve without (a receive loop, the heartbeat) kept dying."""


class Phase(enum.Enum):
    REGISTERING = "registering"
    IDLE = "idle"  # registered, no assignment (or its data tasks stopped)
    ASSIGNING = "assigning"  # building the shard of an assignment
    ASSIGNED = "assigned"  # built, waiting for the coordinator's "connect"
    RUNNING = "running"  # connected: data tasks stream micro-batches
    STOPPING = "stopping"


# Heartbeat intervals of silence after which the coordinator counts as away (its own
# default for suspecting a stage).
AWAY_AFTER_INTERVALS = 3
# Heartbeats sent without a word back before the stage beats less often: one every
# AWAY_BEAT_INTERVALS intervals, at least AWAY_BEAT_MIN_S apart. Not sooner, so a
# coordinator that is only slow to answer keeps hearing the usual cadence; but the
# backlog a paused coordinator finds on a connection stays below the receive
# high-water mark (16). A coordinator paused for 12 s with 0.3 s heartbeats aborted
# in libzmq 4.3.5 ("!_io_error", stream_engine_base.cpp:310) on SIGCONT, reading such
# a backlog from connections the stages' ZMTP heartbeats had dropped after 5 s; at
# most 8 + 5 heartbeats queue on one now.
BEATS_BEFORE_SLOWING = 8
AWAY_BEAT_INTERVALS = 3
AWAY_BEAT_MIN_S = 1.0
# A coordinator silent this many times ``silence_limit_s`` is lost even while its
# connection is up: its process answers ZMTP pings but has not read or sent a
# message for minutes (hung, not flooded). Under frame_amplification (issue 33:
# 18 M one-byte frames at the coordinator, load 8-13) an idle stage heard nothing
# for 60.6 s and exited while the coordinator served on.
LIVE_LINK_SILENCE_FACTOR = 5


# ------------------------------------------------------------ data routing


@dataclass(frozen=True)
class DataRoute:
    """Who may send which kind of data message (by class) to a running assignment."""

    epoch: int
    senders: Mapping[type[WireMessage], tuple[str, ...]]
    # inference data and gradients carry tensors; a training piece may be empty
    needs_tensors: bool

    @classmethod
    def inference(cls, epoch: int, upstream: str) -> DataRoute:
        return cls(epoch, {Data: (upstream,), MicroBatchError: (upstream,)}, needs_tensors=True)

    @classmethod
    def training(
        cls, epoch: int, upstream: tuple[str, ...], downstream: tuple[str, ...], *, last: bool
    ) -> DataRoute:
        senders: dict[type[WireMessage], tuple[str, ...]] = {
            Data: upstream,
            MicroBatchError: upstream,
            Grad: downstream,
        }
        if last:
            senders[Labels] = (CLIENT,)
        return cls(epoch, senders, needs_tensors=False)


class DataVerdict(enum.Enum):
    DELIVER = "deliver"
    STALE = "stale"  # of another plan epoch: counted, not computed
    DROP = "drop"  # not a message this assignment accepts: counted, logged


@dataclass(frozen=True)
class DataDecision:
    verdict: DataVerdict
    reason: str = ""


# ------------------------------------------------------------- the controller


@dataclass
class _Pending:
    run: int
    epoch: int


@dataclass
class RestartPolicy:
    """A task may die ``limit`` times within ``window_s`` and be restarted; once more fails."""

    limit: int = 3
    window_s: float = 60.0
    _deaths: dict[str, deque[float]] = field(default_factory=dict)

    def allows(self, name: str, now: float) -> bool:
        deaths = self._deaths.setdefault(name, deque())
        deaths.append(now)
        while deaths and now - deaths[0] > self.window_s:
            deaths.popleft()
        return len(deaths) <= self.limit


class StageLifecycle:
    """The run control of one stage: registration, assignment, connection, liveness."""

    def __init__(
        self,
        *,
        name: str,
        coordinator: str,
        registration: Register,
        connect_s: float,
        silence_limit_s: float,
        now: float,
        restart_policy: RestartPolicy | None = None,
        link_lag_s: float = 0.0,
    ) -> None:
        self.name = name
        self.coordinator = coordinator
        self.registration = registration
        self.connect_s = connect_s
        self.silence_limit_s = silence_limit_s
        self.phase = Phase.REGISTERING
        self.heartbeat_interval_s = 0.0
        self._register_deadline = now + connect_s
        self._heard_at = now
        self._away = False  # the coordinator has been silent for a while
        self._beat_at = now  # when the last heartbeat was due
        self._unanswered = 0  # heartbeats sent since the coordinator's last word
        self._back_after: float | None = None  # silence to report on its first word
        self._building: _Pending | None = None  # the assignment whose shard is being built
        self._pending: _Pending | None = None  # built, awaiting "connect"
        self._route: DataRoute | None = None  # the running assignment's
        self.newest_epoch = -1  # of every assignment received
        self._restarts = restart_policy or RestartPolicy()
        # The control connection as libzmq sees it (link_up / link_down): while it is
        # up, the coordinator's process answered a ZMTP ping within ``link_lag_s``
        # (the ping interval and its timeout), so it was alive that long ago.
        self.link_lag_s = link_lag_s
        self._link_up = False
        self._link_alive_at = float("-inf")  # the latest sign of its process
        self._silent_but_linked = False  # reported once per silence

    # ------------------------------------------------------------ registration

    def registration_time_left(self, now: float) -> float:
        return self._register_deadline - now

    def registration_due(self, now: float) -> list[Command]:
        """Time to (re)send the registration, unless ``connect_s`` has run out."""
        if self.registration_time_left(now) <= 0:
            return [
                self._exit(
                    CoordinatorLost(
                        f"could not reach the coordinator at {self.coordinator} within "
                        f"{self.connect_s:g} s; is it running, and are --coordinator "
                        "and --keys right?"
                    )
                )
            ]
        return [SendToCoordinator(self.registration)]

    def registration_reply(self, message: WireMessage, now: float) -> list[Command]:
        """The coordinator's answer to a registration (other kinds are ignored)."""
        if self.phase is not Phase.REGISTERING:
            return []
        match message:
            case Refused(reason=reason):
                return [self._exit(ConfigError(f"the coordinator refused this stage: {reason}"))]
            case Registered(heartbeat_interval=interval):
                self.heartbeat_interval_s = float(interval)
                self.phase = Phase.IDLE
                self._heard_at = now
        return []

    # ------------------------------------------------------------- liveness

    def heard_from_coordinator(self, now: float) -> None:
        """Any frames from the coordinator, even undecodable ones, show it is alive."""
        if self._away:
            self._away = False
            self._back_after = now - self._heard_at
        self._heard_at = max(self._heard_at, now)
        self._unanswered = 0
        self._silent_but_linked = False

    def link_up(self, now: float) -> None:
        """The control connection completed its handshake with the coordinator: its
        process is there now (a flood may still keep its messages from being read)."""
        self._link_up = True
        self._link_alive_at = max(self._link_alive_at, now)

    def link_down(self, now: float) -> None:
        """The control connection dropped (the coordinator's process exited, or its
        ZMTP pings went unanswered): it was last seen alive ``link_lag_s`` ago."""
        if self._link_up:
            self._link_up = False
            self._link_alive_at = max(self._link_alive_at, now - self.link_lag_s)

    def _alive_at(self, now: float) -> float:
        """The latest moment the coordinator is known to have been alive: its last word,
        or the last sign of its process on the control connection."""
        linked = now - self.link_lag_s if self._link_up else self._link_alive_at
        return max(self._heard_at, linked, self._link_alive_at)

    @property
    def coordinator_away(self) -> bool:
        return self._away

    def heartbeat_due(self, now: float) -> list[Command]:
        silent = now - self._heard_at
        out: list[Command] = []
        if silent > self.silence_limit_s:
            unseen = now - self._alive_at(now)
            if unseen > self.silence_limit_s:
                return [
                    self._exit(
                        CoordinatorLost(
                            f"no word from the coordinator at {self.coordinator} for "
                            f"{silent:.1f} s (limit {self.silence_limit_s:g} s), and no "
                            f"sign of its process on the connection for {unseen:.1f} s"
                        )
                    )
                ]
            hung_after = LIVE_LINK_SILENCE_FACTOR * self.silence_limit_s
            if silent > hung_after:
                return [
                    self._exit(
                        CoordinatorLost(
                            f"no word from the coordinator at {self.coordinator} for "
                            f"{silent:.1f} s, though its connection is up (limit "
                            f"{hung_after:g} s with a live connection: is it hung?)"
                        )
                    )
                ]
            if not self._silent_but_linked:
                self._silent_but_linked = True
                out.append(
                    Note(
                        "warning",
                        "coordinator_silent_but_connected",
                        {
                            "silent_s": round(silent, 2),
                            "limit_s": self.silence_limit_s,
                            "hung_after_s": hung_after,
                            "detail": "its process answers on the connection (flooded or "
                            "slow, not gone): serving on",
                        },
                    )
                )
        interval = self.heartbeat_interval_s
        if self._unanswered >= BEATS_BEFORE_SLOWING and now - self._beat_at < max(
            AWAY_BEAT_INTERVALS * interval, AWAY_BEAT_MIN_S
        ):
            return out
        if not self._away and silent > AWAY_AFTER_INTERVALS * interval:
            self._away = True
            out.append(
                Note(
                    "warning",
                    "coordinator_away",
                    {
                        "silent_s": round(silent, 2),
                        "limit_s": self.silence_limit_s,
                        "phase": self.phase.value,
                        "detail": "serving on; exiting if it stays silent for the limit",
                    },
                )
            )
        # A DEALER blocks while the coordinator is unreachable; never for longer
        # than an interval, so the silence check keeps running.
        self._beat_at = now
        self._unanswered += 1
        out.append(self._heartbeat())
        return out

    def _heartbeat(self) -> SendToCoordinator:
        return SendToCoordinator(
            Heartbeat(name=self.name, metrics={}),
            attach_metrics=True,
            timeout_s=self.heartbeat_interval_s,
        )

    def _coordinator_back(self) -> list[Command]:
        """After an absence: say so, and beat at once, so the coordinator hears this
        stage as soon as it can (it may be waiting for one word to trust itself)."""
        away, self._back_after = self._back_after, None
        if away is None or self.phase is Phase.STOPPING:
            return []
        back = Note(
            "info", "coordinator_back", {"away_s": round(away, 2), "phase": self.phase.value}
        )
        return [back, self._heartbeat()]

    # ------------------------------------------------------- control messages

    def control_message(self, message: WireMessage, now: float) -> list[Command]:
        self.heard_from_coordinator(now)
        return [*self._coordinator_back(), *self._control_message(message)]

    def _control_message(self, message: WireMessage) -> list[Command]:
        if self.phase is Phase.STOPPING:
            return []
        match message:
            case HeartbeatAck() | Registered():
                return []
            case RegisterAgain():
                # A coordinator restarted without our registration (or one that had
                # declared us dead): join it again; what this stage runs is unchanged.
                return [SendToCoordinator(self.registration)]
            case Refused(reason=reason):
                lost = CoordinatorLost(f"the coordinator refused this stage: {reason}")
                return [self._exit(lost)]
            case Probe(nonce=nonce):
                return [SendToCoordinator(ProbeAck(nonce=nonce))]
            case Assign():
                return self._assign(message)
            case Connect():
                return self._connect(message)
            case ProfileRequest():
                # Profiling runs for seconds: off the control loop, and only one at a time.
                return [StartJob(StageJob.PROFILE, message, newest_wins=False)]
            case LinkPeers(keys=keys, fetches=fetches):
                allowed = {str(n): str(k) for n, k in keys.items()}
                grants = fetch_grants(fetches) if fetches is not None else None
                return [
                    AllowProbePeers(allowed, grants),
                    SendToCoordinator(LinkPeersOk(name=self.name)),
                ]
            case LinkProbeRequest():
                return [StartJob(StageJob.LINK_PROBE, message, newest_wins=False)]
            case WeightsRequest():
                # The newest request wins: an older one waits for a round of a run that a
                # failure ended, and would otherwise block every later request.
                return [StartJob(StageJob.WEIGHTS, message, newest_wins=True)]
            case BackupRequest():
                return [StartJob(StageJob.BACKUP, message, newest_wins=True)]
            case RepartitionRequest():
                return [StartJob(StageJob.REPARTITION, message, newest_wins=True)]
            case LossySetup() | LossyGo() | LossyDead() | LossyRemap() | LossyProbeRequest():
                return [LossyControl(message)]
            case GenSetup():
                return [GenerationControl(message)]
            case MetricsRequest(run=run, timeline=timeline):
                reply = Metrics(run=run, name=self.name, metrics={}, epoch=message.epoch)
                return [
                    SendToCoordinator(reply, attach_metrics=True, attach_timeline=bool(timeline))
                ]
            case Shutdown(reason=reason):
                self.phase = Phase.STOPPING
                return [Exit(reason)]  # a clean exit, logged as stage_shutdown
        return [DropMessage("coordinator", f"unexpected control message {message.KIND!r}")]

    def _assign(self, message: Assign) -> list[Command]:
        # Building a shard can take long: a job, and a newer assignment replaces it.
        self.phase = Phase.ASSIGNING
        self._building = _Pending(message.run, message.epoch)
        self._pending = None
        self._route = None
        self.newest_epoch = max(self.newest_epoch, message.epoch)
        return [StartJob(StageJob.ASSIGN, message, newest_wins=True)]

    def assignment_ready(
        self,
        run: int,
        epoch: int,
        *,
        build_s: float,
        ring_endpoint: str = "",
        max_message_bytes: int | None = None,
    ) -> list[Command]:
        """``max_message_bytes``: the data port's limit per frame under this plan, so
        that a sender can refuse a larger message before libzmq drops it."""
        if self._building != _Pending(run, epoch):
            return []  # a newer assignment replaced this one meanwhile
        self._building = None
        self._pending = _Pending(run, epoch)
        self.phase = Phase.ASSIGNED
        ready = Ready(
            run=run,
            name=self.name,
            build_s=build_s,
            ring_endpoint=ring_endpoint or None,  # no ring: the field is left out
            max_message_bytes=max_message_bytes,
            epoch=epoch,
        )
        return [SendToCoordinator(ready)]

    def assignment_failed(self, run: int, epoch: int, error: str) -> list[Command]:
        if self._building == _Pending(run, epoch):
            self._building = None
            self.phase = Phase.IDLE
        return [self._assign_failed(run, epoch, error)]

    def _connect(self, message: Connect) -> list[Command]:
        """Second phase of an assignment: every stage now allows its upstream's key."""
        run = message.run
        pending = self._pending
        if pending is None or pending.run != run:
            return [
                DropMessage(
                    "coordinator", f"connect for run {run}, which this stage was not assigned"
                )
            ]
        self._pending = None
        return [ConnectAssignment(run, pending.epoch, message.ring)]

    def connected(self, run: int, route: DataRoute) -> list[Command]:
        """The assignment is connected; its data tasks start with ``route``."""
        self._route = route
        self.phase = Phase.RUNNING
        return [SendToCoordinator(Connected(run=run, name=self.name, epoch=route.epoch))]

    def rerouted(self, route: DataRoute) -> None:
        """The running assignment's senders changed (a re-partition left a device out)."""
        if self._route is not None:
            self._route = route

    def connect_failed(self, run: int, epoch: int, error: str) -> list[Command]:
        self.phase = Phase.IDLE
        return [self._assign_failed(run, epoch, error)]

    def data_stopped(self) -> None:
        """The data tasks were stopped (a new assignment, a run ended elsewhere)."""
        self._route = None
        if self.phase is Phase.RUNNING:
            self.phase = Phase.IDLE

    def _assign_failed(self, run: int, epoch: int, error: str) -> SendToCoordinator:
        return SendToCoordinator(AssignFailed(run=run, name=self.name, error=error, epoch=epoch))

    # ---------------------------------------------------------------- data

    @property
    def route(self) -> DataRoute | None:
        return self._route

    def data_verdict(
        self, kind: type[WireMessage], src: object, epoch: int, *, has_tensors: bool
    ) -> DataDecision:
        """Whether a data message (of class ``kind``) goes to compute: from an assigned
        sender, of this epoch."""
        route = self._route
        if route is None or self.phase is not Phase.RUNNING:
            return DataDecision(DataVerdict.DROP, "no assignment is running")
        name = kind.KIND  # the kind's wire name, for the reasons logged
        expected = route.senders.get(kind)
        if expected is None:
            return DataDecision(DataVerdict.DROP, f"{name!r} does not belong on the data port")
        if src not in expected:
            return DataDecision(
                DataVerdict.DROP, f"{name} from {src!r}, but it must come from {list(expected)}"
            )
        if route.needs_tensors and kind is not MicroBatchError and not has_tensors:
            return DataDecision(DataVerdict.DROP, f"a {name} message carries no tensors")
        if epoch != route.epoch:
            return DataDecision(DataVerdict.STALE, f"epoch {epoch}, running {route.epoch}")
        return DataDecision(DataVerdict.DELIVER)

    # ------------------------------------------------------------ supervision

    def task_died(self, name: str, error: str, now: float) -> list[Command]:
        """A long-lived task ended with an exception: restart it, or fail loudly."""
        if self.phase is Phase.STOPPING:
            return []
        if self._restarts.allows(name, now):
            return [RestartTask(name)]
        return [
            self._exit(
                StageTaskFailed(
                    f"the stage's {name} task died {self._restarts.limit + 1} times within "
                    f"{self._restarts.window_s:g} s; last: {error}"
                )
            )
        ]

    def stop_requested(self, reason: str) -> list[Command]:
        if self.phase is Phase.STOPPING:
            return []
        self.phase = Phase.STOPPING
        return [Exit(reason)]

    def _exit(self, error: ZpipeError) -> Exit:
        self.phase = Phase.STOPPING
        return Exit(str(error), error)
