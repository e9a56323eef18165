"""The coordinator shell's sending side: commands' sends in order, bulk state in chunks,
and the requests the shell makes itself (profiles, link probes) with their replies.

Sends are queued at once while the socket takes them and from a task from the
first one that has to wait, so their order holds. A message that carries tensors
to a stage with an open bulk connection goes there in chunks
(:mod:`zpipe.transport.bulk`), so its heartbeat acks never queue behind it. A send
to a stage that fails becomes a ``RequestFailed`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar, cast

import zmq
import zmq.asyncio

from zpipe._errors import PeerGoneError, TransportTimeout
from zpipe.coordinator.bulk_links import BulkLink, BulkLinks
from zpipe.coordinator.commands import ReachClient, Send
from zpipe.coordinator.events import Event, RequestFailed
from zpipe.coordinator.membership import Member
from zpipe.coordinator.state import CLIENT_NAME
from zpipe.log import get_logger
from zpipe.protocol import Message, WireMessage
from zpipe.transport.bulk import OutgoingTransfer
from zpipe.transport.codec import encode
from zpipe.transport.sockets import send

log = get_logger("zpipe.coordinator")

_R = TypeVar("_R", bound=WireMessage)


class ShellSends:
    """What the shell sends on its ROUTER socket (set once it is bound)."""

    def __init__(
        self,
        *,
        bulk_links: BulkLinks,
        send_s: float,
        feed: Callable[[Event], None],
        spawn: Callable[[Any], None],
    ) -> None:
        self.router: zmq.asyncio.Socket | None = None
        self._bulk_links = bulk_links
        self._send_s = send_s  # the send deadline from configuration
        self._feed = feed
        self._spawn = spawn
        # Replies the shell's own requests await, by (stage, reply class).
        self._reply_waiters: dict[tuple[str, type[WireMessage]], asyncio.Future[Any]] = {}
        self._bulk_transfers = 0  # ids of the bulk transfers this process sends

    def deliver(self, stage: str, message: WireMessage) -> None:
        """A stage's reply to a request of the shell's own (``Deliver``)."""
        waiter = self._reply_waiters.get((stage, type(message)))
        if waiter is not None and not waiter.done():
            waiter.set_result(message)

    def fail_requests(self, stage: str, error: Exception) -> None:
        """``stage`` died: the shell's requests out to it fail now (``FailRequests``)."""
        for (peer, _), waiter in self._reply_waiters.items():
            if peer == stage and not waiter.done():
                waiter.set_exception(error)

    def soon(self, sends: list[Send]) -> None:
        """Queue ``sends`` in order: at once while the socket takes them (the common
        case), in a task from the first one that has to wait. A task for every
        heartbeat answer cost more than the send itself with hundreds of stages."""
        assert self.router is not None
        for index, command in enumerate(sends):
            try:
                message = command.wire
                if self._bulk_links.route_for(command.to, message) is not None:
                    self._spawn(self._all(sends[index:]))  # chunked: awaited
                    return
                frames = [command.to, *encode(message)]
                # zmq.asyncio tries a non-blocking send first and queues behind any
                # send still waiting, so the order holds; a future done now was sent
                pending = cast(
                    "asyncio.Future[Any]", self.router.send_multipart(frames, copy=False)
                )
            except Exception as exc:  # a message that cannot be encoded, say: this one only
                self._failed(command, exc)
                continue
            if not pending.done():
                self._spawn(self._all(sends[index + 1 :], waiting=(command, pending)))
                return
            error = pending.exception()
            if error is not None:
                self._failed(command, error)

    def _failed(self, command: Send, error: BaseException) -> None:
        if isinstance(error, zmq.ZMQError):  # ROUTER_MANDATORY: the peer is not connected
            error = PeerGoneError(command.peer, command.kind)
        if isinstance(error, TransportTimeout):
            if command.stage is None:
                log.warning("reply_failed", peer=command.peer, error=str(error))
        else:
            log.error("send_failed", peer=command.peer, kind=command.kind, error=repr(error))
        if command.stage is not None:
            # later, not inside the event being carried out
            asyncio.get_running_loop().call_soon(
                self._feed, RequestFailed(command.stage, cast(Exception, error), command.to)
            )

    async def _all(
        self, sends: list[Send], *, waiting: tuple[Send, asyncio.Future[Any]] | None = None
    ) -> None:
        """Finish ``waiting`` (a send queued but not yet taken), then send ``sends``."""
        if waiting is not None:
            command, pending = waiting
            timeout_s = command.timeout_s or self._send_s
            try:
                await asyncio.wait_for(pending, timeout_s)
            except asyncio.TimeoutError:
                error = TransportTimeout(command.peer, f"room to send {command.kind}", timeout_s)
                self._failed(command, error)
            except Exception as exc:
                self._failed(command, exc)
        for command in sends:
            try:
                await self.send(
                    command.to, command.message, peer=command.peer, timeout_s=command.timeout_s
                )
            except TransportTimeout as exc:
                if command.stage is not None:
                    self._feed(RequestFailed(command.stage, exc, command.to))
                else:
                    log.warning("reply_failed", peer=command.peer, error=str(exc))
            except Exception as exc:  # a message that cannot be encoded, say: this one only
                log.error("send_failed", peer=command.peer, kind=command.kind, error=repr(exc))
                if command.stage is not None:
                    self._feed(RequestFailed(command.stage, exc, command.to))

    async def send(
        self,
        routing_id: bytes,
        message: WireMessage,
        *,
        peer: str,
        timeout_s: float | None = None,
    ) -> None:
        assert self.router is not None
        wire = message.to_message()
        bulk = self._bulk_links.route_for(routing_id, wire)
        if bulk is not None:  # state for a stage: on its bulk connection, chunked
            await self._bulk(bulk, wire, timeout_s=timeout_s)
            return
        try:
            await send(
                self.router,
                wire,
                routing_id=routing_id,
                peer=peer,
                timeout_s=timeout_s or self._send_s,
            )
        except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer is not connected
            raise PeerGoneError(peer, wire.kind) from exc

    async def reach(self, job: ReachClient) -> bool:
        """Whether the client at ``job.to`` is connected: ``job.message`` sent to it
        (see :class:`~zpipe.coordinator.commands.ReachClient`)."""
        try:
            await self.send(job.to, job.message, peer=CLIENT_NAME, timeout_s=job.timeout_s)
        except PeerGoneError:
            return False
        except TransportTimeout:  # connected, its queue full: a live client, slow
            return True
        return True

    async def _bulk(self, link: BulkLink, message: Message, *, timeout_s: float | None) -> None:
        """``message`` to a stage as chunks on its bulk connection: its heartbeat acks
        and probes never queue behind it. Each chunk has the send deadline of its own."""
        assert self.router is not None and link.route is not None
        self._bulk_transfers += 1
        transfer = OutgoingTransfer(self._bulk_transfers, encode(message))
        for chunk in transfer.messages(name=link.name, token=link.token):
            try:
                await send(
                    self.router,
                    chunk,
                    routing_id=link.route,
                    peer=link.name,
                    timeout_s=timeout_s or self._send_s,
                )
            except zmq.ZMQError as exc:
                raise PeerGoneError(link.name, message.kind) from exc
        log.info(
            "bulk_sent",
            stage=link.name,
            kind=message.kind,
            bytes=transfer.nbytes,
            chunks=transfer.chunks,
        )

    async def request(
        self, member: Member, message: WireMessage, reply: type[_R], timeout_s: float
    ) -> _R:
        """Send ``message`` to a stage and wait for its answer of class ``reply``."""
        waiter: asyncio.Future[_R] = asyncio.get_running_loop().create_future()
        self._reply_waiters[(member.name, reply)] = waiter
        try:
            # a send that fails says so itself (TransportTimeout is a TimeoutError too)
            await self.send(member.routing_id, message, peer=member.name)
            try:
                return await asyncio.wait_for(waiter, timeout_s)
            except asyncio.TimeoutError:
                raise TransportTimeout(member.name, reply.KIND, timeout_s) from None
        finally:
            self._reply_waiters.pop((member.name, reply), None)
