"""The coordinator's core: membership, registration, liveness, and routing to runs. Pure.

It takes every event (:mod:`zpipe.coordinator.events`) with the time and returns
commands (:mod:`zpipe.coordinator.commands`); the shell
(:mod:`zpipe.coordinator.server`) carries them out. Decisions of a run are its
controller's (:mod:`~zpipe.coordinator.inference`, :mod:`~zpipe.coordinator.training`),
the start of one :mod:`~zpipe.coordinator.starting`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from zpipe._errors import (
    ConfigError,
    PeerGoneError,
    ProtocolError,
    StageLostError,
    StateFileError,
    TransportTimeout,
)
from zpipe.coordinator.bulk import bulk_chunk, bulk_open, retie_restored
from zpipe.coordinator.commands import Command, Deliver, FailRequests, Log, Persist, Record, Send
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
from zpipe.coordinator.inference import InferenceController
from zpipe.coordinator.lossy_remap import keep_replica
from zpipe.coordinator.lossy_run import start_lossy_run
from zpipe.coordinator.membership import Member, MemberState
from zpipe.coordinator.name_claims import Claim, NameClaims
from zpipe.coordinator.notices import NoticeOutbox, notices_due, number_notices
from zpipe.coordinator.partition import GaveUp, Holding, PartitionWatch, Rejoined, Suspected
from zpipe.coordinator.records import SavedMember, SavedReplica, SavedState
from zpipe.coordinator.restored_replica import replica_from_saved
from zpipe.coordinator.runbase import run_failed
from zpipe.coordinator.runs import Run
from zpipe.coordinator.starting import run_request
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.coordinator.training import SyncTrainingController
from zpipe.models import ModelSpec
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
from zpipe.protocol.lossy import (
    LossyHold,
    LossyProbeReport,
    LossyReady,
    LossyReplica,
    LossyResult,
    LossyRunRequest,
)
from zpipe.protocol.repartition import RepartitionReply
from zpipe.protocol.stage_control import (
    AssignFailed,
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
    Refused,
    RegisterAgain,
    Registered,
    Weights,
)

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


def printable(routing_id: bytes) -> str:
    try:
        return routing_id.decode("ascii")
    except UnicodeDecodeError:
        return routing_id.hex()


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
        # registrations under a name a live stage holds, until the holder answers or not
        self.claims = NameClaims()

    @property
    def run(self) -> Run | None:
        current = self.state.current
        return None if current is None else current.run

    def on_event(self, event: Event, now: float) -> list[Command]:
        return number_notices(self.notices, self._on_event(event, now), now)

    def _on_event(self, event: Event, now: float) -> list[Command]:
        flows = self.state.flows
        if isinstance(event, StageSpoke):
            return [*retie_restored(self.state, event), *self._stage_spoke(event, now)]
        if isinstance(event, RegisterAsked):
            return self._register(event, now)
        if isinstance(event, BulkChunkArrived):
            out, whole = bulk_chunk(self.state, event, now)
            return out if whole is None else [*out, *self._stage_spoke(whole, now)]
        if isinstance(event, BulkOpenAsked):
            return bulk_open(self.state, event, now)
        if isinstance(event, ClientRequest):
            return self._client_request(event, now)
        if isinstance(event, StallReported):
            return self._stalled(event.message, now)
        if isinstance(event, Tick):
            return self._tick(now)
        if isinstance(event, TimerFired):
            return flows.timer(event.tag, now)
        if isinstance(event, JobDone):
            return flows.job_done(event.tag, event.result, now)
        if isinstance(event, JobFailed):
            return flows.job_failed(event.tag, event.error, now)
        if isinstance(event, RequestFailed):
            if isinstance(event.error, PeerGoneError):  # not connected now: may come back
                out = flows.request_unsent(event.stage, event.error, now)
            else:
                out = flows.stage_lost(event.stage, event.error, now)
            return [*out, *self._holder_unreachable(event, now)]
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
        membership.heard_from(member.name, now, metrics_of(message), kind=kind)
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
                claim = self.claims.answered(member.name, nonce)
                if claim is not None:
                    return self._refuse_claim(claim, member)
                return [Log("info", "stage_answered_probe", {"stage": member.name})]
            case LossyReplica():
                # the lossy flows read it in its wire form (until they take classes)
                return keep_replica(self.state, member.name, message.to_message())
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

    def _register(self, event: RegisterAsked, now: float) -> list[Command]:
        state = self.state
        name = event.message.name
        reply_s = state.timeouts.reply_s
        if state.public_keys:
            expected = state.public_keys.get(name)
            if expected is None or event.user_key is None or expected.decode() != event.user_key:
                refused = Refused(reason=f"the key this stage uses is not {name}.key")
                return [
                    Log(
                        "warning",
                        "registration_refused",
                        {"stage": name, "reason": "key does not match name"},
                    ),
                    Send(event.routing_id, refused, name, reply_s),
                ]
        previous = state.membership.get(name)
        if (
            previous is not None
            and previous.state is not MemberState.DEAD
            and previous.routing_id != event.routing_id
            and now - previous.last_seen < state.membership.suspect_after_s
        ):
            return self._claim(previous, event, now)
        return self._admit(event, now)

    # -- a name a live stage holds (see zpipe.coordinator.name_claims) --

    def _claim(self, holder: Member, event: RegisterAsked, now: float) -> list[Command]:
        """Another process registers under ``holder``'s name: ask the holder first."""
        # as long as the liveness rules would take to find the holder dead: a loaded
        # holder that answers late is not taken over sooner than it would be declared dead
        membership = self.state.membership
        window = membership.suspect_after_s + membership.probe_timeout_s
        claim = self.claims.open(holder.name, event, now, window)
        if claim is None:
            return []  # the newcomer repeated its registration; the probe is out
        probe = Probe(nonce=claim.nonce)
        return [
            Log(
                "info",
                "stage_name_claimed",
                {"stage": holder.name, "newcomer": printable(event.routing_id)},
            ),
            # stage=: a holder whose connection is gone fails this send at once
            Send(holder.routing_id, probe, holder.name, window, stage=holder.name),
        ]

    def _refuse_claim(self, claim: Claim, holder: Member) -> list[Command]:
        reason = (
            f"the name {claim.name!r} is taken: a stage registered under it (data endpoint "
            f"{holder.data_endpoint}) is alive and answering; start this one with another "
            "--name, or stop that one first"
        )
        refused = Refused(reason=reason)
        return [
            Log(
                "warning",
                "registration_refused",
                {
                    "stage": claim.name,
                    "newcomer": printable(claim.registration.routing_id),
                    "reason": "name taken by a live stage",
                    "holder_endpoint": holder.data_endpoint,
                },
            ),
            Send(claim.registration.routing_id, refused, claim.name, self.state.timeouts.reply_s),
        ]

    def _take_over(self, claim: Claim, why: str, now: float) -> list[Command]:
        """The holder is gone or frozen: it is dead, and the newcomer registers."""
        holder = self.state.membership.get(claim.name)
        if holder is None or holder.state is MemberState.DEAD:
            return self._admit(claim.registration, now)  # declared dead meanwhile
        out: list[Command] = [
            Log("warning", "stage_name_taken_over", {"stage": claim.name, "why": why})
        ]
        death = self.state.membership.declare_dead(
            claim.name, f"a new process registered under its name ({why})", now
        )
        if death is not None:
            out += self._death(death.name, death.reason, death.silent_s, now)
        return out + self._admit(claim.registration, now)

    def _holder_unreachable(self, event: RequestFailed, now: float) -> list[Command]:
        if event.stage not in self.claims or not isinstance(event.error, TransportTimeout):
            return []
        claim = self.claims.holder_gone(event.stage)
        assert claim is not None
        return self._take_over(claim, "its connection is gone", now)

    def _admit(self, event: RegisterAsked, now: float) -> list[Command]:
        message, state = event.message, self.state
        name = message.name
        # a claim on the name, should one be pending, is settled by this registration
        self.claims.holder_gone(name)
        reply_s = state.timeouts.reply_s
        out: list[Command] = []
        previous = state.membership.get(name)
        run = self.run
        data_endpoint = message.data_endpoint
        if (
            previous is not None
            and previous.state is not MemberState.DEAD
            and run is not None
            and name in run.devices
            and name not in run.failed
            and previous.data_endpoint != data_endpoint
        ):
            # A new process under the name of one of the run's stages: the one that
            # ran the run is gone (restarted), so the run has lost it.
            death = state.membership.declare_dead(name, "the stage restarted", now)
            if death is not None:
                out += self._death(death.name, death.reason, death.silent_s, now)
        try:
            member = state.membership.register(
                name=name,
                routing_id=event.routing_id,
                data_endpoint=data_endpoint,
                info=dict(message.info),
                public_key=state.key_of(name),
                now=now,
            )
        except ConfigError as exc:
            return [
                *out,
                Log("warning", "registration_refused", {"stage": name, "reason": str(exc)}),
                Send(event.routing_id, Refused(reason=str(exc)), name, reply_s),
            ]
        state.confirm(name)
        token = event.bulk_token
        registered = Registered(
            name=name,
            heartbeat_interval=state.timeouts.heartbeat_interval_s,
            bulk_token=state.bulk.issue(name, token, event.routing_id) if token else None,
            clock=now,  # this coordinator stamps heartbeat acks
        )
        return [
            *out,
            Log(
                "info",
                "stage_registered",
                {"stage": name, "data_endpoint": member.data_endpoint, "info": member.info},
            ),
            Persist(),
            Send(event.routing_id, registered, name, reply_s),
        ]

    def _tick(self, now: float) -> list[Command]:
        run = self.run
        reply_s = self.state.timeouts.reply_s
        out = notices_due(self.notices, None if run is None else run.run, now, reply_s=reply_s)
        out += self._judge_partition(now)
        if self.partition.suspecting:
            self.state.membership.hold(now)
            return out  # cut off, most likely: nobody is declared dead meanwhile
        for claim in self.claims.expired(now):
            out += self._take_over(claim, "it did not answer a probe", now)
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
                flow = run_request(state, event.routing_id, event.user_key, request)
                return state.flows.start(flow, now)
            case LossyRunRequest() as request:
                # the lossy flows read it in its wire form (until they take classes)
                return start_lossy_run(state, event.routing_id, request.to_message(), now)
            case NoticeAck(run=run_id, seq=seq):
                self.notices.acknowledged(run_id, seq)
                return []
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
        members = tuple(
            SavedMember(m.name, m.routing_id, m.data_endpoint, m.info, m.public_key)
            for m in self.state.membership.alive()
        )
        run = self.run
        return SavedState(
            self.state.epoch,
            self.state.run_counter,
            members,
            None if run is None else run.to_saved(),
        )

    def restore(
        self,
        saved: SavedState | None,
        replica: SavedReplica | None,
        now: float,
        newest_global: SavedReplica | None = None,
    ) -> None:
        """Take over the members, the run and the replica a previous coordinator saved
        (with ``newest_global`` behind it as its fallback: restored_replica.py).

        Restored members count as alive from now: one that does not speak within the
        usual suspect and probe intervals is declared dead as any other would be.
        """
        state = self.state
        if saved is not None:
            state.epoch = max(state.epoch, saved.epoch)
            state.run_counter = max(state.run_counter, saved.run_counter)
            for m in saved.members:
                state.membership.register(
                    name=m.name,
                    routing_id=m.routing_id,
                    data_endpoint=m.data_endpoint,
                    info=m.info,
                    public_key=m.public_key,
                    now=now,
                )
                state.unconfirmed.add(m.name)
            if saved.run is not None:
                try:
                    state.current = controller_for(state, Run.from_saved(saved.run))
                except (KeyError, TypeError, ValueError, ProtocolError) as exc:
                    raise StateFileError(f"the saved run does not parse: {exc!r}") from exc
        if replica is not None:
            state.replica = replica_from_saved(replica, newest_global)
            if isinstance(state.current, SyncTrainingController):
                state.current.fallback = state.replica.newest_global()


def controller_for(state: ControlState, run: Run) -> Any:
    """The controller of a run restored from disk, by its kind."""
    if run.training_plan is not None or run.groups:
        return SyncTrainingController(state, run)
    assert run.request is not None
    return InferenceController(state, run, ModelSpec.from_dict(run.request.model))
