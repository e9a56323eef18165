"""What the stage says to its coordinator, and the coordinator's clock.

Messages leave on the control connection, each with its deadline, over the stage's
(possibly emulated) uplink; state that carries tensors leaves on the bulk connection
in chunks once the coordinator gave it a token (:mod:`~zpipe.stage.bulk`), so that
no heartbeat ever waits behind megabytes. The lifecycle's commands name what to
send; this fills in what only the shell knows: the counters (heartbeats, metrics),
the run's timeline and the stage's clock, which the coordinator's stamped
acknowledgements turn into a clock offset (:class:`~zpipe.stage.timeline.ClockOffset`).
"""

from __future__ import annotations

import dataclasses

import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.log import get_logger
from zpipe.protocol import Message, WireMessage
from zpipe.protocol.stage_control import Heartbeat, HeartbeatAck, Metrics, Registered
from zpipe.stage.bulk import StageBulk
from zpipe.stage.commands import SendToCoordinator
from zpipe.stage.metrics import StageCounters
from zpipe.stage.timeline import ClockOffset
from zpipe.stage.timeline import clock as timeline_clock
from zpipe.transport.emulation import UplinkConnection
from zpipe.transport.sockets import send

log = get_logger("zpipe.stage")


class CoordinatorLink:
    def __init__(
        self,
        *,
        name: str,
        control: zmq.asyncio.Socket,
        bulk: StageBulk,
        uplink: UplinkConnection,
        counters: StageCounters,
        send_timeout_s: float,
    ) -> None:
        self.name = name
        self._control = control
        self._bulk = bulk
        self._uplink = uplink  # the control connection's share of the stage's uplink
        self._counters = counters
        self._send_timeout_s = send_timeout_s
        # the coordinator's clock against this one (heartbeat round trips), for timelines
        self.clock_offset = ClockOffset()
        self._coordinator_stamps = False

    async def heard(self, message: WireMessage) -> None:
        """A message from the coordinator: a registration (its clock, its bulk token)
        or a stamped heartbeat acknowledgement (a round trip for the clock offset)."""
        match message:
            case Registered(clock=clock, bulk_token=token):
                self._coordinator_stamps = clock is not None
                # a (re)started coordinator may keep another clock: measure afresh
                self.clock_offset = ClockOffset()
                # the token ties the bulk connection to this stage
                if self._bulk.registered(token):
                    try:
                        await self._bulk.open()
                    except TransportTimeout as exc:  # state goes on the control connection
                        log.warning("bulk_not_opened", stage=self.name, error=str(exc))
            case HeartbeatAck(echo=echo, clock=stamp) if echo is not None and stamp is not None:
                self.clock_offset.observe(float(echo), float(stamp), timeline_clock())

    async def send_command(self, command: SendToCoordinator) -> None:
        """The lifecycle's message, with what the shell fills in."""
        message = command.message
        if command.attach_metrics:
            assert isinstance(message, (Heartbeat, Metrics))
            message = dataclasses.replace(message, metrics=self._counters.to_dict())
        if isinstance(message, Metrics) and command.attach_timeline:
            timeline = self._counters.timeline.to_wire(self.clock_offset)
            message = dataclasses.replace(message, timeline=timeline)
        if isinstance(message, Heartbeat) and self._coordinator_stamps:
            message = dataclasses.replace(message, clock=timeline_clock())
        await self.send(message.to_message(), timeout_s=command.timeout_s)

    async def send(self, message: Message, *, timeout_s: float | None = None) -> None:
        tensors = message.tensors
        if tensors and self._bulk.usable:
            # state on the bulk connection, chunked: heartbeats never wait behind it
            await self._bulk.send(message)
            return
        control = self._control

        async def go() -> int:
            return await send(
                control, message, timeout_s=timeout_s or self._send_timeout_s, peer="coordinator"
            )

        nbytes = sum(t.numel() * t.element_size() for t in tensors) + 256
        await self._uplink.send(nbytes, go)
