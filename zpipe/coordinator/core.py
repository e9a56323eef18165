"""The coordinator's core: membership, registration, liveness, and routing to runs. Pure.

It takes every event (:mod:`zpipe.coordinator.events`) with the time and returns
commands (:mod:`zpipe.coordinator.commands`); the shell
(:mod:`zpipe.coordinator.server`) carries them out. Decisions of a run are its
controller's (:mod:`~zpipe.coordinator.runs.inference`,
:mod:`~zpipe.coordinator.runs.sync_training`),
the start of one :mod:`~zpipe.coordinator.starting`'s. Registrations and the claims
on names are :mod:`~zpipe.coordinator.registration`'s, what a restarted coordinator
takes over :mod:`~zpipe.coordinator.takeover`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from zpipe._errors import (
    ConfigError,
    PeerGoneError,
    StageLostError,
)
from zpipe.coordinator.bulk import (
    bulk_chunk,
    bulk_open,
    expire_stalled,
    freed,
    retie_restored,
)
from zpipe.coordinator.commands import Command, Deliver, FailRequests, Log, Persist, Record, Send
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.events import (
    BulkChunkArrived,
    BulkOpenAsked,
    ClientRequest,
    Event,
    JobDone,
    JobFailed,
    RegisterAsked,
    RequestFailed,
    StageDied,
    StageSpoke,
    StallReported,
    Tick,
    TimerFired,
)
from zpipe.coordinator.notices import NoticeOutbox, notices_due, number_notices
from zpipe.coordinator.partition import GaveUp, Holding, PartitionWatch, Rejoined, Suspected
from zpipe.coordinator.records import SavedReplica, SavedState
from zpipe.coordinator.registration import Registrations, printable
from zpipe.coordinator.runs.async_speed import relay_speed_change
from zpipe.coordinator.runs.base import run_failed
from zpipe.coordinator.saving import saved_state
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import (
    ClusterRequest,
    ClusterState,
    NoticeAck,
    Replicate,
    Replicated,
    RunEnd,
    RunReport,
    RunRequest,
    Stalled,
)
from zpipe.protocol.generation import GenReady, GenRunRequest
from zpipe.protocol.lossy import (
    LossyHold,
    LossyProbeReport,
    LossyReady,
    LossyReplica,
    LossyResult,
    LossyRunRequest,
)
from zpipe.protocol.repartition import RepartitionReply, SpeedChanged
from zpipe.protocol.stage_control import (
    AssignFailed,
    AsyncCopy,
    BackedUp,
    Connected,
    Heartbeat,
    HeartbeatAck,
    LinkPeersOk,
    LinkProbeReply,
    Metrics,
    Probe,
    ProbeAck,
    ProfileReply,
    Ready,
    RegisterAgain,
    Weights,
)

if TYPE_CHECKING:
    from zpipe.coordinator.runs.async_copies import HeldCopy

# Replies of stages to what a run's flows asked (routed to the flow that waits).
REPLIES = (
    Ready,
    AssignFailed,
    Connected,
    Metrics,
    Weights,
    BackedUp,
    LossyReady,
    LossyResult,
    LossyProbeReport,
    LossyHold,
    RepartitionReply,
    GenReady,
)
# Replies to requests the shell makes itself while it plans (profiles, link probes).
SHELL_REPLIES = (ProfileReply, LinkPeersOk, LinkProbeReply)


def metrics_of(message: WireMessage) -> dict[str, Any] | None:
    """The counters a stage's message carries (its heartbeat's, a reply's), if any."""
    match message:
        case Heartbeat(metrics=metrics) | Metrics(metrics=metrics):
            return metrics
        case Weights(metrics=metrics) | BackedUp(metrics=metrics):
            return metrics
        case RepartitionReply(metrics=metrics):
            return metrics
    return None


def peer_state_bytes(metrics: Any) -> object:
    """A stage's count of state bytes moved with its peers, from its heartbeat's metrics
    (None when it sends none)."""
    return metrics.get("peer_state_bytes") if isinstance(metrics, Mapping) else None


