"""The coordinator's part in a live re-partition of a training run (FTPipeHD III-D).

The client paused its feed before mini-batch ``step`` (an asynchronous run's
stages flush there, a synchronous run is between rounds) and asks (``repartition``).
This flow asks every stage to flush and keep a snapshot (``prepare``: they answer
with their counters), lets the pure controller
(:class:`zpipe.training.repartition.RepartitionController`, given the stages' speed
verdicts since the last look: :mod:`zpipe.coordinator.runs.async_speed`) decide, and, when
the cuts move, has the stages fetch their new units from each other's snapshots
(``fetch``: the entries of :func:`zpipe.coordinator.decisions.fetch_plans`, that
is FTPipeHD's Algorithm 1 through :func:`zpipe.recovery.plan_redistribution`;
each holder told beforehand which fetches it answers) before the ``commit`` that
switches them all and resumes them at ``step``. Weights never pass through here.

Eq. 5 costs the links too (:func:`build_controller`): each boundary's activation
and gradient bytes come from the run's profile, each link's bandwidth from the
links the coordinator measured when it planned the run (or the sender's declared
uplink). Each look re-measures capacities; it also has the links between
consecutive stages probed again (:class:`~zpipe.coordinator.commands.
MeasureLinks`), in a flow of its own that nothing waits for: the pipeline and
the client's feed go on meanwhile, and the next look costs eq. 6 with what it
found. A probe does not run during a move (it starts after a look that keeps the
cuts, or after a move's commit), so it never shares a link with the fetches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from zpipe._errors import ConfigError, PipelineError, StageLostError, ZpipeError
from zpipe.coordinator.commands import (
    AllowPeers,
    AwaitReplies,
    Log,
    MeasureLinks,
    Now,
    Persist,
    Send,
)
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import fetch_grants, fetch_plans
from zpipe.coordinator.flows import Flow, request_resend_s
from zpipe.coordinator.membership import Member
from zpipe.coordinator.planning import cluster_from_members
from zpipe.coordinator.runs.base import BaseRun
from zpipe.coordinator.runs.deferred_verdicts import DeferredVerdicts
from zpipe.coordinator.runs.repartition_cuts import plan_bounds, with_bounds, with_depth
from zpipe.coordinator.state import CLIENT_NAME
from zpipe.models import ModelSpec
from zpipe.planner import ClusterSpec
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, AsyncSettings
from zpipe.planner.profile import ModelProfile
from zpipe.planner.training_plan import TrainingPlan
from zpipe.protocol.client_control import RunRequest
from zpipe.protocol.repartition import Repartitioned, RepartitionReply, RepartitionRequest
from zpipe.recovery.replanning import unit_work_from_profile
from zpipe.training.repartition import (
    RepartitionController,
    RepartitionDecision,
    RepartitionSettings,
    spans_of,
)
from zpipe.training.repartition_links import boundary_bytes, link_bandwidths
from zpipe.training.repartition_window import SpeedVerdict


@dataclass(frozen=True)
class PhaseAsk:
    """What one phase asks a stage (a ``repartition_request`` less its run and step)."""

    phase: str
    bounds: list[Any] | None = None
    fetch: list[Any] | None = None
    plan_epoch: int | None = None
    chain: dict[str, Any] | None = None  # a commit that leaves a device out


def repartition_settings(request: RunRequest | None) -> RepartitionSettings | None:
    """The run's re-partitioning settings, from its request (None: it does not)."""
    train = (request.train if request is not None else None) or {}
    given = train.get("repartition")
    if given is None:
        return None
    if train.get("schedule") == ASYNC_SCHEDULE:
        if not AsyncSettings.from_dict(train.get("async")).vertical_sync:
            raise ConfigError("a live re-partition needs vertical sync (the versions it moves)")
    settings = RepartitionSettings.from_dict(given)
    if settings.leave_out:
        if train.get("schedule") != ASYNC_SCHEDULE:
            raise ConfigError(f"repartition leave_out re-wires {ASYNC_SCHEDULE} runs only")
        if AsyncSettings.from_dict(train.get("async")).live_copies:
            # the chain copies' routes name the device left out (not re-wired yet)
            raise ConfigError("repartition leave_out does not go with live copies yet")
    return settings


