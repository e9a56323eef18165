"""An inference stream's controller: assignment, connection, recovery by re-plan, end.

    assign (epoch) ─> every stage ─> ready ─> run_ready to the client
    run_go ─> connect ─> every stage ─> connected ─> run_started
    a stage dies: re-plan the survivors (lightweight, respipe, heavy), assign and
    connect them under a new epoch, tell the client (run_replanned) to replay
    every micro-batch whose result it has not received; or, without ``recover``,
    tell it the stage failed (stage_failed)

Pure: events in, commands out (:class:`~zpipe.coordinator.runs.base.RunController`).
Inference weights come from the model spec, so recovery moves no weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zpipe._errors import InfeasiblePlanError, ZpipeError
from zpipe.coordinator.commands import (
    AwaitReplies,
    AwaitSettled,
    Command,
    Log,
    Now,
    Persist,
    PlanInference,
    Send,
)
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.decisions import live_members, replan_in_place
from zpipe.coordinator.events import Event, StageDied
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import Member
from zpipe.coordinator.planning import bucketing_of
from zpipe.coordinator.runs.base import BaseRun, recovered_after_death
from zpipe.coordinator.sink_check import check_sink_reachable
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.models import ModelSpec
from zpipe.planner import Plan
from zpipe.protocol.client_control import RunReady, RunReplanned, RunRequest
from zpipe.protocol.stage_control import Assign, AssignFailed, Ready


@dataclass(frozen=True)
class Endpoints:
    """Where the client sends inputs and whose results it accepts (``run_ready`` and
    ``run_replanned`` say so); ``first_max_message_bytes``: the first stage's data
    port limit per frame (the client refuses larger frames itself)."""

    first_endpoint: str
    first_stage: str
    first_key: str | None
    last_stage: str
    last_key: str | None
    last_endpoint: str
    first_max_message_bytes: int | None


def endpoints_of(
    plan: Plan,
    by_name: dict[str, Member],
    run: BaseRun,
    data_limits: Mapping[str, int] | None = None,
) -> Endpoints:
    """Where the client sends inputs and whose results it accepts; ``data_limits``:
    each stage's data port limit per frame, as its ``ready`` said."""
    first, last = plan.stages[0].device, plan.stages[-1].device
    return Endpoints(
        first_endpoint=by_name[first].data_endpoint,
        first_stage=first,
        first_key=run.key_of(first),
        last_stage=last,
        last_key=run.key_of(last),
        last_endpoint=by_name[last].data_endpoint,
        first_max_message_bytes=data_limits.get(first) if data_limits is not None else None,
    )


def inference_assignments(
    run: BaseRun, spec: ModelSpec, by_name: dict[str, Member], request: RunRequest
) -> list[tuple[Member, Assign]]:
    """Every stage's ``assign``: its units, its neighbours, their endpoints and keys."""
    plan = run.run.plan
    out = []
    for i, stage in enumerate(plan.stages):
        last = i == len(plan.stages) - 1
        downstream = CLIENT_NAME if last else plan.stages[i + 1].device
        endpoint = (
            request.sink_endpoint if last else by_name[plan.stages[i + 1].device].data_endpoint
        )
        upstream = CLIENT_NAME if i == 0 else plan.stages[i - 1].device
        # without keys the stage admits its upstream by this endpoint's host
        upstream_endpoint = (
            request.sink_endpoint if i == 0 else by_name[plan.stages[i - 1].device].data_endpoint
        )
        assign = Assign(
            run=run.run.run,
            model=spec.to_dict(),
            start=stage.start,
            end=stage.end,
            index=i,
            num_stages=len(plan.stages),
            upstream=upstream,
            upstream_key=run.key_of(upstream),
            upstream_endpoint=upstream_endpoint,
            downstream=downstream,
            downstream_endpoint=endpoint,
            downstream_key=run.key_of(downstream),
            dtype=request.dtype,
            epoch=run.run.epoch,
        )
        out.append((by_name[stage.device], assign))
    return out