class CoordinatorCore:
    """Events in, commands out, for the whole coordinator."""

    def __init__(self, state: ControlState) -> None:
        self.state = state
        t = state.timeouts
        # A partition may last as long as the stages serve on without this process.
        self.partition = PartitionWatch(
            quiet_after_s=t.suspect_after_intervals * t.heartbeat_interval_s,
            give_up_after_s=t.coordinator_silence_s,
        )
        # A client cut off when a notice went misses it: sent again until acknowledged,
        # for as long as the client would wait for a result of its run.
        self.notices = NoticeOutbox(resend_s=2 * t.heartbeat_interval_s, keep_s=t.result_s)
        # registrations, and claims on the names of live stages
        self.registrations = Registrations(state, self._death)

    @property
    def run(self) -> Run | None:
        current = self.state.current
        return None if current is None else current.run

    def on_event(self, event: Event, now: float) -> list[Command]:
        return number_notices(self.notices, self._on_event(event, now), now)

    def _on_event(self, event: Event, now: float) -> list[Command]:
        flows = self.state.flows
        match event:
            case StageSpoke():
                return [*retie_restored(self.state, event), *self._stage_spoke(event, now)]
            case RegisterAsked():
                return self.registrations.register(event, now)
            case BulkChunkArrived():
                out, whole = bulk_chunk(self.state, event, now)
                return out if whole is None else [*out, *self._stage_spoke(whole, now)]
            case BulkOpenAsked():
                return bulk_open(self.state, event, now)
            case ClientRequest():
                return self._client_request(event, now)
            case StallReported(message=stalled):
                return self._stalled(stalled, now)
            case Tick():
                return self._tick(now)
            case TimerFired(tag=tag):
                return flows.timer(tag, now)
            case JobDone(tag=tag, result=result):
                return flows.job_done(tag, result, now)
            case JobFailed(tag=tag, error=error):
                return flows.job_failed(tag, error, now)
            case RequestFailed(stage=stage, error=error):
                if not isinstance(error, PeerGoneError):
                    out = flows.stage_lost(stage, error, now)
                    return [*out, *self.registrations.holder_unreachable(event, now)]
                # not connected now: may come back, but not planned onto meanwhile (this
                # connection's holder: before a claim on its name hands the name over)
                out = flows.request_unsent(stage, error, now)
                out += self._connection_lost(event, now)
                return [*out, *self.registrations.holder_unreachable(event, now)]
        raise TypeError(f"unknown event {event!r}")

    # ------------------------------------------------------------ stages

    def _stage_spoke(self, event: StageSpoke, now: float) -> list[Command]:
        message, membership = event.message, self.state.membership
        kind = message.KIND
        member = membership.by_routing_id(event.routing_id)
        heartbeat_s = self.state.timeouts.heartbeat_interval_s
        if member is None:
            if isinstance(message, Heartbeat):
                # A stage this process does not know (it restarted without its state,
                # or declared the stage dead): it registers again and can be planned.
                again = RegisterAgain(reason="this coordinator does not know you")
                return [Send(event.routing_id, again, printable(event.routing_id), heartbeat_s)]
            return [
                Log(
                    "warning",
                    "dropped_message",
                    {
                        "peer": printable(event.routing_id),
                        "error": f"{kind!r} from a peer that is not registered",
                    },
                )
            ]
        self.state.confirm(member.name)
        moved_before = peer_state_bytes(member.metrics)
        membership.heard_from(
            member.name,
            now,
            metrics_of(message),
            heartbeat=isinstance(message, Heartbeat),
            probe_answer=isinstance(message, ProbeAck),
        )
        match message:
            case Heartbeat(clock=sent, metrics=metrics):
                # a stamped heartbeat gets its stamp back with this clock's (clock offsets)
                stamps = HeartbeatAck() if sent is None else HeartbeatAck(echo=sent, clock=now)
                ack = Send(event.routing_id, stamps, member.name, heartbeat_s)
                moved = peer_state_bytes(metrics)
                if moved is not None and moved != moved_before:
                    # state moving between stages (a chunked backup or fetch) is progress
                    # on the answer a flow awaits from this stage, as bulk chunks are
                    return [ack, *self.state.flows.progress(member.name, now)]
                return [ack]
            case ProbeAck(nonce=nonce):
                refused = self.registrations.answered(member, nonce)
                if refused is not None:
                    return refused
                return [Log("info", "stage_answered_probe", {"stage": member.name})]
            case LossyReplica():
                from zpipe.coordinator.runs.lossy_remap import keep_replica

                return keep_replica(self.state, member.name, message)
            case AsyncCopy():
                from zpipe.coordinator.runs.async_copies import keep_async_copy

                return keep_async_copy(self.state, member.name, message, now)
            case SpeedChanged():
                return relay_speed_change(self.state, member.name, message, now)
        if isinstance(message, SHELL_REPLIES):
            return [Deliver(member.name, message)]
        if isinstance(message, REPLIES):
            routed = self.state.flows.reply(member.name, message, now)
            if routed is None:
                fields = {"stage": member.name, "kind": kind, "run": getattr(message, "run", None)}
                return [Log("debug", "late_reply", fields)]
            return routed
        return [
            Log(
                "warning",
                "dropped_message",
                {"peer": member.name, "error": f"unexpected {kind!r} from stage {member.name!r}"},
            )
        ]

    def _connection_lost(self, event: RequestFailed, now: float) -> list[Command]:
        """A send to a member found its connection gone (a killed process's drops at
        once): suspect it now rather than at its heartbeat deadline, and probe it (a
        stage that reconnects answers). A run asked for meanwhile waits for its name to
        be taken by a live process (a restarted stage), not planned onto the dead one."""
        membership = self.state.membership
        probe = membership.connection_lost(event.stage, now, routing_id=event.routing_id)
        member = membership.get(event.stage)
        if probe is None or member is None:
            return []
        interval = self.state.timeouts.heartbeat_interval_s
        fields = {"stage": event.stage, "reason": "connection gone", "error": str(event.error)}
        return [
            Log("warning", "stage_suspect", fields),
            Send(member.routing_id, Probe(nonce=probe.nonce), event.stage, interval),
        ]

    def _tick(self, now: float) -> list[Command]:
        run = self.run
        reply_s = self.state.timeouts.reply_s
        out = notices_due(self.notices, None if run is None else run.run, now, reply_s=reply_s)
        out += self._judge_partition(now)
        if self.partition.suspecting:
            self.state.membership.hold(now)
            return out  # cut off, most likely: nobody is declared dead meanwhile
        # (nor is a transfer given up: its chunks are held up by the same cut)
        out += expire_stalled(self.state, now)
        out += self.registrations.expired(now)
        probes, deaths = self.state.membership.tick(now)
        interval = self.state.timeouts.heartbeat_interval_s
        for probe in probes:
            member = self.state.membership.get(probe.name)
            assert member is not None
            suspect_s, probe_s = self.state.membership.deadlines(probe.name)
            out.append(
                Log(
                    "warning",
                    "stage_suspect",
                    {
                        "stage": probe.name,
                        "silent_s": round(now - member.last_seen, 2),
                        "deadline_s": round(suspect_s, 3),
                        "probe_deadline_s": round(probe_s, 3),
                    },
                )
            )
            out.append(Send(member.routing_id, Probe(nonce=probe.nonce), probe.name, interval))
        for death in deaths:
            out += self._death(death.name, death.reason, death.silent_s, now)
        return out

    def _judge_partition(self, now: float) -> list[Command]:
        """Whether this process is cut off from its stages (:mod:`~zpipe.coordinator.partition`)."""
        state = self.state
        heard = {
            m.name: m.last_seen
            for m in state.membership.live()  # unsorted: this runs on every tick
            if m.name not in state.unconfirmed  # restored from disk: never heard here
        }
        transition = self.partition.tick(heard, now)
        if transition is None or isinstance(transition, Holding):
            return []
        if isinstance(transition, Suspected):
            fields: dict[str, Any] = {
                "silent_s": round(transition.silent_s, 2),
                "members": transition.members,
                "detail": "every stage went silent at once: this coordinator is likely cut "
                "off; no stage is declared dead until one is heard again",
            }
            event = "coordinator_partitioned"
            level = "warning"
        elif isinstance(transition, Rejoined):
            for name in transition.refreshed:  # their silence was this process's
                state.membership.heard_from(name, now)
            fields = {
                "away_s": round(transition.away_s, 2),
                "refreshed": list(transition.refreshed),
            }
            event, level = "coordinator_rejoined", "info"
        else:
            assert isinstance(transition, GaveUp)
            fields = {
                "away_s": round(transition.away_s, 2),
                "detail": "no stage spoke again; judging them as usual",
            }
            event, level = "coordinator_partition_over", "warning"
        return [Log(level, event, fields), Record({"event": event, **fields})]

    def _stalled(self, message: Stalled, now: float) -> list[Command]:
        """The client's results are late: probe every stage of the run now rather than
        after their heartbeats lapse. One that answers is slow and stays; one that
        does not is declared dead after the probe intervals, as any other."""
        run = self.run
        if run is None or run.run != message.run:
            return []  # a late report of a run already over
        out: list[Command] = [
            Log(
                "warning",
                "stall_reported",
                {
                    "run": run.run,
                    "waited_s": round(float(message.waited_s), 3),
                    "deadline_s": round(float(message.deadline_s), 3),
                },
            )
        ]
        interval = self.state.timeouts.heartbeat_interval_s
        for name in run.devices:
            probe = self.state.membership.suspect(name, now)
            member = self.state.membership.get(name)
            if probe is None or member is None:
                continue
            out.append(Log("warning", "stage_suspect", {"stage": name, "reason": "stall"}))
            out.append(Send(member.routing_id, Probe(nonce=probe.nonce), name, interval))
        return out

    def _death(self, name: str, reason: str, silent_s: float, now: float) -> list[Command]:
        state = self.state
        out: list[Command] = [
            Log(
                "error",
                "stage_dead",
                {"stage": name, "reason": reason, "silent_s": round(silent_s, 2)},
            )
        ]
        state.confirm(name)
        # what it left half-sent on its bulk connection goes now (issue 33 finding 5:
        # four transfers announced at 1 GiB kept 900 MB after the stage's death)
        out += freed(state.bulk.drop_transfers(name))
        event: dict[str, Any] = {
            "event": "stage_dead",
            "stage": name,
            "reason": reason,
            "silent_s": silent_s,
        }
        error = StageLostError(name, reason)
        # requests to the dead stage (weights for a replica, say) fail now
        out.append(FailRequests(name, error))
        out += state.flows.stage_lost(name, error, now)
        run = self.run
        if run is not None and name in run.devices:
            event["run"] = run.run
            run.failed.add(name)
            out += state.current.on_event(StageDied(name, reason, silent_s), now)
        out.append(Record(event))
        out.append(Persist())
        return out

    # ------------------------------------------------------------ clients

    def _client_request(self, event: ClientRequest, now: float) -> list[Command]:
        state = self.state
        reply_s = state.timeouts.reply_s
        match event.message:
            case RunRequest() as request:
                from zpipe.coordinator.admission import admit

                return admit(state, event.routing_id, event.user_key, request, now)
            case LossyRunRequest() as request:
                from zpipe.coordinator.runs.lossy import start_lossy_run

                return start_lossy_run(state, event.routing_id, request, now)
            case GenRunRequest() as request:
                from zpipe.coordinator.runs.generation import start_generation_run
                from zpipe.coordinator.runs.generation_recovery import GenerationController

                install = GenerationController.installer(
                    state, event.routing_id, event.user_key, request
                )
                return start_generation_run(
                    state, event.routing_id, event.user_key, request, now, on_ready=install
                )
            case NoticeAck(run=run_id, seq=seq):
                # saved soon: a successor would only send it again, and the client drops it
                return [Persist(soon=True)] if self.notices.acknowledged(run_id, seq) else []
            case ClusterRequest():
                members = [m.to_dict() for m in state.membership.all()]
                reply = ClusterState(members=members)
                return [Send(event.routing_id, reply, CLIENT_NAME, reply_s)]
        message = event.message
        run_id = message.run
        current = state.current
        if current is not None and run_id == current.run.run:
            return current.on_event(event, now)
        # a request for a run that is not (or no longer) the current one
        match message:
            case RunEnd():
                report = RunReport(run=run_id, stages={})
                return [Send(event.routing_id, report, CLIENT_NAME, reply_s)]
            case Replicate(step=step):
                error = f"ConfigError: run {run_id} is not the current training run"
                replicated = Replicated(
                    run=run_id, step=step, tensor_count=0, nbytes=0, error=error
                )
                return [
                    Log("error", "replica_failed", {"run": run_id, "step": step, "error": error}),
                    Send(event.routing_id, replicated, CLIENT_NAME, reply_s),
                ]
        error_ = ConfigError(f"run {run_id} is not the current run")
        return state.flows.start(run_failed(event.routing_id, error_, reply_s), now)

    # ------------------------------------------------------------ persistence

    def saved_state(self) -> SavedState:
        """What the shell saves (see :mod:`~zpipe.coordinator.takeover`)."""
        return saved_state(self.state, self.notices)

    def restore(
        self,
        saved: SavedState | None,
        replica: SavedReplica | None,
        now: float,
        newest_global: SavedReplica | None = None,
        copies: Sequence[HeldCopy] = (),
    ) -> None:
        """Take over what a previous coordinator saved (see :func:`takeover.restore`)."""
        if saved is None and replica is None and newest_global is None and not copies:
            return  # a first start: nothing to take over, no run kinds to import for it
        from zpipe.coordinator.takeover import restore

        restore(self.state, saved, replica, now, newest_global, copies, self.notices)