def reference_unit_s(plan: TrainingPlan, profile: ModelProfile | None) -> list[float]:
    """Each unit's profiled training time (forward and backward) at the plan's
    micro-batch size; without a usable profile every unit alike (capacities then
    compare stages unit for unit)."""
    alike = [1.0] * plan.num_units
    if profile is None:
        return alike
    try:
        work = unit_work_from_profile(profile, plan.microbatch_size, training=True)
    except ConfigError:  # not a training profile, or not at this batch size
        return alike
    return work if len(work) == plan.num_units and all(w > 0 for w in work) else alike


def build_controller(
    plan: TrainingPlan,
    settings: RepartitionSettings,
    *,
    profile: ModelProfile | None,
    cluster: ClusterSpec | None,
) -> RepartitionController:
    """The live re-partition controller of a one-device-per-stage ``plan``: unit times
    from ``profile`` (the first device's), and eq. 5's link term from its boundary
    sizes at the plan's micro-batch size and the bandwidths ``cluster`` gives each
    pair of consecutive devices (measured, or declared). Without a profile or a
    cluster, links are left out (eq. 5 without ``2 * T_c``)."""
    devices, bounds = plan_bounds(plan)
    sizes: list[float] | None = None
    links: list[float] | None = None
    if profile is not None and cluster is not None:
        try:
            found = boundary_bytes(profile, plan.microbatch_size)
            if len(found) == plan.num_units:
                sizes, links = found, link_bandwidths(devices, cluster)
        except ConfigError:  # the profile has no sizes at this batch size
            sizes, links = None, None
    return RepartitionController(
        settings,
        devices=devices,
        bounds=bounds,
        reference_unit_s=reference_unit_s(plan, profile),
        output_bytes=sizes,
        bandwidths_bps=links,
    )


def _links_logged(controller: RepartitionController) -> dict[str, Any]:
    """The links a look costed, for its log line: Mbit/s between consecutive stages
    (None: unlimited); nothing when it costs no links."""
    if controller.bandwidths_bps is None:
        return {}
    return {
        "links_mbit_s": [
            None if math.isinf(b) else round(b * 8 / 1e6, 1) for b in controller.bandwidths_bps
        ]
    }


def run_controller(run: BaseRun) -> RepartitionController | None:
    """The live re-partition controller of training run ``run``, once a re-partition
    request built it (None: the run does not re-partition, or has not looked yet).
    A training controller keeps its :class:`LiveRepartitioning` as
    ``_repartitioning`` (:mod:`zpipe.coordinator.runs.sync_training`)."""
    flows = getattr(run, "_repartitioning", None)
    return flows.controller if isinstance(flows, LiveRepartitioning) else None


def live_repartitioning(run: BaseRun) -> LiveRepartitioning | None:
    """Training run ``run``'s :class:`LiveRepartitioning`, made if it has none yet
    (None: not a training run)."""
    if not hasattr(run, "_repartitioning"):
        return None
    flows = run._repartitioning
    if not isinstance(flows, LiveRepartitioning):
        flows = run._repartitioning = LiveRepartitioning(run)
    return flows


