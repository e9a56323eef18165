"""The client's control channel: a DEALER to the coordinator.

Requests wait for their reply with a deadline (and go again when the
coordinator was restarted meanwhile, for requests it may answer twice);
failure notices (``stage_failed``, ``run_replanned``) go to their own queue,
which the run's session watches. A coordinator whose connection stays gone for
``coordinator_silence_s`` is lost: requests and runs fail then, not at their
own (much longer) deadlines. Each numbered notice is acknowledged
(``notice_ack``; the coordinator sends it again until then) and goes to the
queue once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from zpipe._errors import CoordinatorLostError, TransportTimeout
from zpipe.client.failures import NoticeFilter
from zpipe.config import Timeouts
from zpipe.log import get_logger
from zpipe.protocol import WireMessage
from zpipe.protocol.client_control import (
    PRESENCE,
    NoticeAck,
    Progress,
    RunReplanned,
    StageFailed,
    Stalled,
)
from zpipe.protocol.repartition import SpeedChanged
from zpipe.recovery import StallWatch
from zpipe.transport.codec import decode_typed
from zpipe.transport.roles import ROLE_KINDS
from zpipe.transport.sockets import SocketOptions, recv_frames, send

log = get_logger("zpipe.client")

# what the coordinator sends unasked, about a run that is going on
Notice = StageFailed | RunReplanned
NOTICES = (StageFailed, RunReplanned)
NOTICE_KINDS = tuple(cls.KIND for cls in NOTICES)

R = TypeVar("R", bound=WireMessage)


# Kinds that only stages or clients may send (zpipe.transport.roles): never the
# coordinator's. A kind no role lists is left to the codec's registry.
_NOT_THE_COORDINATORS = frozenset(
    kind
    for role, kinds in ROLE_KINDS.items()
    if role != "coordinator"
    for kind in kinds
    if kind not in ROLE_KINDS["coordinator"]
)


def coordinator_may_send(kind: str) -> bool:
    """Whether a control message of ``kind`` can be the coordinator's."""
    return kind not in _NOT_THE_COORDINATORS


