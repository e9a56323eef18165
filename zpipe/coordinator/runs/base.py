"""What every run kind does alike: connect, end, report a failure; the controller interface.

A run's controller is pure: it takes events with the time and returns commands
(:mod:`zpipe.coordinator.commands`); its multi-step conversations are flows
(:mod:`zpipe.coordinator.flows`). The next run kinds (asynchronous training,
federated groups, lossy layers) are new modules with a class like these.
"""

from __future__ import annotations

from typing import Any, Protocol

from zpipe._errors import ConfigError, StageLostError, ZpipeError
from zpipe.coordinator.commands import AwaitReplies, Command, Log, Persist, Record, Send
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.events import ClientRequest, Event
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import MemberState
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.protocol.client_control import (
    RunEnd,
    RunFailed,
    RunGo,
    RunReport,
    RunStarted,
    StageFailed,
)
from zpipe.protocol.stage_control import AssignFailed, Connect, Connected, Metrics, MetricsRequest
from zpipe.recovery import RecoveryTimeline


class RunController(Protocol):
    """One run of one kind: the core routes the run's events here."""

    kind: str
    run: Run

    def on_event(self, event: Event, now: float) -> list[Command]: ...


def run_failed(routing_id: bytes, error: Exception, timeout_s: float) -> Flow:
    yield Log("error", "run_failed", {"error": str(error)})
    yield Send(routing_id, RunFailed(error=str(error)), CLIENT_NAME, timeout_s)


def stage_metrics(
    state: ControlState,
    devices: list[str],
    run: int,
    epoch: int,
    *,
    timeline: bool = False,
) -> Flow:
    """Every live stage's counters at a run's end (``{"error": "no metrics"}`` for one
    that does not answer), and with ``timeline`` each one's timeline: returns
    ``(stages, timelines)`` by stage name, what a ``run_report`` carries."""
    stages: dict[str, Any] = {}
    timelines: dict[str, Any] = {}
    asked = []
    request = MetricsRequest(run=run, timeline=True if timeline else None, epoch=epoch)
    for device in devices:
        member = state.membership.get(device)
        if member is None:
            continue
        yield Send(member.routing_id, request, device, stage=device)
        asked.append(device)
    replies: dict[str, Metrics] = yield AwaitReplies(
        tuple(asked), Metrics, state.timeouts.reply_s, "metrics", run=run, partial=True
    )
    for device in asked:
        reply = replies.get(device)
        stages[device] = {"error": "no metrics"} if reply is None else dict(reply.metrics)
        if reply is not None and isinstance(reply.timeline, dict):
            timelines[device] = reply.timeline
    return stages, timelines


def recovered_after_death(
    run: Run,
    dead: str,
    policy: str,
    plan: Any,
    *,
    detected_at: float,
    silent_s: float,
    planned_at: float,
    now: float,
) -> tuple[dict[str, float], list[Command]]:
    """A run that re-planned around ``dead``: its recovery's times (detection,
    re-plan, recovery, from :class:`RecoveryTimeline`) and the log line and record
    that say so, the same for every run kind."""
    timeline = RecoveryTimeline(
        run=str(run.run),
        cause="failure",
        devices=(dead,),
        policy=policy,
        epoch=run.epoch,
        failed_at=detected_at - silent_s,
        detected_at=detected_at,
        replanned_at=planned_at,
        first_step_at=now,
    )
    spans = timeline.summary()
    times = {
        "detected_s": round(spans["detection_s"], 3),
        "replanned_s": round(spans["replan_s"], 3),
        "recovered_s": round(spans["recovery_s"], 3),
    }
    fields = {"run": run.run, "epoch": run.epoch, "dead": dead, "policy": policy}
    commands: list[Command] = [
        Log("info", "run_recovered", {**fields, "plan": plan.to_dict(), **times}),
        Record({"event": "run_recovered", "run": run.run, "dead": dead, "policy": policy, **times}),
    ]
    return times, commands