class InferenceController(BaseRun):
    kind = "infer"

    def __init__(self, state: ControlState, run: Run, spec: ModelSpec) -> None:
        super().__init__(state, run)
        self.spec = spec
        # each stage's data port limit per frame (``ready``), for the client's check
        self.data_limits: dict[str, int] = {}

    def on_event(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, StageDied):
            run = self.run
            if run.recover and run.streaming and run.request is not None:
                flow = self.recover(event.name, now, event.silent_s)
            else:
                flow = self.notify_stage_failed(event.name, event.reason)
            return self.state.flows.start(flow, now)
        return super().on_event(event, now)

    # ------------------------------------------------------------------- flows

    def assign(self, by_name: dict[str, Member], request: RunRequest) -> Flow:
        """Send every stage of the plan its assignment; wait until all are ready."""
        run = self.run
        for member, message in inference_assignments(self, self.spec, by_name, request):
            yield Send(member.routing_id, message, member.name, stage=member.name)
        devices = tuple(s.device for s in run.plan.stages)
        replies: dict[str, Ready] = yield AwaitReplies(
            devices,
            Ready,
            self.state.timeouts.assign_s,
            "ready after assignment",
            run=run.run,
            fail=AssignFailed,
        )
        build_s = {n: round(float(replies[n].build_s), 3) for n in devices}
        self.data_limits = {
            n: limit for n in devices if (limit := replies[n].max_message_bytes) is not None
        }
        yield Log("info", "run_ready", {"run": run.run, "epoch": run.epoch, "build_s": build_s})

    def ready_message(self, by_name: dict[str, Member], baseline: Plan | None) -> RunReady:
        run = self.run
        ends = endpoints_of(run.plan, by_name, self, self.data_limits)
        return RunReady(
            run=run.run,
            plan=run.plan.to_dict(),
            baseline=baseline.to_dict() if baseline is not None else None,
            first_endpoint=ends.first_endpoint,
            first_stage=ends.first_stage,
            first_key=ends.first_key,
            last_stage=ends.last_stage,
            last_key=ends.last_key,
            last_endpoint=ends.last_endpoint,
            first_max_message_bytes=ends.first_max_message_bytes,
            epoch=run.epoch,
        )

    def recover(self, dead: str, detected_at: float, silent_s: float) -> Flow:
        """Re-plan the stream without a dead stage and tell the client to replay.

        The client resends every micro-batch whose result it has not received and
        drops results of the old epoch, so each output arrives once.
        """
        run = self.run
        request = run.request
        assert request is not None
        # saved as it is now, the dead stage included, until the new plan is connected:
        # a coordinator restarted meanwhile declares it dead again and re-plans itself
        run.begin_change()
        policy = request.recovery_policy
        batch = request.microbatch_size_or()
        dtype = request.dtype
        try:
            # a stage the client's stall report had probed is alive until its probe
            # goes unanswered: judged first, not planned out as dead (jobs.AwaitSettled)
            yield AwaitSettled(tuple(d for d in run.devices if d not in run.failed))
            names = request.stage_names
            survivors = sorted(
                (
                    m
                    for m in live_members(self.state.membership)
                    if m.name not in run.failed and (names is None or m.name in names)
                ),
                key=lambda m: m.name,
            )
            if not survivors:
                raise InfeasiblePlanError("no stage is left to run the model")
            if policy == "heavy":
                # The old partition named the dead stage: plan the survivors afresh.
                plan, _ = yield PlanInference(
                    self.spec,
                    run.plan.num_units,
                    tuple(survivors),
                    algo=request.planner_name,
                    partition=None,
                    batch_size=batch,
                    dtype=dtype,
                    profile=request.profile,
                    bucketing=bucketing_of(request.bucketing_mode),
                )
            else:
                profiles = {
                    m.name: self.state.profiles.get(self.spec, batch, dtype, m, train=False)
                    for m in survivors
                }
                plan = replan_in_place(
                    run.plan,
                    run.failed,
                    policy,
                    survivors,
                    profiles,
                    batch_size=batch,
                    train=False,
                    links=self.state.measured_links(survivors),
                    margin=self.state.memory_margin,
                )
            by_name = {m.name: m for m in survivors}
            # A new last stage on another host could never reach a loopback sink: the
            # run fails saying so, rather than the client waiting for lost results.
            last = by_name[plan.stages[-1].device]
            check_sink_reachable(
                request.sink_endpoint,
                {last.name: last.data_endpoint},
                self.state.local_hosts,
            )
            planned_at = yield Now()
            # the new epoch is saved before any stage hears it: a successor never gives it
            run.epoch = self.state.next_epoch()
            yield Persist()
            run.plan = plan
            run.devices = list(plan.devices)
            yield from self.assign(by_name, request)
            yield from self.connect_all()
            run.settle()
            yield Persist()
        except (ZpipeError, ValueError) as exc:
            yield Log(
                "error", "recovery_failed", {"run": run.run, "stage": dead, "error": str(exc)}
            )
            yield from self.notify_stage_failed(dead, f"died, and recovery failed: {exc}")
            return
        now = yield Now()
        times, commands = recovered_after_death(
            run, dead, policy, plan, detected_at=detected_at, silent_s=silent_s,
            planned_at=planned_at, now=now,
        )  # fmt: skip
        # one at a time, as a flow's driver sends each command's result back
        for command in commands:  # noqa: UP028
            yield command
        ends = endpoints_of(plan, by_name, self, self.data_limits)
        notice = RunReplanned(
            run=run.run,
            plan=plan.to_dict(),
            dead=dead,
            detected_s=times["detected_s"],
            recovered_s=times["recovered_s"],
            first_endpoint=ends.first_endpoint,
            first_stage=ends.first_stage,
            first_key=ends.first_key,
            last_stage=ends.last_stage,
            last_key=ends.last_key,
            last_endpoint=ends.last_endpoint,
            first_max_message_bytes=ends.first_max_message_bytes,
            clock=now,
            epoch=run.epoch,
        )
        yield Send(run.client, notice, CLIENT_NAME, self.reply_s)
