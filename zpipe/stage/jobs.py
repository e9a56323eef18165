"""Requests that run beside the stage's control loop, because they take long.

The lifecycle controller says which request becomes a job and whether a newer one
replaces a running one (:class:`~zpipe.stage.lifecycle.StartJob`); :class:`StageJobs`
runs them as tasks, one per kind at a time, and sends each one's answer: an
assignment's build (:mod:`~zpipe.stage.dataplane`), a profile or a link measurement
(:mod:`~zpipe.stage.measurements`, :mod:`~zpipe.stage.emulated_compute`), weights and
backups (:mod:`~zpipe.stage.snapshots`), a re-partition's phase
(:mod:`~zpipe.stage.executors.async_repartition`). A job that fails is logged; the coordinator's own
deadline covers the answer that does not come.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.log import get_logger
from zpipe.protocol import Message, WireMessage
from zpipe.protocol.repartition import RepartitionRequest
from zpipe.protocol.stage_control import (
    Assign,
    BackupRequest,
    LinkProbeRequest,
    ProfileRequest,
    WeightsRequest,
)
from zpipe.stage.commands import Command, StageJob, StartJob
from zpipe.stage.config import StageConfig
from zpipe.stage.dataplane import DataPlane
from zpipe.stage.emulated_compute import emulated_profile_reply
from zpipe.stage.executors.async_repartition import StageRepartition
from zpipe.stage.measurements import link_probe_reply, profile_reply
from zpipe.stage.snapshots import SnapshotService, request_identity
from zpipe.stage.supervision import describe_error
from zpipe.transport import security

log = get_logger("zpipe.stage")


class StageJobs:
    """The running jobs, by kind, and what each one answers."""

    def __init__(
        self,
        *,
        config: StageConfig,
        context: zmq.asyncio.Context,
        compute: ThreadPoolExecutor,
        keypair: security.KeyPair | None,
        snapshots: SnapshotService,
        repartition: StageRepartition,
        plane: DataPlane,
        send: Callable[[Message], Awaitable[None]],
        carry_out: Callable[[list[Command]], Awaitable[None]],
    ) -> None:
        self.config = config
        self._context = context
        self._compute = compute
        self._keypair = keypair
        self._snapshots = snapshots
        self._repartition = repartition
        self._plane = plane
        self._send = send  # to the coordinator
        self._carry_out = carry_out  # the lifecycle's commands after an assignment
        self._tasks: dict[StageJob, asyncio.Task[None]] = {}
        self._requests: dict[StageJob, tuple[object, ...]] = {}  # what each running job answers

    def start(self, command: StartJob) -> None:
        running = self._tasks.get(command.job)
        request = request_identity(command.message)
        if running is not None and not running.done():
            if not command.newest_wins or self._requests.get(command.job) == request:
                # only one at a time; and a request the coordinator sent again (it may
                # have been lost) is answered by the job already at it
                return
            running.cancel()
        self._requests[command.job] = request
        task = asyncio.create_task(self._run(command.job, command.message))
        task.add_done_callback(lambda done: self._ended(command.job, done))
        self._tasks[command.job] = task

    def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    def _ended(self, job: StageJob, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:  # the coordinator's own deadline covers the missing reply
            log.error(
                "job_failed", stage=self.config.name, job=job.value, error=describe_error(error)
            )

    async def _run(self, job: StageJob, message: WireMessage) -> None:
        config, plane = self.config, self._plane
        name = config.name
        reply: WireMessage
        match job, message:
            case StageJob.ASSIGN, Assign():
                await self._carry_out(await plane.assign(message))
                return
            case StageJob.PROFILE, ProfileRequest() if config.emulate_compute is not None:
                reply = emulated_profile_reply(
                    message,
                    name=name,
                    slowdown=config.slowdown,
                    profile=config.emulate_compute,
                )
            case StageJob.PROFILE, ProfileRequest():
                reply = await profile_reply(
                    message,
                    name=name,
                    slowdown=config.slowdown,
                    compute=self._compute,
                    device=config.resolved_device,
                )
            case StageJob.LINK_PROBE, LinkProbeRequest():
                reply = await link_probe_reply(
                    message,
                    name=name,
                    context=self._context,
                    link=config.link,
                    socket_options=config.socket_options,
                    timeout_s=config.timeouts.reply_s,
                    keypair=self._keypair,
                )
            case StageJob.WEIGHTS, WeightsRequest():
                reply = await self._snapshots.weights_reply(message, plane.trainer, plane.stop)
            case StageJob.BACKUP, BackupRequest():
                reply = await self._snapshots.backup_reply(message, plane.trainer, plane.pace)
            case StageJob.REPARTITION, RepartitionRequest():
                reply = await self._repartition.reply(
                    message, plane.trainer, plane.rewire, plane.allow_senders
                )
            case _:
                raise ProtocolError(f"a {job.value} job cannot answer {message.KIND!r}")
        await self._send(reply.to_message())