class BaseRun:
    """The parts of a run's control every kind shares (start, connect, end)."""

    kind = "base"

    def __init__(self, state: ControlState, run: Run) -> None:
        self.state = state
        self.run = run

    @property
    def reply_s(self) -> float:
        return self.state.timeouts.reply_s

    def key_of(self, name: str) -> str | None:
        return self.state.key_of(name, self.run.client_key)

    def ring_of(self, device: str) -> dict[str, Any] | None:
        """A data-parallel group's all-reduce ring, for the kinds that have them."""
        return None

    def on_event(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, ClientRequest):
            return self.on_request(event, now)
        return []

    def on_request(self, event: ClientRequest, now: float) -> list[Command]:
        match event.message:
            case RunGo() as go:
                run = self.run
                if run.streaming and go.run == run.run and self.state.current is self:
                    # answered before, the answer lost with a connection (the client
                    # sends it again when it reconnects): the stages are connected
                    started = RunStarted(run=run.run, epoch=run.epoch)
                    return [
                        Log("info", "run_go_repeated", {"run": run.run}),
                        Send(event.routing_id, started, CLIENT_NAME, self.reply_s),
                    ]
                # a copy sent while the first is being answered shares its answer
                return self.state.answers.answer(
                    self.state.flows,
                    ("run_go", go.run, 0),
                    event.routing_id,
                    lambda: self.go(go),
                    peer=CLIENT_NAME,
                    timeout_s=self.reply_s,
                    now=now,
                )
            case RunEnd(run=run_id, timeline=timeline):
                return self.state.answers.answer(
                    self.state.flows,
                    ("run_end", run_id, 0),
                    event.routing_id,
                    lambda: self.end(run_id, timeline=bool(timeline)),
                    peer=CLIENT_NAME,
                    timeout_s=self.reply_s,
                    now=now,
                )
        kind = event.message.KIND
        return [
            Log("warning", "dropped_message", {"kind": kind, "error": f"not for a {self.kind} run"})
        ]

    # ------------------------------------------------------------------- flows

    def go(self, message: RunGo) -> Flow:
        """The client allows the last stage and is connected: stages connect downstream.
        Returns the answer (``run_started`` or ``run_failed``)."""
        run = self.run
        try:
            if run.run != message.run or self.state.current is not self:
                raise ConfigError(f"run {message.run} is not the current run")
            yield from self.connect_all()
        except (ZpipeError, ValueError) as exc:
            yield Log("error", "run_failed", {"error": str(exc)})
            return RunFailed(error=str(exc))
        run.streaming = True
        yield Log("info", "run_streaming", {"run": run.run, "epoch": run.epoch})
        yield Persist()
        return RunStarted(run=run.run, epoch=run.epoch)

    def connect_all(self) -> Flow:
        """Second phase: every stage connects to its neighbours, now that all allow theirs."""
        run = self.run
        for device in run.devices:
            member = self.state.membership.get(device)
            if member is None or member.state is MemberState.DEAD:
                raise StageLostError(device, "it is gone")
            connect = Connect(run=run.run, ring=self.ring_of(device), epoch=run.epoch)
            yield Send(member.routing_id, connect, device, stage=device)
        yield AwaitReplies(
            tuple(run.devices),
            Connected,
            self.reply_s,
            "connected",
            run=run.run,
            fail=AssignFailed,
        )

    def end(self, run_id: int, *, timeline: bool = False) -> Flow:
        """Every live stage's metrics (or ``no metrics``), then the run is over; with
        ``timeline``, each stage's timeline too (the client writes a trace)."""
        run = self.run
        stages: dict[str, Any] = {}
        timelines: dict[str, Any] = {}
        if run.run == run_id and self.state.current is self:
            devices = [d for d in run.devices if d not in run.failed]
            stages, timelines = yield from stage_metrics(
                self.state, devices, run.run, run.epoch, timeline=timeline
            )
            if self.state.current is self:
                self.state.current = None
            yield Persist()
        return RunReport(run=run_id, stages=stages, timelines=timelines if timeline else None)

    def notify_stage_failed(self, name: str, reason: str) -> Flow:
        run = self.run
        failed = StageFailed(run=run.run, stage=name, reason=reason, epoch=run.epoch)
        yield Send(run.client, failed, CLIENT_NAME, self.reply_s)
