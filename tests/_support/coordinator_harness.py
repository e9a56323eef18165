"""An in-process driver for the coordinator's pure core: events in, commands recorded.

No sockets, no processes, no clock: the test sets the time, feeds events and
reads the commands. Jobs (the shell's gathers and planning) are carried out at
once with pure stand-ins, and their results fed back as the shell would.
"""

from __future__ import annotations

from typing import Any

from zpipe._errors import ConfigError
from zpipe.config import Timeouts
from zpipe.coordinator.commands import (
    AllowPeers,
    AwaitConfirmed,
    AwaitSettled,
    AwaitStages,
    Command,
    CountUnits,
    Log,
    PlanInference,
    ReachClient,
    Record,
    RunJob,
    SaveReplica,
    Send,
    StartTimer,
    TrainingModel,
)
from zpipe.coordinator.core import CoordinatorCore
from zpipe.coordinator.decisions import pick_stages
from zpipe.coordinator.events import (
    ClientRequest,
    Event,
    JobDone,
    JobFailed,
    RegisterAsked,
    StageSpoke,
    Tick,
    TimerFired,
)
from zpipe.coordinator.membership import Membership, MemberState
from zpipe.coordinator.planning import choose_plan, cluster_from_members
from zpipe.coordinator.state import ControlState
from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.protocol import REGISTRY, WireMessage
from zpipe.protocol.stage_control import Register
from zpipe.transport.codec import Message

CLIENT = b"client-route"
SPEC = ModelSpec("mlp", {"dims": [8, 16, 16, 16, 16, 16, 4]}, seed=0)  # 6 units


def typed(kind: str, body: dict[str, Any], *, sender: str | None = None) -> WireMessage:
    """The protocol object a peer sends (as the shell parses it); the fields a test
    leaves out that every stage sends (its name, empty counters, no error) filled in."""
    schema = REGISTRY.schemas[kind]
    full = dict(body)
    if sender is not None and "name" in schema and "name" not in full:
        full["name"] = sender
    for key, empty in (("metrics", {}), ("error", "")):
        if key in schema and schema[key].required and key not in full:
            full[key] = empty
    return REGISTRY.parse(Message(kind, full))


def parsed(message: Message) -> WireMessage:
    """A built message as the shell hands it on: parsed into its protocol class."""
    return REGISTRY.parse(message)


