"""A generation run after its set-up: recovery when a stage dies, and its end.

    gen_run_ready ─> the run is the current one (this controller)
    a stage dies ─> re-plan over the survivors (zpipe.recovery.generation: the
    survivors in their order, the units split within each one's memory room by the
    start's planner, or cut evenly when none reported a budget) ─> gen_setup to
    each survivor under a new epoch (each loads the units it now holds, from the
    model's spec, as at start) ─> every gen_ready ─> run_replanned to the client
    another stage dies meanwhile ─> re-plan again without it
    recovery fails (no survivor, no split that fits the survivors' memory: before
    any gen_setup; a refusal, a stage that does not answer) ─> stage_failed to the
    client
    run_end (the client closed the run) ─> the run is over

The coordinator keeps nothing of the sequences: the client does. On
``run_replanned`` it sends every sequence that has not finished to the new first
stage again, with the tokens it already received (``gen_submit`` with a second
tensor); that stage's scheduler prefills prompt + generated tokens, which rebuilds
every stage's KV cache, and the stream goes on at the next index, so no token
streams twice or goes missing, and greedy output equals an uninterrupted run's.
That holds whichever stage died, the first one (which streamed to the client)
included. Every survivor is set up afresh, not only those that gain units: the
stages before the moved blocks must compute the activations those blocks prefill
from anyway.

Pure: events in, commands out (:class:`~zpipe.coordinator.runs.base.RunController`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from zpipe._errors import PipelineError, StageLostError, ZpipeError
from zpipe.coordinator.commands import AwaitReplies, Command, Log, Now, Persist, Send
from zpipe.coordinator.current_run import Run
from zpipe.coordinator.events import Event, StageDied
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.generation_plan import stage_budget_mb
from zpipe.coordinator.membership import Member, MemberState
from zpipe.coordinator.runs.base import BaseRun, recovered_after_death
from zpipe.coordinator.runs.generation import (
    GenerationLimits,
    capacity_bounds,
    generation_setups,
    kv_budget_tokens,
)
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.models import ModelSpec
from zpipe.models.causal_lm import read_causal_lm_config
from zpipe.planner import Plan
from zpipe.planner.plan import StagePlan
from zpipe.protocol.client_control import RunReplanned, RunReport
from zpipe.protocol.generation import GenReady, GenRunReady, GenRunRequest
from zpipe.recovery.generation import GENERATION_ALGO, replan_generation

POLICY = "generation"  # what a recovery's log and record say repaired it


class GenerationController(BaseRun):
    """A set-up generation run: re-planned when one of its stages dies."""

    kind = "generate"

    def __init__(self, state: ControlState, run: Run, request: GenRunRequest) -> None:
        super().__init__(state, run)
        self.request = request
        self.spec = ModelSpec.from_dict(request.model)
        self.config = read_causal_lm_config(self.spec.config)
        self.limits = GenerationLimits.of(request, self.config)
        self.recovering = False
        # stages that died while a recovery was under way: it plans again without them
        self.lost: set[str] = set()
        self.recoveries = 0

    @classmethod
    def installer(
        cls, state: ControlState, routing_id: bytes, client_key: str | None, request: GenRunRequest
    ) -> Callable[[GenRunReady], None]:
        """What the set-up calls once every stage is built: this run becomes the
        current one, so that a stage's death reaches it."""

        def install(ready: GenRunReady) -> None:
            stages = tuple(
                StagePlan(str(name), int(bounds[0]), int(bounds[1]))
                for name, bounds in zip(ready.stages, ready.bounds, strict=True)
            )
            plan = Plan(algo=GENERATION_ALGO, num_units=stages[-1].end, stages=stages)
            run = Run(
                run=ready.run,
                epoch=ready.epoch,
                client=routing_id,
                plan=plan,
                client_key=client_key,
                streaming=True,
            )
            state.current = cls(state, run, request)

        return install

    def on_event(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, StageDied):
            if self.recovering:
                # the recovery under way plans again without it (see recover)
                self.lost.add(event.name)
                return [Log("warning", "generation_stage_lost_in_recovery", {"stage": event.name})]
            return self.state.flows.start(self.recover(event.name, now, event.silent_s), now)
        return super().on_event(event, now)

    def end(self, run_id: int, *, timeline: bool = False) -> Flow:
        """The client closed the run (its stages freed their caches on the data path):
        a later death concerns no run. No metrics: a generation stage reports none."""
        if self.run.run == run_id and self.state.current is self:
            self.state.current = None
            yield Log("info", "generation_ended", {"run": run_id, "recoveries": self.recoveries})
            yield Persist()
        return RunReport(run=run_id, stages={})

    # ------------------------------------------------------------------- recovery

    def _gone(self, name: str) -> bool:
        member = self.state.membership.get(name)
        return (
            name in self.run.failed
            or name in self.lost
            or member is None
            or member.state is MemberState.DEAD
        )

    def recover(self, dead: str, detected_at: float, silent_s: float) -> Flow:
        """Re-plan the run without ``dead`` (and any stage that dies meanwhile), set the
        survivors up under a new epoch, and tell the client where to go on."""
        run = self.run
        self.recovering = True
        self.lost = set()
        try:
            while True:
                failed = {d for d in run.plan.devices if self._gone(d)}
                plan = replan_generation(run.plan, failed, self._fitting_split)
                planned_at = yield Now()
                ready = yield from self._set_up(plan)
                if ready:
                    break
                # a survivor died while being set up: plan again without it
        except (ZpipeError, ValueError) as exc:
            self.recovering = False
            yield Log(
                "error", "recovery_failed", {"run": run.run, "stage": dead, "error": str(exc)}
            )
            yield from self.notify_stage_failed(dead, f"died, and recovery failed: {exc}")
            return
        self.recovering = False
        self.recoveries += 1
        now = yield Now()
        times, commands = recovered_after_death(
            run, dead, POLICY, plan, detected_at=detected_at, silent_s=silent_s,
            planned_at=planned_at, now=now,
        )  # fmt: skip
        # one at a time, as a flow's driver sends each command's result back
        for command in commands:  # noqa: UP028
            yield command
        first, last = self._member(plan.devices[0]), self._member(plan.devices[-1])
        notice = RunReplanned(
            run=run.run,
            plan=plan.to_dict(),
            dead=dead,
            detected_s=times["detected_s"],
            recovered_s=times["recovered_s"],
            first_endpoint=first.data_endpoint,
            first_stage=first.name,
            first_key=self.key_of(first.name),
            last_stage=last.name,
            last_key=self.key_of(last.name),
            last_endpoint=last.data_endpoint,
            clock=now,
            epoch=run.epoch,
        )
        yield Send(run.client, notice, CLIENT_NAME, self.reply_s)

    def _fitting_split(self, survivors: Sequence[str]) -> list[tuple[int, int]] | None:
        """The survivors' split within each one's memory room, planned as at the run's
        start (:func:`capacity_bounds`); None when no survivor reported a budget: the
        even cut, as before budgets were known. InfeasiblePlanError, naming a stage
        and the MiB it needs and has, when no split fits them."""
        members = [self._member(name) for name in survivors]
        if all(stage_budget_mb(m) is None for m in members):
            return None
        return capacity_bounds(self.config, members, self.limits, None, self.state.memory_margin)

    def _member(self, name: str) -> Member:
        member = self.state.membership.get(name)
        if member is None or member.state is MemberState.DEAD:
            raise StageLostError(name, "it is gone")
        return member

    def _set_up(self, plan: Plan) -> Flow:
        """Send each stage of ``plan`` its ``gen_setup`` under a new epoch and wait
        until every one is built: True; False when one of them died meanwhile."""
        run = self.run
        members = [self._member(name) for name in plan.devices]
        bounds = [(s.start, s.end) for s in plan.stages]
        budget = kv_budget_tokens(
            self.config, bounds, self.limits.kv_budget_bytes, self.limits.dtype
        )
        run.epoch = self.state.next_epoch()
        run.plan = plan
        run.devices = list(plan.devices)
        yield Persist()
        keys = {m.name: self.state.key_of(m.name) for m in members}
        keys[CLIENT_NAME] = run.client_key
        setups = generation_setups(
            run.run,
            run.epoch,
            self.spec,
            members,
            bounds,
            self.limits,
            sink_endpoint=self.request.sink_endpoint,
            keys=keys,
            budget_tokens=budget,
            text=self.request.text or None,
        )
        yield Log(
            "info", "generation_setup", {"run": run.run, "epoch": run.epoch, "bounds": bounds}
        )
        for member, setup in zip(members, setups, strict=True):
            yield Send(member.routing_id, setup, member.name, stage=member.name)
        pending = set(plan.devices)
        while pending:
            try:
                replies: dict[str, GenReady] = yield AwaitReplies(
                    tuple(d for d in plan.devices if d in pending),
                    GenReady,
                    self.state.timeouts.result_s,
                    "gen_ready",
                    run=run.run,
                )
            except StageLostError as exc:
                self.lost.add(exc.stage)
                return False
            for name, reply in replies.items():
                # a late answer to an earlier set-up of this run is not this one's
                if reply.epoch == run.epoch:
                    pending.discard(name)
                    if reply.error:
                        raise PipelineError(
                            f"stage {name!r} refused the re-planned run: {reply.error}"
                        )
        # a stage that had answered may have died since
        return not any(self._gone(d) for d in plan.devices)
