"""A synchronous training run's controller: start, replicas, rebalancing, admission.

    assign (epoch; with a replica: each unit's state, and where to fetch the rest)
        ─> every device ─> ready ─> run_ready (plan of device groups)
    run_go ─> connect (with each group's all-reduce ring) ─> connected ─> run_started
    replicate after round s: every device's weights and optimizer state (global), or
        a backup of each stage at its neighbour (chain, topology); then, with
        ``rebalance``, admission of newcomers or migration of work (the reply says)
    weights_request: the checkpoint the client writes
    a stage dies: the client is told (stage_failed) and resumes a new run from the
        replica (:mod:`zpipe.coordinator.starting`)

Pure: events in, commands out; asynchronous training, federated groups and lossy
runs are further modules beside this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from zpipe._errors import ConfigError, ProtocolError, StageLostError, StateFileError, ZpipeError
from zpipe.coordinator.commands import (
    AllowPeers,
    AwaitConfirmed,
    AwaitReplies,
    Command,
    Log,
    PlanTraining,
    SaveReplica,
    Send,
    TrainingModel,
)
from zpipe.coordinator.current_run import KeptReplica
from zpipe.coordinator.decisions import live_members, training_planner_for
from zpipe.coordinator.events import ClientRequest, Event, StageDied
from zpipe.coordinator.flows import Flow, request_resend_s
from zpipe.coordinator.membership import Member
from zpipe.coordinator.records import SavedReplica
from zpipe.coordinator.runs.async_repartition import LiveRepartitioning
from zpipe.coordinator.runs.base import BaseRun
from zpipe.coordinator.runs.sync_balance import (
    admits,
    at_microbatch_size,
    given_unit_work,
    memory_model,
    rebalanced,
    run_optimizer,
)
from zpipe.coordinator.state import CLIENT_NAME
from zpipe.models import ModelSpec
from zpipe.planner.training_cost import TrainingCosts, predict_training
from zpipe.planner.training_plan import TRAINING_ALGOS, TrainingPlan
from zpipe.protocol.client_control import (
    Checkpoint,
    Progress,
    Replicate,
    Replicated,
    RunFailed,
)
from zpipe.protocol.repartition import Repartition
from zpipe.protocol.stage_control import BackedUp, BackupRequest, Weights, WeightsRequest
from zpipe.recovery import (
    COORDINATOR,
    asteroid_replication,
    ftpipehd_replication,
    unit_work_from_profile,
)
from zpipe.recovery.stage_costs import CostModel
from zpipe.training.objectives import check_train_settings
from zpipe.transport import codec

if TYPE_CHECKING:
    import torch


class SyncTrainingController(BaseRun):
    kind = "train"
    # the newest replica of this fit that holds every unit here (global replication):
    # what a recovery falls back to when chain copies of some unit all died
    fallback: KeptReplica | None = None

    def ring_of(self, device: str) -> dict[str, Any] | None:
        for group in self.run.groups:
            if device in group and len(group) > 1:
                return {
                    "endpoints": [self.run.ring_endpoints.get(n, "") for n in group],
                    "keys": [self.key_of(n) for n in group],
                }
        return None

    _repartitioning: LiveRepartitioning | None = None

    def on_event(self, event: Event, now: float) -> list[Command]:
        if isinstance(event, StageDied):
            return self.state.flows.start(self.notify_stage_failed(event.name, event.reason), now)
        if not isinstance(event, ClientRequest):
            return super().on_event(event, now)
        match event.message:
            case Repartition(run=run_id, step=step, look=look):
                return self._repartition(event.routing_id, run_id, step, bool(look), now)
            case WeightsRequest(run=run_id, step=step, optimizer=optimizer):

                def checkpoint() -> Flow:
                    return self.checkpoint(run_id, step, optimizer=bool(optimizer))

                key, timeout = ("weights", run_id, step), self.state.timeouts.send_s
                return self._answer(event.routing_id, key, checkpoint, timeout, now)
            case Replicate(run=run_id, step=step, global_copy=global_copy):

                def replica() -> Flow:
                    return self.take_replica(run_id, step, global_copy=bool(global_copy))

                key, timeout = ("replicate", run_id, step), self.reply_s
                return self._answer(event.routing_id, key, replica, timeout, now)
        return super().on_event(event, now)

    def _answer(
        self,
        routing_id: bytes,
        key: tuple[str, int, int],
        make: Callable[[], Flow],
        timeout_s: float,
        now: float,
    ) -> list[Command]:
        """Answer a client's request once, however often it asks (see flows.Answers)."""
        return self.state.answers.answer(
            self.state.flows,
            key,
            routing_id,
            make,
            peer=CLIENT_NAME,
            timeout_s=timeout_s,
            now=now,
        )

    def _repartition(
        self, routing_id: bytes, run_id: int, step: int, look: bool, now: float
    ) -> list[Command]:
        """A live re-partition (zpipe.coordinator.runs.async_repartition), its flow answered once;
        ``look``: a look before any flush."""
        if self._repartitioning is None:
            self._repartitioning = LiveRepartitioning(self)
        flows = self._repartitioning
        key = ("repartition_look" if look else "repartition", run_id, step)
        return self._answer(
            routing_id, key, lambda: flows.flow(run_id, step, look=look), self.reply_s, now
        )

    def is_current(self, run_id: int) -> bool:
        return self.state.current is self and self.run.run == run_id

    # ------------------------------------------------------------- weights

    def progress_notice(self, awaited: str) -> Send | None:
        """What tells the client that the state it awaits is moving (if it asked)."""
        run = self.run
        if not run.client_progress:
            return None
        notice = Progress(run=run.run, awaited=awaited)
        return Send(run.client, notice, CLIENT_NAME, self.state.timeouts.heartbeat_interval_s)

    def gather_state(
        self, step: int, *, optimizer: bool, metrics: dict[str, Any] | None = None
    ) -> Flow:
        """Every device's weights (and optimizer state) once it finished round ``step``:
        returns ``(keys, tensors)``."""
        run = self.run
        members = {m.name: m for m in self.state.membership.alive()}
        missing = [d for d in run.devices if d not in members]
        if missing:
            raise StageLostError(", ".join(missing), "gone, and its weights with it")
        request = WeightsRequest(
            run=run.run, step=step, optimizer=True if optimizer else None, epoch=run.epoch
        )
        requests = tuple(
            Send(members[device].routing_id, request, device, stage=device)
            for device in run.devices
        )
        replies = yield AwaitReplies(
            tuple(run.devices),
            Weights,
            self.state.timeouts.result_s,
            "weights",
            requests=requests,
            resend_s=request_resend_s(self.state.timeouts),
            on_progress=self.progress_notice("weights"),
        )
        return state_of_replies(replies, run.devices, "weights reply", metrics)

    def back_up(self, step: int, counters: dict[str, Any]) -> Flow:
        """Chain (FTPipeHD) or topology-driven (Asteroid) replication after round
        ``step``: every device keeps a snapshot, each stage's first device backs it up
        to its holder. Returns what was backed up to the coordinator, and the holders."""
        run = self.run
        assert run.training_plan is not None
        holders = backup_holders(run.training_plan, run.replication)
        members = {m.name: m for m in self.state.membership.alive()}
        missing = [d for d in run.devices if d not in members]
        if missing:
            raise StageLostError(", ".join(missing), "gone; it cannot back up")
        if self.state.fetch_grants_out:
            # The grants of a restore or a move name older snapshots of these units, which
            # this backup replaces: revoked (an empty grant for every member), so that no
            # peer fetches a stale copy, before the backups (and their peer access) go out.
            # Every member: a holder of the restore may have left the run's plan.
            yield AllowPeers(tuple(members.values()), {})
            self.state.fetch_grants_out = False
        elif self.state.public_keys:
            # peers reach each other's probe sockets: allowed before anyone connects
            yield AllowPeers(tuple(members[d] for d in run.devices))
        requests: list[Send] = []
        for device in run.devices:
            holder = holders.get(device, "")
            peer = bool(holder) and holder != COORDINATOR
            request = BackupRequest(
                run=run.run,
                step=step,
                holder=holder,
                holder_endpoint=str(members[holder].info["probe_endpoint"]) if peer else None,
                holder_key=self.key_of(holder) if peer else None,
                epoch=run.epoch,
            )
            requests.append(Send(members[device].routing_id, request, device, stage=device))
        replies = yield AwaitReplies(
            tuple(run.devices),
            BackedUp,
            self.state.timeouts.result_s,
            "backed_up",
            requests=tuple(requests),
            resend_s=request_resend_s(self.state.timeouts),
            on_progress=self.progress_notice("backed_up"),
        )
        keys, tensors = state_of_replies(replies, run.devices, "backup", counters)
        return keys, tensors, {d: holders.get(d, "") for d in run.devices}

    def checkpoint(self, run_id: int, step: int, *, optimizer: bool = False) -> Flow:
        """Every stage's weights (``optimizer``: and optimizer state) once it finished
        round ``step``, for the client."""
        run = self.run
        try:
            if not self.is_current(run_id):
                raise ConfigError(f"run {run_id} is not the current run")
            yield AwaitConfirmed(tuple(run.devices))
            keys, tensors = yield from self.gather_state(step, optimizer=optimizer)
            if len(tensors) > codec.MAX_TENSORS:
                raise ConfigError(
                    f"the checkpoint holds {len(tensors)} tensors (replicas included), "
                    f"more than one message carries ({codec.MAX_TENSORS})"
                )
        except (ZpipeError, ValueError) as exc:
            yield Log("error", "run_failed", {"error": str(exc)})
            return RunFailed(error=str(exc))
        return Checkpoint(
            run=run.run, step=step, keys=keys, tensors=tuple(tensors), epoch=run.epoch
        )

    def take_replica(self, run_id: int, step: int, *, global_copy: bool = False) -> Flow:
        """Keep a replica of the run after round ``step`` (weights and optimizer state of
        every unit; a group's members hold identical copies, one is kept); then, with
        ``rebalance``, say whether the run should change shape. Under chain or topology
        replication ``global_copy`` also gathers every unit here (FTPipeHD runs both);
        a chain replica without one keeps the newest that had one as its fallback."""
        run = self.run
        answer = Replicated(run=run_id, step=step, tensor_count=0, nbytes=0, error="")
        try:
            if not self.is_current(run_id) or run.training_plan is None:
                raise ConfigError(f"run {run_id} is not the current training run")
            yield AwaitConfirmed(tuple(run.devices))
            counters: dict[str, Any] = {}
            keys, tensors, holders, whole = yield from self.collect_replica(
                step, global_copy, counters
            )
            state: dict[str, torch.Tensor] = {}
            for key, tensor in zip(keys, tensors, strict=True):
                if key not in state:
                    # A copy: the received frame's memory belongs to a zmq message.
                    state[key] = tensor.clone()
            if self.state.saves_replicas:
                # On disk before the client hears of it: it then drops what came before.
                saved = SavedReplica(
                    run.run, step, run.training_plan.to_dict(), state, holders, whole
                )
                try:
                    yield SaveReplica(saved)
                except (OSError, StateFileError) as exc:
                    raise StateFileError(f"the replica could not be saved: {exc}") from exc
            replica = KeptReplica(
                run.run,
                step,
                run.training_plan,
                state,
                holders,
                fallback=None if whole else self.fallback,
                global_copy=whole,
            )
            self.state.replica = replica
            if whole:
                self.fallback = replica
            answer = replace(
                answer,
                global_copy=whole,
                tensor_count=len(state),
                nbytes=sum(t.numel() * t.element_size() for t in state.values()),
            )
            yield Log(
                "info",
                "replica_kept",
                {
                    "run": run.run,
                    "step": step,
                    "tensors": len(state),
                    "bytes": answer.nbytes,
                    "saved": self.state.saves_replicas,
                    "replication": run.replication,
                    "holders": holders or None,
                    "global": whole,
                    "fallback": None if replica.fallback is None else replica.fallback.step,
                },
            )
            if run.rebalance is not None:
                balanced = yield from self.with_newcomers(run.training_plan)
                if balanced is None:
                    balanced = yield from self.rebalance(run.training_plan, counters)
                if balanced is not None:
                    answer = replace(answer, rebalance=balanced.to_dict())
        except (ZpipeError, ValueError) as exc:
            answer = replace(answer, error=f"{type(exc).__name__}: {exc}")
            yield Log(
                "error", "replica_failed", {"run": run_id, "step": step, "error": answer.error}
            )
        return answer

    def collect_replica(self, step: int, global_copy: bool, counters: dict[str, Any]) -> Flow:
        """The state a replica after round ``step`` keeps here: ``(keys, tensors,
        holders, whole)`` (the holders of chain or topology backups; ``whole``: every
        unit is here). Each device's counters go to ``counters``."""
        run = self.run
        holders: dict[str, str] = {}
        whole = run.replication == "global" or global_copy
        if run.replication == "global":
            keys, tensors = yield from self.gather_state(step, optimizer=True, metrics=counters)
        else:
            keys, tensors, holders = yield from self.back_up(step, counters)
            if global_copy:
                more_keys, more = yield from self.gather_state(step, optimizer=True)
                keys, tensors = keys + more_keys, tensors + more
        return keys, tensors, holders, whole

    # ------------------------------------------------------------ run shape

    def rebalance(self, plan: TrainingPlan, counters: dict[str, Any]) -> Flow:
        """Eco-FL's workload migration from the measured speeds (see
        :func:`zpipe.coordinator.runs.sync_balance.rebalanced`)."""
        run = self.run
        assert run.rebalance is not None and run.request is not None
        spec = ModelSpec.from_dict(run.request.model)
        unit_work: list[float] = [1.0] * plan.num_units
        model: CostModel | None = None
        batch = plan.microbatch_size
        members = [self.state.membership.get(d) for d in plan.devices]
        known = [
            p
            for m in members
            if m is not None
            and (p := self.state.profiles.get(spec, batch, "float32", m, train=True)) is not None
        ]
        if run.request.profile is not None:
            # the plan the client gave was planned on this profile: cost its units so
            try:
                unit_work = given_unit_work(run.request.profile, plan)
            except ConfigError as exc:
                yield Log("warning", "rebalance_skipped", {"run": run.run, "error": str(exc)})
                return None
        elif known:
            unit_work = unit_work_from_profile(known[0], batch, training=True)
        if len(known) == len(members) and all(m is not None for m in members):
            # every device profiled (when the run was planned): cost links as the planner
            # did, from the cached profiles and measured links
            profile, cluster = yield TrainingModel(
                spec, tuple(m for m in members if m is not None), batch
            )
            unit_work = unit_work_from_profile(profile, batch, training=True)
            optimizer = run_optimizer(plan, run.request.train)
            model = CostModel(profile, cluster, optimizer=optimizer)
        found = rebalanced(plan, counters, unit_work, run.rebalance, model)
        if found.skipped:
            yield Log("warning", "rebalance_skipped", {"run": run.run, "error": found.skipped})
        elif found.fields:
            yield Log("info", "rebalance_considered", {"run": run.run, **found.fields})
        if found.plan is not None:
            yield Log("info", "rebalanced", {"run": run.run, "plan": found.plan.to_dict()})
        return found.plan

    def with_newcomers(self, plan: TrainingPlan) -> Flow:
        """A device that registered (or came back) since the run was planned joins it at
        a replica when the planner, over it and the run's devices, predicts a round
        shorter by at least ``run.rebalance`` than the current plan's (same cost model)."""
        run = self.run
        request = run.request
        assert request is not None and run.rebalance is not None
        admit = request.admit
        newcomers = [
            m
            for m in live_members(self.state.membership)
            if m.name not in run.devices and (admit is None or m.name in admit)
        ]
        current = [self.state.membership.get(d) for d in plan.devices]
        if not newcomers or any(m is None for m in current):
            return None
        members: tuple[Member, ...] = (*(m for m in current if m is not None), *newcomers)
        settings = request.train_settings
        settings.pop("plan", None)
        settings.update(schedule=plan.schedule, num_microbatches=plan.num_microbatches)
        # a request's planner that is not a training planner (pipeedge, its default)
        # plans training with HPP
        planner = request.planner_name
        batch = request.microbatch_size_or(plan.microbatch_size)
        spec = ModelSpec.from_dict(request.model)
        try:
            checked = check_train_settings(settings, 1)
            optimizer = memory_model(checked["optimizer"])
            bigger = yield PlanTraining(
                spec,
                members,
                batch,
                int(checked["num_microbatches"]),
                algo=training_planner_for(
                    spec.family, planner if planner in TRAINING_ALGOS else "hpp"
                ),
                schedule=str(checked["schedule"]),
                optimizer=optimizer,
            )
            profile, cluster = yield TrainingModel(spec, members, batch)
            costs = TrainingCosts(profile, cluster, microbatch_size=batch, optimizer=optimizer)
            now = predict_training(at_microbatch_size(plan, batch), costs)["round_s"]
            then = float(bigger.predicted["round_s"])
        except (ZpipeError, ValueError, KeyError) as exc:
            yield Log("warning", "admission_skipped", {"run": run.run, "error": str(exc)})
            return None
        yield Log(
            "info",
            "admission_considered",
            {
                "run": run.run,
                "newcomers": [m.name for m in newcomers],
                "round_s": round(now, 6),
                "with_newcomers_s": round(then, 6),
            },
        )
        if not admits(now, bigger, plan, run.rebalance):
            return None
        joining = [n for n in bigger.devices if n not in plan.devices]
        yield Log(
            "info", "admitted", {"run": run.run, "devices": joining, "plan": bigger.to_dict()}
        )
        return bigger


