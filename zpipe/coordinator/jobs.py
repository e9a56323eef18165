"""The shell's side of the coordinator's jobs: gathers from stages, planning off the loop.

A controller yields a :class:`~zpipe.coordinator.commands.ShellJob` when it needs
something that takes I/O or seconds of CPU; :class:`JobRunner` carries it out
and its result comes back to the controller as one event. What to ask, of whom,
and what to do with the answer stay the controller's.

Planning (the PipeEdge DP, HPP) runs in a thread (``asyncio.to_thread``), so the
event loop keeps answering heartbeats while it plans.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from zpipe._errors import ConfigError, InfeasiblePlanError
from zpipe.config import Timeouts
from zpipe.coordinator.commands import (
    AllowPeers,
    AwaitConfirmed,
    AwaitSettled,
    AwaitStages,
    CountUnits,
    MeasureLinks,
    PlanInference,
    PlanLossy,
    PlanTraining,
    SaveReplica,
    ShellJob,
    TrainingModel,
)
from zpipe.coordinator.decisions import pick_stages
from zpipe.coordinator.links import LinkMeasurer
from zpipe.coordinator.membership import Member, MemberState
from zpipe.coordinator.persistence import StateStore
from zpipe.coordinator.planning import choose_plan, cluster_from_members
from zpipe.coordinator.runs.async_copies import SaveCopy
from zpipe.coordinator.state import ControlState
from zpipe.log import get_logger
from zpipe.lossy.mapping import partition_and_map
from zpipe.models import ModelSpec
from zpipe.planner import ClusterLink, ClusterSpec
from zpipe.planner.hpp import plan_training
from zpipe.planner.profile import ModelProfile, training_profile_sizes
from zpipe.protocol import WireMessage
from zpipe.protocol.stage_control import ProfileReply, ProfileRequest

log = get_logger("zpipe.coordinator")

# request(member, message, reply class, timeout_s) -> the member's reply (of that class)
Request = Callable[[Member, WireMessage, type[Any], float], Awaitable[Any]]

# How often a wait for stages (to register, to speak again after a restart) looks again.
_POLL_S = 0.05


class JobRunner:
    def __init__(
        self,
        state: ControlState,
        request: Request,
        links: LinkMeasurer,
        *,
        measure_links: bool,
        store: StateStore | None,
    ) -> None:
        self.state = state
        self._request = request
        self._links = links
        self._measure_links = measure_links
        self._store = store

    @property
    def timeouts(self) -> Timeouts:
        return self.state.timeouts

    async def run(self, job: ShellJob) -> Any:
        if isinstance(job, AwaitStages):
            return await self._await_stages(job)
        if isinstance(job, CountUnits):
            return await asyncio.to_thread(_count_units, job.spec, job.declared)
        if isinstance(job, AwaitConfirmed):
            return await self._await_confirmed(job.names)
        if isinstance(job, AwaitSettled):
            return await self._await_settled(job.names)
        if isinstance(job, PlanInference):
            return await self._plan_inference(job)
        if isinstance(job, PlanTraining):
            return await self._plan_training(job)
        if isinstance(job, PlanLossy):
            return await asyncio.to_thread(
                partition_and_map,
                job.layer_sizes,
                job.allocation,
                job.n_devices,
                job.prr,
                mapping=job.mapping,
                seed=job.seed,
                cnn=job.cnn,
                conv_devices=job.conv_devices,
            )
        if isinstance(job, TrainingModel):
            return await self._training_model(job.spec, list(job.members), job.microbatch_size)
        if isinstance(job, MeasureLinks):
            if not self._measure_links or len(job.members) < 2:
                return {}
            return await self._links.remeasure(list(job.members))
        if isinstance(job, AllowPeers):
            await self._links.allow_peers(list(job.members), job.fetches)
            return None
        if isinstance(job, SaveReplica):
            assert self._store is not None
            return await asyncio.to_thread(self._store.save_replica, job.replica)
        if isinstance(job, SaveCopy):
            assert self._store is not None
            copy = job.copy
            return await asyncio.to_thread(self._store.save_copy, copy.record, copy.state)
        raise TypeError(f"unknown job {job!r}")

    async def _await_stages(self, job: AwaitStages) -> list[Member]:
        """The stages for a run, waiting up to ``wait_s`` for enough to register."""
        deadline = time.monotonic() + float(job.wait_s)
        while True:
            chosen = pick_stages(self.state.membership, job.names, job.count)
            if not isinstance(chosen, str):
                # A member restored from disk is taken once it spoke to this process (or
                # was declared dead): a coordinator restarted a moment ago has not heard
                # from it yet, and its connection may not be there to assign it.
                unheard = any(m.name in self.state.unconfirmed for m in chosen)
                if not unheard or time.monotonic() >= deadline:
                    return chosen
            elif time.monotonic() >= deadline:
                raise InfeasiblePlanError(f"{chosen} after waiting {job.wait_s} s")
            await asyncio.sleep(_POLL_S)

    async def _await_confirmed(self, names: Sequence[str]) -> None:
        """Wait until restored members among ``names`` spoke or were declared dead."""
        t = self.timeouts
        wait_s = (t.suspect_after_intervals + t.probe_intervals + 1) * t.heartbeat_interval_s
        deadline = time.monotonic() + wait_s
        while True:
            if not any(n in self.state.unconfirmed for n in names) or time.monotonic() >= deadline:
                return
            await asyncio.sleep(_POLL_S)

    async def _await_settled(self, names: Sequence[str]) -> None:
        """Wait until none of ``names`` is suspect (answered, or declared dead)."""
        membership = self.state.membership

        def suspects() -> list[str]:
            found = (membership.get(n) for n in names)
            return [m.name for m in found if m is not None and m.state is MemberState.SUSPECT]

        pending = suspects()
        if not pending:
            return
        # Each is judged by its own probe deadline at the latest (adaptive: a stage
        # whose heartbeats came late is given longer); a tick or two more to be judged.
        wait_s = max(sum(membership.deadlines(n)) for n in pending)
        deadline = time.monotonic() + wait_s + 2 * self.timeouts.heartbeat_interval_s
        while True:
            if not suspects() or time.monotonic() >= deadline:
                return
            await asyncio.sleep(_POLL_S)

    async def _plan_inference(self, job: PlanInference) -> Any:
        members = list(job.members)
        names = [m.name for m in members]
        profile: ModelProfile | None = None
        cluster: ClusterSpec | None = None
        if job.partition is None and job.profile is not None:
            profile = ModelProfile.from_dict(job.profile, source="the run's profile")
            cluster = cluster_from_members(
                members,
                links=await self._measured_links(members),
                margin=self.state.memory_margin,
            )
        elif job.partition is None and job.algo != "even":
            profiles = await self._profiles_of(members, job.spec, job.batch_size, job.dtype)
            profile = profiles[names[0]]
            cluster = cluster_from_members(
                members,
                profiles,
                links=await self._measured_links(members),
                margin=self.state.memory_margin,
            )
        return await asyncio.to_thread(
            choose_plan,
            algo=job.algo,
            num_units=job.num_units,
            names=names,
            partition=job.partition,
            profile=profile,
            cluster=cluster,
            batch_size=job.batch_size,
            bucketing=job.bucketing,
        )

    async def _plan_training(self, job: PlanTraining) -> Any:
        """Plan a training run from every stage's own training profile and measured links."""
        members = list(job.members)
        profile, cluster = await self._training_model(job.spec, members, job.microbatch_size)
        plan = await asyncio.to_thread(
            plan_training,
            profile,
            cluster,
            microbatch_size=job.microbatch_size,
            num_microbatches=job.num_microbatches,
            algo=job.algo,
            schedule=job.schedule,
            optimizer=job.optimizer,
            devices=[m.name for m in members],
        )
        log.info("training_planned", plan=plan.to_dict())
        return plan

    async def _training_model(
        self, spec: ModelSpec, members: list[Member], batch: int
    ) -> tuple[ModelProfile, ClusterSpec]:
        """The training profile and the cluster (profiled devices, measured links)."""
        profiles = await self._profiles_of(members, spec, batch, "float32", train=True)
        links = await self._measured_links(members)
        cluster = cluster_from_members(
            members, profiles, links=links, margin=self.state.memory_margin, training=True
        )
        return profiles[members[0].name], cluster

    async def _measured_links(self, members: list[Member]) -> dict[tuple[str, str], ClusterLink]:
        if not self._measure_links or len(members) < 2:
            return {}
        measured = await self._links.measure(members)
        return {pair: link.as_cluster_link() for pair, link in measured.items()}

    async def _profiles_of(
        self,
        members: list[Member],
        spec: ModelSpec,
        batch_size: int,
        dtype: str,
        *,
        train: bool = False,
    ) -> dict[str, ModelProfile]:
        """Each stage's own profile of the model, cached until the stage registers again.

        All stages profile at once: on separate devices that costs nothing, and
        stages that share one machine then measure under the same contention for
        its cores that they will see while the pipeline runs.
        """
        profiles = await asyncio.gather(
            *(self._profile_of(m, spec, batch_size, dtype, train) for m in members)
        )
        return {m.name: p for m, p in zip(members, profiles, strict=True)}

    async def _profile_of(
        self, member: Member, spec: ModelSpec, batch_size: int, dtype: str, train: bool
    ) -> ModelProfile:
        cache = self.state.profiles
        cached = cache.get(spec, batch_size, dtype, member, train=train)
        if cached is not None:
            return cached
        request = profile_request(member, spec, batch_size, dtype, train=train)
        reply: ProfileReply = await self._request(
            member, request, ProfileReply, self.timeouts.assign_s
        )
        if reply.profile is None:
            raise ConfigError(f"stage {member.name!r} could not profile: {reply.error}")
        profile = ModelProfile.from_dict(reply.profile, source=f"{member.name}'s profile")
        cache.put(spec, batch_size, dtype, member, profile, train=train)
        log.info(
            "stage_profiled", stage=member.name, forward_s=round(sum(profile.times(batch_size)), 4)
        )
        return profile


def profile_request(
    member: Member, spec: ModelSpec, batch_size: int, dtype: str, *, train: bool
) -> ProfileRequest:
    """What ``member`` is asked to profile. A training profile covers 1, B/4, B/2 and B
    (the planner splits micro-batches across data-parallel groups) for a stage that
    reported its device at registration: an older stage would refuse the field."""
    sizes = training_profile_sizes(batch_size) if train and "device" in member.info else None
    return ProfileRequest(
        model=spec.to_dict(),
        batch_size=batch_size,
        dtype=dtype,
        repeats=3,
        train=train,
        batch_sizes=sizes,
    )


def _count_units(spec: ModelSpec, declared: int | None) -> int:
    """The model's unit count without running user code when the client declared it;
    a client that did not (an older one) gets it counted only for a factory this
    process allows (--allow-factory), as for any peer's spec."""
    # the registry builds layers with torch: imported at the first run's plan
    from zpipe.models.registry import USER_CODE_FAMILIES, count_units, load_layer_sequence

    if declared is not None or spec.family not in USER_CODE_FAMILIES:
        return count_units(spec, declared=declared)
    return load_layer_sequence(spec).num_units