class ControlChannel:
    """The client's DEALER to the coordinator: requests with deadlines, failure notices."""

    def __init__(self, sock: zmq.asyncio.Socket, options: SocketOptions, timeouts: Timeouts):
        self.sock = sock
        self.options = options
        self.timeouts = timeouts
        self.failures: asyncio.Queue[Notice] = asyncio.Queue()
        # stages' speed verdicts the coordinator relays (a hint: the feed reads them
        # before each mini-batch, zpipe.client.runs.async_repartition.speed_notices)
        self.speed_changes: asyncio.Queue[SpeedChanged] = asyncio.Queue()
        self._notices = NoticeFilter()
        # replies, each parsed into its protocol class once, as it arrives
        self._replies: asyncio.Queue[WireMessage] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        # Reconnections to the coordinator's endpoint (a restarted coordinator): a
        # request that may have been lost with the old process is sent again.
        self.reconnections = 0
        self._reconnected = asyncio.Event()
        # The connection is down now (a coordinator restarting): a request it may
        # answer twice waits for the reconnection, bounded by ``lost``, not its own
        # deadline (a restart slower than reply_s, a loaded machine importing torch).
        self.disconnected = False
        # Set when the coordinator's connection has been gone for
        # coordinator_silence_s, the time a stage waits for it too: a restarted
        # coordinator is back long before; past it, nothing will answer a request
        # or re-plan the run, so waiting on (a replica's ask could wait 490 s) is a hang.
        self.lost = asyncio.Event()
        self._lose: asyncio.Task[None] | None = None
        # Whether the connection now up finished its ZMTP handshake (None: not known, a
        # connection made before this watch began): one dropped before it was refused by
        # whatever listens at the endpoint (say, a PULL that took the coordinator's port
        # before the coordinator bound it), and libzmq does not connect again after a
        # refusal: said at once, not only as coordinator_lost a silence later.
        self._handshaken: bool | None = None
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self._watcher = asyncio.create_task(self._watch_connection())

    async def _watch_connection(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
            except Exception as exc:  # a malformed monitor event must not end the watch
                log.warning("monitor_event_dropped", error=repr(exc))
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken = True
                continue
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if self._handshaken is False:
                    log.warning("coordinator_handshake_refused", endpoint=event["endpoint"],
                              detail="the peer at this endpoint dropped the connection "
                              "before a handshake: not a zpipe coordinator (another "
                              "socket holds its port?), one that refused this client's "
                              "key, or one that stopped meanwhile")  # fmt: skip
                self._handshaken = None
                self.disconnected = True
                log.warning("coordinator_disconnected", endpoint=event["endpoint"])
                if self._lose is None or self._lose.done():
                    self._lose = asyncio.create_task(self._lose_after_silence())
            elif event["event"] == zmq.EVENT_CONNECTED:
                self._handshaken = False
                if not self.disconnected:
                    continue
                self.disconnected = False
                if self._lose is not None:
                    self._lose.cancel()
                self.reconnections += 1
                self._reconnected.set()
                log.info("coordinator_reconnected", endpoint=event["endpoint"])

    async def _lose_after_silence(self) -> None:
        await asyncio.sleep(self.timeouts.coordinator_silence_s)
        log.error("coordinator_lost", silence_s=self.timeouts.coordinator_silence_s)
        self.lost.set()

    def lost_error(self, awaited: str) -> CoordinatorLostError:
        return CoordinatorLostError(awaited, self.timeouts.coordinator_silence_s)

    async def _read(self) -> None:
        while True:
            frames = await recv_frames(
                self.sock, timeout_s=None, peer="coordinator", awaited="control message"
            )
            try:
                # its protocol class, the body checked once: past this, only classes
                typed = decode_typed(frames, max_message_bytes=self.options.max_message_bytes)
            except Exception as exc:
                # Any exception one message causes (a ProtocolError, or a bug the
                # decoder lets through) drops that message; the channel keeps serving.
                log.warning("dropped_message", peer="coordinator", error=str(exc),
                            error_type=type(exc).__name__)  # fmt: skip
                continue
            if not coordinator_may_send(typed.KIND):
                # Only the coordinator is connected here (with keys: by its CURVE key),
                # but what it sends must be what a coordinator sends.
                log.warning("dropped_message", peer="coordinator", kind=typed.KIND,
                            error="a kind only stages or clients send")  # fmt: skip
                continue
            if isinstance(typed, Progress) and typed.awaited == PRESENCE:
                continue  # the coordinator looked whether this client is connected
            if isinstance(typed, SpeedChanged):
                self.speed_changes.put_nowait(typed)
            elif isinstance(typed, NOTICES):
                await self._acknowledge(typed)
                if self._notices.first_time(typed):
                    await self.failures.put(typed)
            else:
                await self._replies.put(typed)

    async def _acknowledge(self, notice: Notice) -> None:
        """Every copy is acknowledged: the acknowledgement of an earlier one may be lost."""
        if notice.seq is None:
            return
        ack = NoticeAck(run=notice.run, seq=notice.seq).to_message()
        try:
            await send(self.sock, ack, timeout_s=self.timeouts.reply_s, peer="coordinator")
        except TransportTimeout as exc:  # the coordinator sends it again; ack that one
            log.warning("notice_not_acknowledged", kind=notice.KIND, seq=notice.seq,
                        error=str(exc))  # fmt: skip

    async def ask(
        self,
        request: WireMessage,
        *,
        expect: tuple[type[R], ...],
        timeout_s: float,
        awaited: str,
        resend_on_reconnect: bool = False,
        progress_run: int | None = None,
    ) -> R:
        """Send ``request`` and wait for a reply of a class in ``expect``.

        ``progress_run``: the coordinator's ``progress`` notices of this run (the
        state awaited is still moving) restart the deadline, so an answer that keeps
        moving on a slow link is never given up on.

        ``resend_on_reconnect``: for a request the coordinator may answer twice
        (it shares the answer of a duplicate): when the connection to the
        coordinator is made again while waiting (it was restarted and took its
        run over from disk), the request goes again, with a fresh deadline; while
        the connection is down its deadline does not run out, the coordinator's
        silence timeout bounds the wait (a restart slower than ``timeout_s``, on a
        loaded machine, is not a failure).
        """
        message = request.to_message()
        seen = self.reconnections
        await send(self.sock, message, timeout_s=timeout_s, peer="coordinator")
        deadline = time.monotonic() + timeout_s
        extended = False  # the deadline was stretched for a restarting coordinator
        while True:
            if resend_on_reconnect and self.reconnections != seen:
                seen = self.reconnections
                log.warning("request_sent_again", kind=message.kind)
                await send(self.sock, message, timeout_s=timeout_s, peer="coordinator")
                deadline = time.monotonic() + timeout_s
                extended = False
            left = max(deadline - time.monotonic(), 0.0)
            self._reconnected.clear()
            reply_task = asyncio.ensure_future(self._replies.get())
            lost_task = asyncio.ensure_future(self.lost.wait())
            waits: set[asyncio.Future[Any]] = {reply_task, lost_task}
            if resend_on_reconnect:
                waits.add(asyncio.ensure_future(self._reconnected.wait()))
            try:
                done, _ = await asyncio.wait(
                    waits, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                for task in waits:
                    if not task.done():
                        task.cancel()
            if reply_task not in done and lost_task in done:
                raise self.lost_error(awaited)
            if reply_task in done:
                reply = reply_task.result()
                if isinstance(reply, expect) and _answers(request, reply):
                    return reply
                if isinstance(reply, Progress) and progress_run is not None:
                    if reply.run == progress_run:
                        deadline = time.monotonic() + timeout_s
                    continue
                log.debug("unexpected_reply", kind=reply.KIND)
            elif not done:
                if resend_on_reconnect and self.disconnected and not extended:
                    # the coordinator is restarting: wait for it (the request goes
                    # again, with a fresh deadline, once it is back) until ``lost``,
                    # coordinator_silence_s after the connection dropped (the bound
                    # here is only a backstop)
                    extended = True
                    deadline = time.monotonic() + self.timeouts.coordinator_silence_s
                    continue
                raise TransportTimeout("coordinator", awaited, timeout_s)

    async def report_stalls(self, watch: StallWatch, run: Callable[[], int], what: str) -> None:
        """Until cancelled: when the next result of ``run()`` is later than ``watch``'s
        deadline (FTPipeHD's deadline at the data source), tell the coordinator, which
        probes the run's stages at once instead of waiting for heartbeats to lapse."""
        while True:
            await asyncio.sleep(min(max(watch.deadline() / 4, 0.02), 0.5))
            stalled = watch.stalled(time.monotonic())
            if stalled is None:
                continue
            waited, deadline = stalled
            log.warning(f"{what}_stalled", run=run(), waited_s=round(waited, 3),
                        deadline_s=round(deadline, 3))  # fmt: skip
            stall = Stalled(run=run(), waited_s=waited, deadline_s=deadline)
            try:
                await send(
                    self.sock,
                    stall.to_message(),
                    timeout_s=self.timeouts.send_s,
                    peer="coordinator",
                )
            except TransportTimeout as exc:  # heartbeats still find a dead stage
                log.warning("stall_not_reported", run=run(), error=str(exc))

    async def close(self) -> None:
        for task in (self._reader, self._watcher, self._lose):
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)


def _answers(request: WireMessage, reply: WireMessage) -> bool:
    """Whether ``reply`` is about what ``request`` asked (the run and mini-batch both
    name, where both name one). A request sent again after a reconnection can be
    answered twice, once for each copy; the second answer must not be taken as the
    answer to the next request (a replica of mini-batch 6 for one asked at 9: the
    client would go on before the stages had flushed for it)."""
    for name in ("run", "step"):
        asked, told = getattr(request, name, None), getattr(reply, name, None)
        if asked is not None and told is not None and asked != told:
            log.debug("stale_reply", kind=reply.KIND, field=name, asked=asked, got=told)
            return False
    return True
