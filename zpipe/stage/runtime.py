"""The stage process: the socket shell around the stage's lifecycle controller.

:class:`~zpipe.stage.lifecycle.StageLifecycle` decides (registration,
assignments, liveness, which data message is computed); this shell owns the
sockets and tasks and carries out the commands it returns:

- control loop: coordinator messages -> controller -> commands (send, start a
  job, connect an assignment, drop, exit);
- heartbeat loop: every interval, the controller says beat or give up;
- bulk loop: the second connection to the coordinator (:mod:`~zpipe.stage.bulk`),
  where weights and backups leave and assignments with tensors arrive in chunks,
  so that nothing big ever queues in front of a heartbeat or a probe's answer;
- what goes to the coordinator, and its clock (:mod:`~zpipe.stage.coordinator_link`);
- jobs beside the control loop (:mod:`~zpipe.stage.jobs`), for requests that take
  long: building an assignment (:mod:`~zpipe.stage.assignment`), profiling and link
  measurement (:mod:`~zpipe.stage.measurements`), weights and backups
  (:mod:`~zpipe.stage.snapshots`);
- data tasks of the running assignment: the data port
  (:mod:`~zpipe.stage.dataport`) feeding the inference loop
  (:mod:`~zpipe.stage.executors.inference`) or the training plane
  (:mod:`~zpipe.stage.executors.training_plane`);
- the run kinds that take the data port from the plane while they last, lossy
  layers and generation (:mod:`~zpipe.stage.run_executors`).

Every long-lived task is supervised (:mod:`~zpipe.stage.supervision`): one
that dies is restarted or, dying again and again, fails the process loudly.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError, TransportTimeout
from zpipe.devices import (
    describe_device,
    free_memory_bytes,
    stage_base_bytes,
    usable_memory_mb,
)
from zpipe.log import get_logger
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup
from zpipe.protocol.stage_control import Register, RegisterAgain
from zpipe.stage.bulk import StageBulk
from zpipe.stage.commands import (
    AllowProbePeers,
    Command,
    ConnectAssignment,
    DropMessage,
    Exit,
    GenerationControl,
    LossyControl,
    Note,
    RestartTask,
    SendToCoordinator,
    StageJob,
    StartJob,
)
from zpipe.stage.config import StageConfig
from zpipe.stage.coordinator_link import CoordinatorLink
from zpipe.stage.dataplane import DataPlane
from zpipe.stage.executors.async_repartition import StageRepartition
from zpipe.stage.held_copies import CopyHolder
from zpipe.stage.jobs import StageJobs
from zpipe.stage.lifecycle import CoordinatorLost, Phase, StageLifecycle
from zpipe.stage.link_watch import link_lag_s, watch_link
from zpipe.stage.linkprobe import ProbeResponder
from zpipe.stage.live_copies import ChainPeer, CopyRoutes
from zpipe.stage.metrics import StageCounters
from zpipe.stage.ports import StageKeys, StagePorts, peer_identity
from zpipe.stage.replicas import ReplicaStore
from zpipe.stage.run_executors import RunExecutors
from zpipe.stage.snapshots import SnapshotService
from zpipe.stage.supervision import TaskSupervisor, describe_error, serve_messages
from zpipe.transport.codec import decode_typed
from zpipe.transport.emulation import SharedUplink
from zpipe.transport.sockets import new_context, recv_frames

__all__ = ["CoordinatorLost", "StageConfig", "StageRuntime"]

log = get_logger("zpipe.stage")


class StageRuntime:
    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.counters = StageCounters()
        # snapshots for chain replication: this stage's own, and peers' backups
        self.replicas = ReplicaStore()
        self._context = new_context()
        self._compute = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"compute-{config.name}"
        )
        self._keys = StageKeys()
        self._ports: StagePorts | None = None
        self._probe_responder: ProbeResponder | None = None
        self._lifecycle: StageLifecycle | None = None
        self._supervisor = TaskSupervisor(config.name, self._task_died)
        self._jobs: StageJobs | None = None  # requests that take long, beside the control loop
        self._link: CoordinatorLink | None = None  # what this stage says to the coordinator
        self._snapshots: SnapshotService | None = None
        self._plane: DataPlane | None = None  # the assignments' data tasks and sockets
        # EdgePipe's lossy layers and LM generation: runs that take the data port
        self._runs: RunExecutors | None = None
        self._bulk: StageBulk | None = None
        # the (emulated) link to the coordinator: control and bulk connections share it
        self._uplink = SharedUplink(config.uplink)
        self._control_uplink = self._uplink.connection()
        self._stopping = asyncio.Event()
        self._exit: Exit | None = None
        self.data_endpoint = ""
        self.probe_endpoint = ""

    # ------------------------------------------------------------------ set-up

    def _open(self) -> None:
        self._keys = StageKeys.load(self._context, self.config)
        ports = StagePorts.open(self._context, self.config, self._keys)
        self._ports = ports
        self.data_endpoint, self.probe_endpoint = ports.data_endpoint, ports.probe_endpoint
        opts, timeouts = self.config.socket_options, self.config.timeouts
        # a chain copy this stage keeps for its upstream peer is announced to the
        # coordinator from here too (the owner may die before its own notice)
        held = CopyHolder(name=self.config.name, timeout_s=timeouts.result_s,
                          counters=self.counters, replicas=self.replicas,
                          announce=self._copy_up)  # fmt: skip
        self._snapshots = SnapshotService(
            name=self.config.name,
            context=self._context,
            keypair=self._keys.keypair,
            socket_options=opts,
            timeout_s=timeouts.result_s,
            compute=self._compute,
            counters=self.counters,
            held=held,
        )
        self._repartition = StageRepartition(
            name=self.config.name, snapshots=self._snapshots, counters=self.counters,
            compute=self._compute, timeout_s=timeouts.result_s,
        )  # fmt: skip
        assert ports.bulk is not None
        self._bulk = StageBulk(
            name=self.config.name,
            socket=ports.bulk,
            uplink=self._uplink.connection(),
            send_timeout_s=timeouts.send_s,
            max_message_bytes=opts.max_message_bytes,
        )
        self._link = CoordinatorLink(
            name=self.config.name,
            control=ports.control,
            bulk=self._bulk,
            uplink=self._control_uplink,
            counters=self.counters,
            send_timeout_s=timeouts.send_s,
        )
        self._probe_responder = ProbeResponder(
            socket=ports.probe_in,
            link=self.config.link,
            name=self.config.name,
            send_timeout_s=timeouts.reply_s,
            max_message_bytes=opts.max_message_bytes,
            peer_handler=self._on_peer_request,
            reopen=ports.reopen_probe_in,  # drops a probe flood's backlog unread
        )
        keypair = self._keys.keypair
        # measured before any model arrives: what the process costs of itself
        base = stage_base_bytes(self.config.resolved_device)
        self._lifecycle = StageLifecycle(
            name=self.config.name,
            coordinator=self.config.coordinator,
            registration=Register(
                name=self.config.name,
                data_endpoint=self.data_endpoint,
                info=registration_info(self.config, self.probe_endpoint, base),
                public_key=keypair.public.decode() if keypair else None,
                base_bytes=base,
            ),
            connect_s=timeouts.connect_s,
            silence_limit_s=timeouts.coordinator_silence_s,
            now=time.monotonic(),
            link_lag_s=link_lag_s(opts),
        )
        self._plane = DataPlane(
            config=self.config,
            context=self._context,
            compute=self._compute,
            counters=self.counters,
            keys=self._keys,
            ports=ports,
            data_endpoint=self.data_endpoint,
            lifecycle=self._lifecycle,
            supervisor=self._supervisor,
            fetch_state=self._snapshots.fetched_state,
            copy_routes=CopyRoutes(to_peer=self._copy_to_peer, to_coordinator=self._copy_up),
        )
        self._runs = RunExecutors(
            config=self.config, context=self._context, keys=self._keys, ports=ports,
            compute=self._compute, supervisor=self._supervisor, send_control=self._link.send,
            plane=self._plane, data_endpoint=self.data_endpoint,
        )  # fmt: skip
        self._jobs = StageJobs(
            config=self.config,
            context=self._context,
            compute=self._compute,
            keypair=keypair,
            snapshots=self._snapshots,
            repartition=self._repartition,
            plane=self._plane,
            send=self._link.send,
            carry_out=self._carry_out,
        )

    @property
    def link(self) -> CoordinatorLink:
        assert self._link is not None, "serve() opens the stage first"
        return self._link

    @property
    def lifecycle(self) -> StageLifecycle:
        assert self._lifecycle is not None, "serve() opens the stage first"
        return self._lifecycle

    # ------------------------------------------------------------ main loops

    async def serve(self) -> None:
        """Run until shut down by the coordinator, a signal, or coordinator loss."""
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        try:
            self._open()  # inside: what a failed start opened is closed again
            log.info(
                "stage_starting",
                stage=self.config.name,
                data_endpoint=self.data_endpoint,
                coordinator=self.config.coordinator,
                threads=torch.get_num_threads(),
                slowdown=self.config.slowdown,
            )
            await self._register()
            log.info(
                "stage_registered",
                stage=self.config.name,
                heartbeat_interval=self.lifecycle.heartbeat_interval_s,
            )
            assert self._probe_responder is not None
            self._supervisor.start("control", self._control_loop)
            self._supervisor.start("heartbeat", self._heartbeat_loop)
            self._supervisor.start("link", self._link_loop)
            self._supervisor.start("bulk", self._bulk_loop)
            self._supervisor.start("probe", self._probe_responder.serve)
            await self._stopping.wait()
            if self._exit is not None and self._exit.error is not None:
                raise self._exit.error
        finally:
            await self.close()

    def stop(self) -> None:
        self._stopping.set()

    async def _copy_to_peer(self, peer: ChainPeer, backup: Backup) -> None:
        """A chain copy made without draining, over the device's one radio."""
        assert self._snapshots is not None and self._plane is not None  # made with these
        await self._snapshots.send_live_copy(peer, backup, self._plane.pace)

    async def _copy_up(self, copy: WireMessage) -> None:
        """A copy for the coordinator (on the bulk connection, in chunks), or a small
        notice (a copy's, a speed verdict) on the control connection."""
        assert self._link is not None  # made before any assignment
        await self._link.send(copy.to_message())

    async def _on_peer_request(
        self, message: WireMessage, sender_key: bytes | None
    ) -> WireMessage | Iterator[WireMessage]:
        """A peer's backup or fetch, judged against the running training plan and the
        name the coordinator gave the sender's key."""
        assert self._snapshots is not None  # made with the probe port that calls this
        trainer = self._plane.trainer if self._plane is not None else None
        sender = peer_identity(self._keys.probe_allow, sender_key)
        return await self._snapshots.held.on_peer_request(message, trainer, sender)

    async def _register(self) -> None:
        """Register until the coordinator answers or ``connect_s`` runs out."""
        lifecycle, ports = self.lifecycle, self._ports
        assert ports is not None
        while lifecycle.phase is Phase.REGISTERING:
            now = time.monotonic()
            left = lifecycle.registration_time_left(now)
            commands = lifecycle.registration_due(now)
            _raise_exit(commands)
            try:
                for command in commands:
                    if isinstance(command, SendToCoordinator):
                        await asyncio.wait_for(self.link.send_command(command), min(left, 1.0))
            except (TransportTimeout, asyncio.TimeoutError):
                continue
            try:
                frames = await recv_frames(
                    ports.control,
                    timeout_s=min(left, 1.0),
                    peer="coordinator",
                    awaited="registration reply",
                )
                reply = decode_typed(
                    frames, max_message_bytes=self.config.socket_options.max_message_bytes
                )
                commands = lifecycle.registration_reply(reply, time.monotonic())
                await self.link.heard(reply)
            except TransportTimeout:
                continue
            except Exception as exc:  # a bad reply: the next attempt may get a good one
                log.warning("dropped_message", peer="coordinator", error=describe_error(exc))
                continue
            _raise_exit(commands)

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            # the first beat at once: its acknowledgement measures the clock offset
            # (timelines) before a run can start
            await self._carry_out(self.lifecycle.heartbeat_due(time.monotonic()))
            await asyncio.sleep(self.lifecycle.heartbeat_interval_s)

    async def _link_loop(self) -> None:
        """Signs of the coordinator's process on the control connection (handshakes,
        drops), which a flood of its receive queue does not hold up."""
        ports = self._ports
        assert ports is not None and ports.control_monitor is not None
        await watch_link(ports.control_monitor, self.lifecycle)

    async def _control_loop(self) -> None:
        ports = self._ports
        assert ports is not None

        async def receive() -> list[zmq.Frame]:
            frames = await recv_frames(
                ports.control, timeout_s=None, peer="coordinator", awaited="control message"
            )
            self.lifecycle.heard_from_coordinator(time.monotonic())
            return frames

        async def handle(frames: list[zmq.Frame]) -> None:
            message = decode_typed(
                frames, max_message_bytes=self.config.socket_options.max_message_bytes
            )
            if isinstance(message, RegisterAgain):
                # A coordinator restarted without our registration, or one that had
                # declared us dead: say so, the lifecycle registers again.
                log.warning("registering_again", stage=self.config.name, reason=message.reason)
            await self.link.heard(message)
            await self._carry_out(self.lifecycle.control_message(message, time.monotonic()))

        await serve_messages(receive, handle, self._control_message_failed)

    async def _bulk_loop(self) -> None:
        """Chunks of the coordinator's bulk (an assignment's state) and its answers to
        ours. Every message is word from the coordinator: a long transfer to this stage
        keeps it from counting the coordinator as silent."""
        ports, bulk = self._ports, self._bulk
        assert ports is not None and ports.bulk is not None and bulk is not None
        socket = ports.bulk

        async def receive() -> list[zmq.Frame]:
            frames = await recv_frames(
                socket, timeout_s=None, peer="coordinator", awaited="bulk message"
            )
            self.lifecycle.heard_from_coordinator(time.monotonic())
            return frames

        async def handle(frames: list[zmq.Frame]) -> None:
            message = decode_typed(
                frames, max_message_bytes=self.config.socket_options.max_message_bytes
            )
            received = bulk.received(message)
            if received.resend is not None:
                await self.link.send(received.resend)
            if received.message is not None:
                now = time.monotonic()
                await self._carry_out(self.lifecycle.control_message(received.message, now))

        await serve_messages(receive, handle, self._control_message_failed)

    def _control_message_failed(self, frames: list[zmq.Frame], exc: Exception) -> None:
        self.counters.dropped += 1
        if isinstance(exc, ProtocolError):
            log.warning(
                "dropped_message", stage=self.config.name, peer="coordinator", error=str(exc)
            )
        else:  # never fatal: the next message is handled as usual
            log.error(
                "message_failed",
                stage=self.config.name,
                peer="coordinator",
                error=describe_error(exc),
            )

    # -------------------------------------------------------- commands

    async def _carry_out(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, SendToCoordinator):
                try:
                    await self.link.send_command(command)
                except TransportTimeout as exc:  # the coordinator's silence is judged apart
                    log.warning(
                        "control_not_sent",
                        stage=self.config.name,
                        kind=command.kind,
                        error=str(exc),
                    )
            elif isinstance(command, StartJob):
                assert self._jobs is not None
                if command.job is StageJob.ASSIGN and self._runs is not None:
                    await self._runs.release_data_port()
                self._jobs.start(command)
            elif isinstance(command, AllowProbePeers):
                # Every cluster member may probe this stage's links; allowed before anyone does.
                if self._keys.probe_allow is not None:
                    self._keys.probe_allow.replace({n: k.encode() for n, k in command.keys.items()})
                if command.fetches is not None and self._snapshots is not None:
                    self._snapshots.held.fetch_grants = command.fetches
            elif isinstance(command, ConnectAssignment):
                assert self._plane is not None
                await self._carry_out(await self._plane.connect(command))
            elif isinstance(command, DropMessage):
                self.counters.dropped += 1
                log.warning(
                    "dropped_message",
                    stage=self.config.name,
                    peer=command.peer,
                    error=command.reason,
                )
            elif isinstance(command, RestartTask):
                self._supervisor.restart(command.name)
            elif isinstance(command, Exit):
                self._exit_with(command)
            elif isinstance(command, Note):
                getattr(log, command.level)(command.event, stage=self.config.name, **command.fields)
            elif isinstance(command, LossyControl):
                assert self._runs is not None
                await self._runs.on_lossy(command)
            elif isinstance(command, GenerationControl):
                assert self._runs is not None
                await self._runs.on_generation(command)

    def _exit_with(self, command: Exit) -> None:
        if command.error is None:
            log.info("stage_shutdown", stage=self.config.name, reason=command.reason)
        else:
            log.error("stage_exiting", stage=self.config.name, error=command.reason)
        if self._exit is None:
            self._exit = command
        self._stopping.set()

    def _task_died(self, name: str, error: BaseException) -> None:
        if self._lifecycle is None:
            return
        commands = self._lifecycle.task_died(name, describe_error(error), time.monotonic())
        for command in commands:  # restarts and exits need no await
            if isinstance(command, RestartTask):
                self._supervisor.restart(command.name)
            elif isinstance(command, Exit):
                self._exit_with(command)

    # --------------------------------------------------------------- shutdown

    async def close(self) -> None:
        if self._lifecycle is not None:
            self._lifecycle.stop_requested("closing")
        if self._runs is not None:
            await self._runs.close()
        if self._plane is not None:
            await self._plane.close()
        if self._jobs is not None:
            self._jobs.cancel()
        await self._supervisor.stop()
        if self._probe_responder is not None:
            await self._probe_responder.close()
        if self._ports is not None:
            self._ports.close()
        self._keys.stop()
        self._compute.shutdown(wait=False, cancel_futures=True)
        self._context.term()