def state_of_replies(
    replies: Mapping[str, Weights | BackedUp],
    devices: list[str],
    what: str,
    metrics: dict[str, Any] | None,
) -> tuple[list[str], list[torch.Tensor]]:
    """The keys and tensors of every device's ``weights`` or ``backed_up`` reply, in
    device order; each device's counters go to ``metrics`` when given."""
    keys: list[str] = []
    tensors: list[torch.Tensor] = []
    for device in devices:
        reply = replies[device]
        if reply.error:
            raise ConfigError(f"stage {reply.name!r}: {reply.error}")
        if len(reply.keys) != len(reply.tensors):
            raise ProtocolError(f"stage {reply.name!r} sent a {what} whose keys and tensors differ")
        keys += [str(k) for k in reply.keys]
        tensors += list(reply.tensors)
        if metrics is not None and isinstance(reply.metrics, dict):
            metrics[reply.name] = reply.metrics
    return keys, tensors


def backup_holders(plan: TrainingPlan, replication: str) -> dict[str, str]:
    """Who keeps whose backup under chain or topology replication: the device that
    backs its stage up -> its holder (a device, or COORDINATOR); empty for global."""
    if replication == "topology":
        schedule = asteroid_replication(plan, every=1)
    elif replication == "chain":
        schedule = ftpipehd_replication(plan, chain_every=1, global_every=1)
    else:
        return {}
    return {s.source: s.dest for s in schedule.sends if s.kind in ("chain", "backup")}