class LiveRepartitioning:
    """One training run's re-partitions: its controller, and the flow of each.

    What the controller must go on from after a coordinator restart is kept with
    the run and saved with it (``Run.repartition_epoch``, ``repartition_pending``):
    its plan epoch (a restarted one numbered from 0 again, and forced the
    settings' first cuts once more) and a look's move the client paused for but
    that was not yet carried out (a restarted one looked anew, from counters
    that no longer covered the window the client paused for)."""

    def __init__(self, run: BaseRun) -> None:
        self.owner = run
        self.controller: RepartitionController | None = None
        # a look before the flush that decided to move: carried out by the next
        # (flushing) request of the same mini-batch
        self.pending: RepartitionDecision | None = run.run.repartition_pending
        self._probing = False  # the links are being probed again (see _renew_links)
        # a look or a move is in progress (a stage's speed verdict then is deferred:
        # zpipe.coordinator.runs.async_speed), the verdicts relayed already, and the
        # latest per stage, for the next look only (no double count)
        self.looking = False
        self.relayed: set[tuple[str, int, int]] = set()
        self.verdicts: dict[str, SpeedVerdict] = {}
        # those that came during the look or move in progress: told when it ends
        self.deferred = DeferredVerdicts()

    def _controller(
        self, plan: TrainingPlan, settings: RepartitionSettings
    ) -> RepartitionController:
        if self.controller is None:
            self.controller = build_controller(
                plan, settings, profile=self._profile(plan), cluster=self._cluster(plan.devices)
            )
            self.controller.plan_epoch = self.owner.run.repartition_epoch
        return self.controller

    def _keep(self) -> None:
        """What a successor needs, into the run (saved at the run's next save)."""
        run = self.owner.run
        if self.controller is not None:
            run.repartition_epoch = self.controller.plan_epoch
        run.repartition_pending = self.pending

    def _profile(self, plan: TrainingPlan) -> ModelProfile | None:
        """The first device's training profile, cached when the run was planned."""
        owner, run = self.owner, self.owner.run
        try:
            spec = ModelSpec.from_dict(dict(run.request.model))  # type: ignore[union-attr]
        except (ZpipeError, KeyError, TypeError, AttributeError):
            return None
        member = owner.state.membership.get(plan.devices[0])
        if member is None:
            return None
        return owner.state.profiles.get(spec, plan.microbatch_size, "float32", member, train=True)

    def _cluster(self, devices: list[str]) -> ClusterSpec | None:
        """The links between ``devices`` as the planner costs them: measured where the
        coordinator measured them (its cache: nothing is probed here), else declared."""
        state = self.owner.state
        members = [state.membership.get(d) for d in devices]
        known = [m for m in members if m is not None]
        if len(known) != len(devices):
            return None
        try:
            return cluster_from_members(
                known, links=state.measured_links(known), margin=state.memory_margin, training=True
            )
        except ConfigError:  # a stage declared a link the planner refuses
            return None

    def _bandwidths(self, controller: RepartitionController) -> list[float] | None:
        """The controller's links as measured now (None: it costs none, or a stage
        is gone and the last ones stay)."""
        if controller.output_bytes is None:
            return None
        cluster = self._cluster(list(controller.devices))
        return None if cluster is None else link_bandwidths(controller.devices, cluster)

    def links_of(self, devices: list[str]) -> dict[tuple[str, str], tuple[float, str]]:
        """The link between each pair of consecutive ``devices`` as eq. 5 costs it (bytes
        per second, both directions combined) and where it comes from: ``measured``
        (the coordinator's probes, both directions) or ``declared`` (a stage's declared
        uplink); empty when the cluster of ``devices`` cannot be built. Nothing is
        probed here."""
        cluster = self._cluster(devices)
        if cluster is None or len(devices) < 2:
            return {}
        state = self.owner.state
        members = [m for m in (state.membership.get(d) for d in devices) if m is not None]
        probed = state.measured_links(members)
        out: dict[tuple[str, str], tuple[float, str]] = {}
        for (a, b), bps in zip(pairwise(devices), link_bandwidths(devices, cluster), strict=True):
            source = "measured" if (a, b) in probed and (b, a) in probed else "declared"
            out[(a, b)] = (bps, source)
        return out

    def _renew_links(self, devices: list[str], members: dict[str, Member]) -> Flow:
        """Have the links between consecutive stages probed again while the run goes
        on: a flow of its own (this one does not wait for it), at most one at a time;
        the next look reads what it found from the coordinator's cache."""
        controller = self.controller
        if self._probing or controller is None or controller.output_bytes is None:
            return
        self._probing = True
        now = yield Now()
        # a flow started from inside this one: its first commands are this flow's to
        # yield (the shell then runs its job and resumes it, not this flow)
        chain = tuple(members[d] for d in devices)
        yield from self.owner.state.flows.start(self._probe(chain), now)

    def _probe(self, chain: tuple[Member, ...]) -> Flow:
        run = self.owner.run
        try:
            measured = yield MeasureLinks(chain)
        except (ZpipeError, OSError) as exc:  # a probe failed: the last links stay
            yield Log("warning", "repartition_links_unmeasured", {"run": run.run,
                      "error": str(exc)})  # fmt: skip
            return
        finally:
            self._probing = False
        if measured:
            mbps = {f"{a}>{b}": round(m.bandwidth_bps / 1e6, 1) for (a, b), m in measured.items()}
            yield Log("info", "repartition_links_measured", {"run": run.run, "mbit_s": mbps})

    def _ready(
        self, run_id: int
    ) -> tuple[TrainingPlan, RepartitionController, list[str], dict[str, Member]]:
        """The run's plan, its controller, its devices in stage order and their members;
        ConfigError or StageLostError when the run cannot re-partition now."""
        owner, run = self.owner, self.owner.run
        if owner.state.current is not owner or run.run != run_id:
            raise ConfigError(f"run {run_id} is not the current training run")
        plan = run.training_plan
        settings = repartition_settings(run.request)
        if plan is None or settings is None:
            raise ConfigError(f"run {run_id} does not re-partition")
        controller = self._controller(plan, settings)
        devices = list(controller.devices)
        members = {m.name: m for m in owner.state.membership.alive()}
        missing = [d for d in devices if d not in members]
        if missing:
            raise StageLostError(", ".join(missing), "gone; the run cannot re-partition")
        return plan, controller, devices, members

    def flow(self, run_id: int, step: int, *, look: bool = False) -> Flow:
        """A re-partition before mini-batch ``step``; with ``look``, only its decision,
        from counters taken without a flush (see :meth:`_look`)."""
        self.looking = True
        try:
            if look:
                answer = yield from self._look(run_id, step)
            else:
                answer = yield from self._repartition(run_id, step)
        finally:
            self.looking = False
        controller = self.controller
        yield from self.deferred.after_look(
            move_pending=self.pending is not None,
            plan_epoch=0 if controller is None else controller.plan_epoch,
            untaken=self.verdicts,
            client=self.owner.run.client,
            timeout_s=self.owner.state.timeouts.reply_s,
        )
        return answer

    def _repartition(self, run_id: int, step: int) -> Flow:
        run = self.owner.run
        answer = Repartitioned(run=run_id, step=step, error="")
        try:
            plan, controller, devices, members = self._ready(run_id)
            # the pause's parts are read from these events' stamps (bench/training_async.py)
            yield Log("info", "repartition_started", {"run": run.run, "step": step})
            replies = yield from self.ask(members, devices, step, PhaseAsk("prepare"))
            pending, self.pending = self.pending, None
            self._keep()  # saved with the commit's save, or the run's next one
            counters = {d: dict(r.metrics or {}) for d, r in replies.items()}
            if pending is not None and pending.at == step:
                decision = pending  # decided before the flush (_look)
                # the batches drained since that look ran on the old cuts
                controller.rebase(counters)
            else:
                links = self._bandwidths(controller)
                verdicts, self.verdicts = self.verdicts, {}  # to this look only
                decision = controller.look(step, counters, bandwidths_bps=links, verdicts=verdicts)
            # step: the look's mini-batch (``at`` is the decision's: an earlier look's
            # when this carries out its move), as the other events of the look name it
            yield Log("info", "repartition_considered", {"run": run.run, **decision.to_dict(),
                      "step": step, **_links_logged(controller),
                      **controller.window_logged()})  # fmt: skip
            target = decision.bounds if decision.bounds is not None else controller.bounds
            kept = decision.devices if decision.moves else None
            if decision.bounds is not None:
                yield from self._fetch(members, plan, step, decision.bounds, kept)
            epoch = controller.plan_epoch + (1 if decision.moves else 0)
            commit: PhaseAsk | dict[str, PhaseAsk] = PhaseAsk(
                "commit", bounds=list(target), plan_epoch=epoch
            )
            if kept is not None:
                # the stages kept take their places in the shorter chain; the device
                # left out gets no commit: it stays at its flush, idle
                yield Log("info", "repartition_leaving_out", {"run": run.run, "step": step,
                          "left_out": list(decision.left_out(devices))})  # fmt: skip
                commit = self._chain_commits(members, kept, list(target), epoch)
            committed = yield from self.ask(members, list(kept or devices), step, commit)
            if decision.moves:
                if kept is not None and run.request is not None:
                    # the run keeps the depth it started with (a later recovery too)
                    train = run.request.train or {}
                    depth = AsyncSettings.from_dict(train.get("async")).depth_of(len(devices))
                    run.request = with_depth(run.request, depth)
                controller.committed(decision)
                run.training_plan = with_bounds(plan, target, kept)
                if kept is not None:
                    # the device left out is no longer the run's: its death, its
                    # metrics and its weights are not the run's either (it stays
                    # registered and idle, paused at its flush, until it is assigned)
                    run.devices = list(kept)
                self._keep()
                yield Persist()  # a successor takes over the cuts the stages run now
                yield Log("info", "repartitioned", {"run": run.run, "step": step,
                          "bounds": list(target), "plan_epoch": controller.plan_epoch})  # fmt: skip
            # where each stage says its units are now
            held = {d: (r.metrics or {}) for d, r in committed.items()}
            answer = replace(
                answer,
                bounds=list(target),
                plan_epoch=controller.plan_epoch,
                decision={
                    **decision.to_dict(),
                    "held": {d: [m.get("start"), m.get("end")] for d, m in held.items()},
                },
            )
            # after the commit: the probes never share a link with the fetches
            yield from self._renew_links(list(controller.devices), members)
        except (ZpipeError, ValueError) as exc:
            answer = replace(answer, error=f"{type(exc).__name__}: {exc}")
            yield Log("error", "repartition_failed", {"run": run_id, "step": step,
                      "error": answer.error})  # fmt: skip
        return answer

    def _look(self, run_id: int, step: int) -> Flow:
        """The look alone, while the pipeline runs: every stage's counters as they are
        (``profile``: no flush), the controller's decision. When it keeps the cuts the
        client goes on without pausing (a flush costs the pipeline's drain and fill
        at every look, and most looks keep the cuts); when it moves them the reply
        says ``pause``: the client pauses, and its next request carries this decision
        out (prepare, fetch, commit). A stage that cannot profile (an older one)
        also gets ``pause``, and the look then happens at the flush as before."""
        run = self.owner.run
        answer = Repartitioned(run=run_id, step=step, error="")
        try:
            _, controller, devices, members = self._ready(run_id)
            yield Log("info", "repartition_started", {"run": run.run, "step": step,
                      "flush": False})  # fmt: skip
            try:
                replies = yield from self.ask(members, devices, step, PhaseAsk("profile"))
            except PipelineError as exc:
                yield Log("warning", "repartition_profile_failed", {"run": run.run,
                          "step": step, "error": str(exc)})  # fmt: skip
                return replace(answer, pause=True)
            counters = {d: dict(r.metrics or {}) for d, r in replies.items()}
            links = self._bandwidths(controller)
            verdicts, self.verdicts = self.verdicts, {}  # to this look only
            decision = controller.look(step, counters, bandwidths_bps=links, verdicts=verdicts)
            yield Log("info", "repartition_considered", {"run": run.run, "flush": False,
                      **decision.to_dict(), "step": step, **_links_logged(controller),
                      **controller.window_logged()})  # fmt: skip
            self.pending = decision if decision.moves else None
            if decision.moves:
                # the client pauses for it: a successor must carry it out, not look anew
                self._keep()
                yield Persist()
            if not decision.moves:  # a move probes after its commit
                yield from self._renew_links(devices, members)
            # where each stage says its units are now (as a commit's replies say)
            held = {d: [c.get("start"), c.get("end")] for d, c in counters.items()}
            answer = replace(
                answer,
                bounds=list(controller.bounds),
                plan_epoch=controller.plan_epoch,
                decision={**decision.to_dict(), "held": held},
                pause=True if decision.moves else None,
            )
        except (ZpipeError, ValueError) as exc:
            answer = replace(answer, error=f"{type(exc).__name__}: {exc}")
            yield Log("error", "repartition_failed", {"run": run_id, "step": step,
                      "error": answer.error})  # fmt: skip
        return answer

    def _fetch(
        self,
        members: dict[str, Member],
        plan: TrainingPlan,
        step: int,
        bounds: tuple[int, ...],
        kept: tuple[str, ...] | None = None,
    ) -> Flow:
        """Every stage of ``bounds`` (over ``kept``, when the move leaves devices out)
        fetches the units it lacks from the others' snapshots (a device left out: from
        its own, its live state at the flush)."""
        owner, run = self.owner, self.owner.run
        devices, _ = plan_bounds(plan)
        # every device's snapshot at this step is at the device itself; nothing is here
        own = {d: d for d in devices}
        replica = KeptReplica(run.run, step, plan, {}, holders=own, global_copy=False)
        fetches = fetch_plans(replica, spans_of(kept or devices, bounds), set(members))
        yield AllowPeers(tuple(members[d] for d in devices), fetch_grants(fetches))
        owner.state.fetch_grants_out = True  # until the next backup revokes them
        yield Log("info", "repartition_fetching", {"run": run.run, "step": step})
        for dest, entries in fetches.items():
            for entry in entries:
                if entry["from"] != dest:
                    entry["endpoint"] = str(members[entry["from"]].info["probe_endpoint"])
                    entry["key"] = owner.key_of(entry["from"])
        # a leave-out: each stage kept admits its new neighbours before anyone commits
        chains = {} if kept is None else self._chain_commits(members, kept, list(bounds), 0)
        per_device = {d: PhaseAsk("fetch", bounds=list(bounds), fetch=fetches.get(d, []),
                                  chain=chains[d].chain if d in chains else None)
                      for d in devices}  # fmt: skip
        yield from self.ask(members, devices, step, per_device)

    def _chain_commits(
        self, members: dict[str, Member], kept: tuple[str, ...], bounds: list[int], epoch: int
    ) -> dict[str, PhaseAsk]:
        """Each kept stage's commit with its place in the shorter chain (its neighbours'
        data endpoints and keys, the client's at the ends, as an assignment's)."""
        owner, request = self.owner, self.owner.run.request
        assert request is not None
        client = {"names": [CLIENT_NAME], "shares": [1], "endpoints": [request.sink_endpoint],
                  "keys": [owner.key_of(CLIENT_NAME)]}  # fmt: skip

        def side(i: int) -> dict[str, Any]:
            if i < 0 or i >= len(kept):
                return client
            name = kept[i]
            return {"names": [name], "shares": [1], "endpoints": [members[name].data_endpoint],
                    "keys": [owner.key_of(name)]}  # fmt: skip

        n = len(kept)
        return {
            d: PhaseAsk(
                "commit",
                bounds=bounds,
                plan_epoch=epoch,
                chain={
                    "index": i,
                    "num_stages": n,
                    "upstream": side(i - 1),
                    "downstream": side(i + 1),
                },
            )
            for i, d in enumerate(kept)
        }

    def ask(
        self,
        members: dict[str, Member],
        devices: list[str],
        step: int,
        phase: PhaseAsk | Mapping[str, PhaseAsk],
    ) -> Flow:
        """One phase: the request to every device (``phase``, or one per device), every
        reply."""
        owner, run = self.owner, self.owner.run
        timeouts = owner.state.timeouts
        requests = []
        for d in devices:
            ask = phase[d] if isinstance(phase, Mapping) else phase
            request = RepartitionRequest(
                run=run.run,
                step=step,
                phase=ask.phase,
                bounds=ask.bounds,
                fetch=ask.fetch,
                plan_epoch=ask.plan_epoch,
                chain=ask.chain,
                epoch=run.epoch,
            )
            requests.append(Send(members[d].routing_id, request, d, stage=d))
        name = (phase[devices[0]] if isinstance(phase, Mapping) else phase).phase
        replies: dict[str, RepartitionReply] = yield AwaitReplies(
            tuple(devices),
            RepartitionReply,
            timeouts.result_s,
            f"repartition {name}",
            run=run.run,
            requests=tuple(requests),
            resend_s=request_resend_s(timeouts),
        )
        failed = {d: r.error for d, r in replies.items() if r.error}
        if failed:
            raise PipelineError(f"the {name} of a re-partition failed: {failed}")
        return replies