def _raise_exit(commands: list[Command]) -> None:
    """During registration a failure is raised at once: nothing else runs yet."""
    for command in commands:
        if isinstance(command, Exit) and command.error is not None:
            raise command.error


def registration_info(
    config: StageConfig, probe_endpoint: str = "", base: int | None = None
) -> dict[str, Any]:
    """What a stage tells the coordinator of itself when it registers; ``base``: what
    the process holds before any model arrives (its registration's ``base_bytes``)."""
    device = config.resolved_device
    # Measured once, at start: what the planner's memory limit protects. The free
    # memory is what the process may still take: with what it holds (its base) it
    # is the process's whole budget, as --memory-mb is (zpipe.planner.memory).
    free = free_memory_bytes(device)
    reach = free + base if free is not None and base is not None else free
    return {
        "pid": os.getpid(),
        "cores": os.cpu_count() or 1,
        "threads": torch.get_num_threads(),
        "slowdown": config.slowdown,
        "memory_mb": usable_memory_mb(reach, config.memory_mb),
        # what the operator declared, apart from the measured memory above: devices
        # that declare alike are planned alike (zpipe.coordinator.planning)
        "declared_memory_mb": config.memory_mb,
        "device": describe_device(device, free_bytes=free),
        "link": config.link.to_dict(),
        "probe_endpoint": probe_endpoint,
        "torch": torch.__version__,
        **({"emulated_compute": True} if config.emulate_compute is not None else {}),
    }
