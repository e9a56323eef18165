"""The run kinds that take a stage's data port from its data plane while they last.

EdgePipe's lossy layers (:mod:`zpipe.stage.executors.lossy`) and causal LM
generation (:mod:`zpipe.stage.executors.generation`) receive on the same data port
as the plane's inference and training assignments
(:mod:`zpipe.stage.dataplane`), so only one of them may hold it: a lossy run or an
assignment starting releases a generation run's hold, and each executor stops the
plane's data tasks before it reads. Built together, told their coordinator's
control messages, closed with the stage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypedDict

import zmq.asyncio

from zpipe.log import get_logger
from zpipe.protocol.generation import GenSetup
from zpipe.protocol.lossy import LossyProbeRequest, LossySetup
from zpipe.stage.assignment import PushConnector, generation_sender_endpoints, push_connector
from zpipe.stage.commands import GenerationControl, LossyControl
from zpipe.stage.config import StageConfig
from zpipe.stage.dataplane import DataPlane
from zpipe.stage.executors.generation import GenerationExecutor
from zpipe.stage.executors.lossy import LossyExecutor
from zpipe.stage.ports import StageKeys, StagePorts
from zpipe.stage.supervision import TaskSupervisor
from zpipe.transport.address_auth import peer_addresses
from zpipe.transport.codec import Message
from zpipe.transport.security import PeerAllowList
from zpipe.transport.sockets import ReceiveLimits

log = get_logger("zpipe.stage")


class _DataPortAccess(TypedDict):
    """The keyword arguments the lossy and the generation executor share (typed, so
    each call is checked against both constructors)."""

    name: str
    data_in: Callable[[], zmq.asyncio.Socket]
    data_allow: PeerAllowList | None
    connector: PushConnector
    compute: ThreadPoolExecutor
    supervisor: TaskSupervisor
    send_control: Callable[[Message], Awaitable[None]]
    stop_data: Callable[[], Awaitable[None]]
    apply_limits: Callable[[ReceiveLimits], Awaitable[None]]
    max_message_bytes: int
    send_timeout_s: float


class RunExecutors:
    """The lossy and the generation executor of one stage process."""

    def __init__(
        self,
        *,
        config: StageConfig,
        context: zmq.asyncio.Context,
        keys: StageKeys,
        ports: StagePorts,
        compute: ThreadPoolExecutor,
        supervisor: TaskSupervisor,
        send_control: Callable[[Message], Awaitable[None]],
        plane: DataPlane,
        data_endpoint: str,
    ) -> None:
        self._name = config.name
        self._keys = keys
        self._data_endpoint = data_endpoint
        opts, timeouts = config.socket_options, config.timeouts
        # what both take of the stage: the same data port, peers, threads and plane
        shared = _DataPortAccess(
            name=config.name,
            data_in=lambda: ports.data_in,  # reopened when a plan changes its limits
            data_allow=keys.data_allow,
            connector=push_connector(context, opts, keys.keypair),
            compute=compute,
            supervisor=supervisor,
            send_control=send_control,
            stop_data=plane.stop,
            apply_limits=plane.apply_limits,
            max_message_bytes=opts.max_message_bytes,
            send_timeout_s=timeouts.send_s,
        )
        self.lossy = LossyExecutor(**shared, data_addresses=keys.data_addresses)
        self.generation = GenerationExecutor(
            **shared, device=config.resolved_device, slowdown=config.emulated_slowdown()
        )

    async def release_data_port(self) -> None:
        """An assignment takes the data port: a generation run lets it go."""
        await self.generation.release()

    async def on_lossy(self, command: LossyControl) -> None:
        if isinstance(command.message, (LossySetup, LossyProbeRequest)):
            await self.generation.release()  # the lossy run takes the data port
        await self.lossy.on_control(command.message)

    async def on_generation(self, command: GenerationControl) -> None:
        if isinstance(command.message, GenSetup):
            self._admit_generation_senders(command.message)
        await self.generation.on_control(command.message)

    def _admit_generation_senders(self, setup: GenSetup) -> None:
        """Without keys, the hosts a generation set-up names as this stage's senders:
        its upstream stage (the first stage's is the last one, closing the ring) and,
        for the first stage, the client. A coordinator that names none (before
        ``upstream_endpoint``) leaves the port open to every host while the run lasts;
        the next assignment or lossy run names its senders again. With keys, the
        executor allows the senders' keys."""
        addresses = self._keys.data_addresses
        if addresses is None:
            return
        senders = generation_sender_endpoints(setup)
        if senders:
            addresses.replace(peer_addresses(senders, self._data_endpoint))
        elif not addresses.admits_any:
            addresses.admit_any()
            reason = "the coordinator named no sender's address for this generation run"
            log.warning("data_port_open", stage=self._name, reason=reason)

    async def close(self) -> None:
        await self.lossy.close()
        await self.generation.close()
