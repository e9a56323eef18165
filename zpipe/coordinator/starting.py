"""Starting a run: from a client's ``run_request`` to a run controller and ``run_ready``.

    run_request ─> check the request ─> (resume: the replica; fast consistency: the
    survivors' newest state; re-plan without the dead) ─> the stages (waiting for
    them to register) ─> plan (profiles and links gathered, planner off the loop)
    ─> an InferenceController or a SyncTrainingController ─> assignments ─> run_ready

A new run's id and plan epoch are saved (with a state directory) before any stage
hears them, as generation and lossy runs' are. Replies are matched by run id: a
coordinator restarted after assigning a run it had not saved would give the
next request the same id, and a stage's ``ready`` for the lost assignment,
queued while the coordinator was away, could answer the new one. The run itself
is saved once every stage is ready (``Run.changing`` until then: the file keeps
no run, and a request sent again starts it anew).

A flow (:mod:`zpipe.coordinator.flows`): pure, driven by events.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from zpipe._errors import ConfigError, ZpipeError
from zpipe.coordinator.commands import (
    AllowPeers,
    AwaitReplies,
    AwaitSettled,
    AwaitStages,
    CountUnits,
    Log,
    Persist,
    PlanInference,
    PlanTraining,
    Send,
)
from zpipe.coordinator.current_run import KeptReplica, Run
from zpipe.coordinator.decisions import (
    RestoreChoice,
    check_plan_fits_model,
    fetch_grants,
    live_members,
    replica_to_resume,
    training_planner_for,
    units_state,
)
from zpipe.coordinator.flows import Flow
from zpipe.coordinator.membership import Member
from zpipe.coordinator.planning import bucketing_of
from zpipe.coordinator.restoring import allow_fetches, choose_restore, units_moved
from zpipe.coordinator.resuming import broken_run_stages, fast_replica, replan_training
from zpipe.coordinator.runs.async_fast_recovery import async_fast_resume, is_fast_live_resume
from zpipe.coordinator.runs.async_speed import forward_watch_of
from zpipe.coordinator.runs.async_training import (
    AsyncTrainingController,
    as_async_plan,
    planning_schedule,
)
from zpipe.coordinator.runs.inference import InferenceController
from zpipe.coordinator.runs.sync_balance import memory_model
from zpipe.coordinator.runs.sync_training import SyncTrainingController, backup_holders
from zpipe.coordinator.sink_check import check_sink_reachable
from zpipe.coordinator.state import CLIENT_NAME, ControlState
from zpipe.models import ModelSpec
from zpipe.planner import Plan
from zpipe.planner.async_schedule import ASYNC_SCHEDULE, AsyncSettings
from zpipe.planner.plan import StagePlan
from zpipe.planner.training_plan import TRAINING_ALGOS, TrainingPlan, TrainStage
from zpipe.protocol.client_control import RunFailed, RunReady, RunRequest
from zpipe.protocol.stage_control import Assign, AssignFailed, Ready
from zpipe.recovery import POLICIES as RECOVERY_POLICIES
from zpipe.recovery import REPLICATIONS, StageSpan
from zpipe.training.objectives import check_train_settings


def chain_routes(
    groups: list[Any], index: int, by_name: dict[str, Member], key_of: Any
) -> dict[str, Any]:
    """The ``train`` settings of stage ``index`` for copies made without draining: who
    backs up to it (its upstream) and where its own chain copies go (the next stage's
    probe socket; none for the last stage, whose chain copy goes to the coordinator)."""
    out: dict[str, Any] = {}
    if index > 0:
        out["backup_from"] = [groups[index - 1][0][0]]
    if index + 1 < len(groups):
        nxt = by_name[groups[index + 1][0][0]]
        out["chain_to"] = {
            "name": nxt.name,
            "endpoint": str(nxt.info["probe_endpoint"]),
            "key": key_of(nxt.name),
        }
    return out


def run_request(
    state: ControlState, routing_id: bytes, user_key: str | None, request: RunRequest
) -> Flow:
    """Start the run a ``run_request`` asks for; returns the answer: ``run_ready`` once
    every stage is ready, or ``run_failed`` (:mod:`~zpipe.coordinator.admission`
    sends it to whoever asked)."""
    try:
        ready = yield from _start_run(state, routing_id, user_key, request)
    except Exception as exc:  # whatever it was, the client hears that its run failed
        if not isinstance(exc, (ZpipeError, ValueError)):
            yield Log("error", "run_start_crashed", {"error": repr(exc)})
        state.current = None
        yield Persist()
        yield Log("error", "run_failed", {"error": str(exc)})
        return RunFailed(error=str(exc))
    current = state.current
    if current is not None and current.run.run == ready.run:
        # kept (and saved) with the run: the request sent again gets this answer
        current.run.request_id = request.request_id
        current.run.ready = ready
        current.run.settle()  # every stage is ready: the run is saved from now on
    yield Persist()
    return ready


def _await_stages(request: RunRequest, names: Any = None) -> AwaitStages:
    """The stages a request names (or counts), waited for up to ``wait_for_stages_s``."""
    if names is None:
        names = request.stage_names
    count = request.stages
    if count is None and request.partition is not None:
        count = len(request.partition)
    return AwaitStages(
        None if names is None else tuple(str(n) for n in names),
        None if count is None else int(count),
        request.wait_for_stages_s,
    )


def _check_request(request: RunRequest) -> str:
    mode = request.run_mode
    if mode not in ("infer", "train"):
        raise ConfigError(f"unknown run mode {mode!r}; use infer or train")
    recovery = request.recovery_policy
    if recovery not in RECOVERY_POLICIES:
        raise ConfigError(
            f"unknown recovery {recovery!r}; choose one of {', '.join(RECOVERY_POLICIES)}"
        )
    replication = request.replication_kind
    if replication not in REPLICATIONS:
        raise ConfigError(
            f"unknown replication {replication!r}; choose one of {', '.join(REPLICATIONS)}"
        )
    rebalance = request.rebalance
    if rebalance is not None and not 0 < rebalance < 1:
        raise ConfigError(f"rebalance must lie in (0, 1), got {rebalance}")
    return str(mode)


def _start_run(
    state: ControlState, routing_id: bytes, client_key: str | None, request: RunRequest
) -> Flow:
    if state.current is not None:
        yield Log("warning", "run_replaced", {"previous": state.current.run.run})
    spec = ModelSpec.from_dict(request.model)
    mode = _check_request(request)
    num_units = yield CountUnits(spec, request.num_units)
    recovery = request.recovery_policy
    settings = request.train_settings
    replica = None
    start = _Training(state, routing_id, client_key, spec)
    if mode == "train" and request.resume is not None:
        # The client reported the broken run stalled before it asked to resume: every
        # stage of the run is suspect until it answers its probe (core._stalled), and
        # one planned out now would be a live survivor taken for dead.
        yield AwaitSettled(broken_run_stages(state, request))
    if mode == "train" and is_fast_live_resume(request.resume):
        # an asynchronous run with live copies, FTPipeHD's way: the survivors keep
        # their weights, the dead's units come from their nearest copy
        fast = yield from async_fast_resume(state, request)
        request = replace(request, stage_names=list(fast.plan.devices))
        ready = yield from start.assign(request, fast.plan, restore=fast.restore)
        report = {**fast.fast.summary(), "sources": [s.to_dict() for s in fast.fast.sources]}
        return replace(ready, fast_recovery=report)
    if mode == "train" and request.resume is not None:
        resume = dict(request.resume)
        replica = replica_to_resume(state.replica, resume, num_units)
        names = request.stage_names
        if names is not None:
            # Stages that died with the one the client heard of (not yet declared when
            # it asked) are left out too, rather than waited for.
            alive = {m.name for m in live_members(state.membership)}
            dead = set(resume.get("dead") or [])
            kept = [n for n in names if n in alive and n not in dead]
            request = replace(request, stage_names=kept)
        if resume.get("consistency") == "fast":
            replica = yield from fast_replica(state, replica, request)
        if recovery != "heavy" and settings.get("plan") is None:
            given = yield from replan_training(state, replica, str(recovery), request, spec)
            return (yield from start.assign(request, given, replica=replica))
    if mode == "train" and settings.get("plan") is not None:
        given = TrainingPlan.from_dict(settings["plan"])
        check_plan_fits_model(spec.family, given)
        return (yield from start.assign(request, given, replica=replica))
    members = yield _await_stages(request)
    algo = request.planner_name
    if mode == "train" and algo in TRAINING_ALGOS and request.partition is None:
        algo = training_planner_for(spec.family, algo)
        batch = request.microbatch_size
        if batch is None:
            raise ConfigError(f"planner {algo!r} needs the micro-batch size (microbatch_size)")
        checked = check_train_settings(settings, 1)
        planned = yield PlanTraining(
            spec,
            tuple(members),
            int(batch),
            int(checked["num_microbatches"]),
            algo=algo,
            schedule=planning_schedule(str(checked["schedule"])),
            optimizer=memory_model(checked["optimizer"]),
        )
        if checked["schedule"] == ASYNC_SCHEDULE:
            planned = as_async_plan(planned)
        return (yield from start.assign(request, planned, replica=replica))
    plan, baseline = yield PlanInference(
        spec,
        num_units,
        tuple(members),
        algo=algo,
        partition=request.partition,
        batch_size=request.microbatch_size_or(),
        dtype=request.dtype,
        profile=request.profile,
        bucketing=bucketing_of(request.bucketing_mode),
    )
    if mode == "train":
        return (yield from start.assign(request, None, straight=plan, replica=replica))
    members = [m for m in members if m.name in plan.devices]
    last = next(m for m in members if m.name == plan.stages[-1].device)
    check_sink_reachable(request.sink_endpoint, {last.name: last.data_endpoint}, state.local_hosts)
    epoch, counter = state.next_epoch(), state.next_run()
    yield Persist()  # ids saved before any stage hears them: see the module notes
    run = Run(
        run=counter,
        epoch=epoch,
        client=routing_id,
        plan=plan,
        client_key=client_key,
        request=request,
        recover=bool(request.recover),
        changing=True,  # saved once every stage is ready
    )
    controller = InferenceController(state, run, spec)
    state.current = controller
    yield Log(
        "info",
        "run_planned",
        {
            "run": run.run,
            "epoch": run.epoch,
            "plan": plan.to_dict(),
            "baseline": baseline.to_dict() if baseline is not None else None,
        },
    )
    by_name = {m.name: m for m in members}
    yield from controller.assign(by_name, request)
    return controller.ready_message(by_name, baseline)


class _Training:
    """Assigning a training run: a plan of device groups, or a straight pipeline."""

    def __init__(
        self, state: ControlState, routing_id: bytes, client_key: str | None, spec: ModelSpec
    ) -> None:
        self.state = state
        self.routing_id = routing_id
        self.client_key = client_key
        self.spec = spec

    def assign(
        self,
        request: RunRequest,
        given: TrainingPlan | None,
        *,
        straight: Plan | None = None,
        replica: KeptReplica | None = None,
        restore: RestoreChoice | None = None,
    ) -> Flow:
        """With ``replica``, every stage starts from its units' state in it; with
        ``restore`` (a fast recovery's), from where it says."""
        state, spec = self.state, self.spec
        settings = request.train_settings
        # The user's plan or warm-ups are kept as given; a plan the coordinator made takes
        # the counts of the run's warm-up policy (zpipe.training.warmup).
        own_counts = settings.pop("plan", None) is not None or settings.get("warmups") is not None
        if given is not None:
            num_units = yield CountUnits(spec, request.num_units)
            if given.num_units != num_units:
                raise ConfigError(
                    f"the training plan covers {given.num_units} units, the model has {num_units}"
                )
            settings["schedule"] = given.schedule
            settings["num_microbatches"] = given.num_microbatches
            settings["warmups"] = given.warmups if own_counts else None
            members = yield _await_stages(request, names=given.devices)
            groups = [(list(st.devices), st.start, st.end, list(st.shares)) for st in given.stages]
            source: Plan | TrainingPlan = given
        else:
            assert straight is not None
            members = yield _await_stages(request)
            groups = [([st.device], st.start, st.end, [1]) for st in straight.stages]
            source = straight
        by_name = {m.name: m for m in members}
        live = {m.name: m for m in live_members(state.membership)}
        live.update(by_name)
        if restore is not None:
            yield Log("info", "restore_planned", {"recovery": "fast", **units_moved(restore)})
        elif replica is not None:
            spans = [StageSpan(tuple(g[0]), g[1], g[2]) for g in groups]
            restore = yield from choose_restore(state, replica, request, spans, live)
            if restore.fell_back:
                # the learning-rate schedule goes on from the global copy's mini-batch
                settings["start_step"] = (request.resume or {})["global"]["start_step"]
        training = check_train_settings(settings, len(groups))
        if given is not None and training["warmups"] != given.warmups:
            given = replace(
                given,
                stages=tuple(
                    replace(st, warmup=w)
                    for st, w in zip(given.stages, training["warmups"], strict=True)
                ),
            )
        check_sink_reachable(
            request.sink_endpoint,
            {n: by_name[n].data_endpoint for n in groups[-1][0]},
            state.local_hosts,
        )
        epoch, counter = state.next_epoch(), state.next_run()
        yield Persist()  # ids saved before any stage hears them: see the module notes
        view = Plan(
            algo=source.algo,
            num_units=groups[-1][2],
            stages=tuple(StagePlan(g[0][0], g[1], g[2]) for g in groups),
            predicted=dict(source.predicted),
        )
        run = Run(
            run=counter,
            epoch=epoch,
            client=self.routing_id,
            plan=view,
            client_key=self.client_key,
            devices=[d for g in groups for d in g[0]],
            groups=[list(g[0]) for g in groups],
            client_progress=bool(request.progress),
            changing=True,  # saved once every stage is ready
        )
        asynchronous = training["schedule"] == ASYNC_SCHEDULE
        controller_kind = AsyncTrainingController if asynchronous else SyncTrainingController
        controller = controller_kind(state, run)
        state.current = controller
        yield Log(
            "info",
            "run_planned",
            {"run": run.run, "epoch": run.epoch, "mode": "train", "groups": groups},
        )
        if restore is not None:
            allow_fetches(restore, live, controller.key_of)
            if any(e["from"] != d for d, es in restore.fetches.items() for e in es):
                # Stages fetch units from each other's probe sockets: allowed
                # beforehand, each holder told who fetches what (it answers nothing else).
                yield AllowPeers(tuple(live.values()), fetch_grants(restore.fetches))
                state.fetch_grants_out = True  # until the next backup revokes them
            if isinstance(controller, SyncTrainingController):
                controller.fallback = restore.replica.newest_global()
        client = {
            "names": [CLIENT_NAME],
            "shares": [1],
            "endpoints": [request.sink_endpoint],
            "keys": [controller.key_of(CLIENT_NAME)],
        }

        def side(i: int) -> dict[str, Any]:
            if i < 0 or i >= len(groups):
                return client
            names, _, _, shares = groups[i]
            return {
                "names": names,
                "shares": shares,
                "endpoints": [by_name[n].data_endpoint for n in names],
                "keys": [controller.key_of(n) for n in names],
            }

        tplan = (
            given
            if given is not None
            else TrainingPlan(
                algo=view.algo,
                schedule=training["schedule"],
                num_units=view.num_units,
                microbatch_size=1,
                num_microbatches=training["num_microbatches"],
                stages=tuple(
                    TrainStage((n[0],), a, b, (1,), w)
                    for (n, a, b, _), w in zip(groups, training["warmups"], strict=True)
                ),
                predicted=dict(view.predicted),
            )
        )
        # Who backs up to whom (chain, topology): a stage keeps backups only from these.
        replication = request.replication_kind
        holders = backup_holders(tplan, replication)
        live_copies = asynchronous and AsyncSettings.from_dict(training.get("async")).live_copies
        if live_copies and state.public_keys:
            # the chain copies reach the next stage's probe socket: allowed beforehand
            yield AllowPeers(tuple(by_name[n] for g in groups for n in g[0]))
        for i, (names, start, end, shares) in enumerate(groups):
            for rank, name in enumerate(names):
                up, down = side(i - 1), side(i + 1)
                train = {
                    "schedule": training["schedule"],
                    "num_microbatches": training["num_microbatches"],
                    "warmup": training["warmups"][i],
                    "loss": training["loss"],
                    "optimizer": training["optimizer"],
                    "lr_schedule": training["lr_schedule"],
                    "start_step": training["start_step"],
                    "resume_optimizer": training["resume_optimizer"],
                    # the keys: a rank binds its ring port (admitting the rank
                    # before it) when assigned, before "connect" names the ring
                    "group": {
                        "names": names,
                        "shares": shares,
                        "rank": rank,
                        "keys": [controller.key_of(n) for n in names],
                    },
                    "upstream": up,
                    "downstream": down,
                }
                if "async" in training:
                    train["async"] = training["async"]
                if asynchronous and forward_watch_of(request) is not None:
                    train["forward_watch"] = forward_watch_of(request)  # async_speed
                if holders:
                    train["backup_from"] = sorted(o for o, h in holders.items() if h == name)
                if live_copies:
                    # chain copies without draining: each stage keeps its upstream's
                    # and sends its own to the next stage (the last: to the coordinator)
                    train.update(chain_routes(groups, i, by_name, controller.key_of))
                tensors: dict[str, Any] = {}
                fetch = None
                if restore is not None:
                    # only what no stage holds nearer comes from here
                    for a, b in restore.from_coordinator.get(name, []):
                        tensors.update(units_state(restore.replica.state, a, b))
                    fetch = restore.fetches.get(name) or None
                assign = Assign(
                    mode="train",
                    train=train,
                    run=run.run,
                    model=spec.to_dict(),
                    start=start,
                    end=end,
                    index=i,
                    num_stages=len(groups),
                    upstream=up["names"][0],
                    upstream_key=up["keys"][0],
                    downstream=down["names"][0],
                    downstream_endpoint=down["endpoints"][0],
                    downstream_key=down["keys"][0],
                    dtype="float32",
                    state_keys=None if restore is None else list(tensors),
                    fetch=fetch,
                    tensors=tuple(tensors.values()),
                    epoch=run.epoch,
                )
                yield Send(by_name[name].routing_id, assign, name, stage=name)
        replies: dict[str, Ready] = yield AwaitReplies(
            tuple(run.devices),
            Ready,
            state.timeouts.assign_s,
            "ready after assignment",
            run=run.run,
            fail=AssignFailed,
        )
        for name, reply in replies.items():
            if reply.ring_endpoint:
                run.ring_endpoints[name] = str(reply.ring_endpoint)
        run.training_plan = tplan
        run.request = request
        run.rebalance = request.rebalance
        run.replication = replication
        first, last = groups[0][0], groups[-1][0]
        # Each first-stage device (several in a data-parallel first stage) takes its share
        # of every micro-batch on its own data port, under its own limit (its
        # --max-batch-rows): the client checks each share against its device's.
        first_limits = {
            n: int(limit) for n in first if (limit := replies[n].max_message_bytes) is not None
        }
        resumed = None
        if restore is not None and restore.fell_back:
            # the replica's global fallback was resumed from: the client replays more
            resumed = {"run": restore.replica.run, "step": restore.replica.step}
        return RunReady(
            run=run.run,
            plan=view.to_dict(),
            baseline=None,
            first_endpoint=by_name[first[0]].data_endpoint,
            first_stage=first[0],
            first_key=controller.key_of(first[0]),
            last_stage=last[0],
            last_key=controller.key_of(last[0]),
            last_endpoint=by_name[last[0]].data_endpoint,
            training_plan={
                **tplan.to_dict(),
                "endpoints": {n: by_name[n].data_endpoint for n in run.devices},
                "keys": {n: controller.key_of(n) for n in run.devices},
                "first_limits": first_limits,
            },
            # the client refuses inputs the first stage's data ports would drop; the
            # smallest limit, which a client that reads no first_limits checks every share
            # against (never one that a device's port would exceed)
            first_max_message_bytes=min(first_limits.values()) if first_limits else None,
            resumed=resumed,
            epoch=run.epoch,
        )