class Harness:
    def __init__(
        self,
        *,
        interval: float = 1.0,
        suspect_after: int = 3,
        probes: int = 2,
        ack_notices: bool = True,
    ) -> None:
        timeouts = Timeouts(
            heartbeat_interval_s=interval,
            suspect_after_intervals=suspect_after,
            probe_intervals=probes,
        )
        membership = Membership(
            heartbeat_interval_s=interval,
            suspect_after_intervals=suspect_after,
            probe_intervals=probes,
        )
        self.state = ControlState(timeouts=timeouts, membership=membership)
        self.core = CoordinatorCore(self.state)
        self.now = 0.0
        self.sent: list[Send] = []
        self.logs: list[Log] = []
        self.records: list[dict[str, Any]] = []
        self.timers: dict[int, float] = {}
        self.jobs: list[Any] = []
        # clients whose connection dropped: a ReachClient to one of them fails
        self.gone: set[bytes] = set()
        # the client acknowledges every numbered notice at once, as a connected one does
        self.ack_notices = ack_notices
        # stages that answer no probe while a job waits for suspects to settle
        self.silent: set[str] = set()

    # ------------------------------------------------------------------ feeding

    def feed(self, event: Event) -> list[Command]:
        commands = self.core.on_event(event, self.now)
        self._apply(commands)
        return commands

    def _apply(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Send):
                self.sent.append(command)
                seq = command.wire.body.get("seq")
                if self.ack_notices and command.to == CLIENT and seq is not None:
                    self.client("notice_ack", run=command.wire.body["run"], seq=seq)
            elif isinstance(command, Log):
                self.logs.append(command)
            elif isinstance(command, Record):
                self.records.append(dict(command.event))
            elif isinstance(command, StartTimer):
                self.timers[command.tag] = self.now + command.delay_s
            elif isinstance(command, RunJob):
                self.jobs.append(command.job)
                try:
                    result = self._job(command.job)
                except Exception as exc:
                    self.feed(JobFailed(command.tag, exc))
                else:
                    self.feed(JobDone(command.tag, result))

    def _job(self, job: Any) -> Any:
        if isinstance(job, AwaitStages):
            chosen = pick_stages(self.state.membership, job.names, job.count)
            if isinstance(chosen, str):
                raise ConfigError(f"{chosen} after waiting {job.wait_s} s")
            return chosen
        if isinstance(job, CountUnits):
            return load_layer_sequence(job.spec).num_units
        if isinstance(job, ReachClient):
            if job.to in self.gone:
                return False
            self.sent.append(Send(job.to, job.message, "client", job.timeout_s))
            return True
        if isinstance(job, (AwaitConfirmed, AllowPeers, SaveReplica)):
            return None
        if isinstance(job, AwaitSettled):
            # while the shell waits, each suspect among them answers its probe (a
            # ``silent`` one stays suspect: the wait ended by its deadline)
            for name in job.names:
                member = self.state.membership.get(name)
                if member is not None and member.state is MemberState.SUSPECT:
                    if name not in self.silent:
                        self.stage(name, "probe_ack", nonce=member.probe_nonce)
            return None
        if isinstance(job, PlanInference):
            return choose_plan(
                algo=job.algo,
                num_units=job.num_units,
                names=[m.name for m in job.members],
                partition=job.partition,
                profile=None,
                cluster=None,
                batch_size=job.batch_size,
            )
        if isinstance(job, TrainingModel):
            # the profiles a test put in the cache, links as the stages declared them
            members = list(job.members)
            profiles = {}
            for m in members:
                found = self.state.profiles.get(
                    job.spec, job.microbatch_size, "float32", m, train=True
                )
                assert found is not None, f"no cached training profile of {m.name}"
                profiles[m.name] = found
            return profiles[members[0].name], cluster_from_members(members, profiles)
        raise AssertionError(f"no stand-in for {job!r}")

    def advance(self, seconds: float, *, alive: tuple[str, ...] = (), answer: bool = True) -> None:
        """Let time pass in ticks of a quarter interval; ``alive`` stages heartbeat each
        interval and (with ``answer``) answer every probe at once."""
        step = self.state.timeouts.heartbeat_interval_s / 4
        end = self.now + seconds
        ticks = 0
        while self.now < end - 1e-9:
            self.now += step
            ticks += 1
            for tag, due in sorted(self.timers.items()):
                if due <= self.now:
                    del self.timers[tag]
                    self.feed(TimerFired(tag))
            if ticks % 4 == 0:
                for name in alive:
                    self.stage(name, "heartbeat")
            before = len(self.sent)
            self.feed(Tick())
            if answer:
                for send in self.sent[before:]:
                    if send.wire.kind == "probe" and send.peer in alive:
                        self.stage(send.peer, "probe_ack", nonce=send.wire.body["nonce"])

    # ------------------------------------------------------------------ peers

    def register(
        self, name: str, endpoint: str | None = None, info: dict[str, Any] | None = None
    ) -> None:
        register = Register(
            name=name,
            data_endpoint=endpoint or f"tcp://{name}:1",
            info={"probe_endpoint": f"tcp://{name}:2", **(info or {})},
        )
        self.feed(RegisterAsked(name.encode(), None, register))

    def stage(self, name: str, kind: str, **body: Any) -> list[Command]:
        return self.feed(StageSpoke(name.encode(), typed(kind, body, sender=name)))

    def client(self, kind: str, **body: Any) -> list[Command]:
        return self.feed(ClientRequest(CLIENT, None, typed(kind, body)))  # type: ignore[arg-type]

    def to(self, peer: str, kind: str) -> list[Message]:
        """What went to ``peer`` of ``kind``, in its wire form."""
        return [s.wire for s in self.sent if s.peer == peer and s.wire.kind == kind]

    def to_client(self, kind: str) -> list[Message]:
        return [s.wire for s in self.sent if s.to == CLIENT and s.wire.kind == kind]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [dict(log.fields) for log in self.logs if log.event == name]

    # ------------------------------------------------------------------ runs

    def answer_all(self, kind: str, names: list[str], **body: Any) -> None:
        for name in names:
            self.stage(name, kind, **body)

    def start_stream(self, names: list[str], **request: Any) -> int:
        """Register ``names``, start an inference stream over them, connect it."""
        for name in names:
            if self.state.membership.get(name) is None:
                self.register(name)
        body = {
            "model": SPEC.to_dict(),
            "dtype": "float32",
            "sink_endpoint": "tcp://client:9",
            "wait_for_stages_s": 0.0,
            "planner": "even",
            "stage_names": names,
            **request,
        }
        self.client("run_request", **body)
        run = self.core.run
        assert run is not None
        self.answer_all("ready", list(run.devices), run=run.run, build_s=0.01)
        assert self.to_client("run_ready"), self.events("run_failed")
        self.client("run_go", run=run.run)
        self.answer_all("connected", list(run.devices), run=run.run)
        assert self.to_client("run_started")
        return run.run


def _feed_message(self: Harness, name: str, message: Message) -> list[Command]:
    return self.feed(StageSpoke(name.encode(), parsed(message)))


Harness.feed_message = _feed_message  # type: ignore[attr-defined]
