"""The stage's data port: micro-batches, gradients and labels in, checked, then delivered.

One receive loop per running assignment. Each message is checked three times
before anything computes on it: its CURVE key (CURVE checks keys only at the
handshake, so a peer connected under an older assignment could keep sending),
its framing (the codec), and its kind, sender and plan epoch (the lifecycle
controller's :meth:`~zpipe.stage.lifecycle.StageLifecycle.data_verdict`).
A message that fails, or whose handling raises anything at all, is counted,
logged with its sender and dropped; the loop goes on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.log import get_logger
from zpipe.protocol.data_plane import Data, Grad, Labels, MicroBatchError
from zpipe.stage.lifecycle import DataVerdict, StageLifecycle
from zpipe.stage.metrics import StageCounters
from zpipe.stage.supervision import describe_error, serve_messages
from zpipe.stage.timeline import clock
from zpipe.transport import security
from zpipe.transport.codec import decode_typed
from zpipe.transport.sockets import frames_nbytes, recv_frames

log = get_logger("zpipe.stage")

# What the data port passes on: what a stage computes, or the word that someone failed.
DataMessage = Data | Grad | Labels | MicroBatchError
Deliver = Callable[[DataMessage], Awaitable[None]]


class DataPort:
    """Receives on the stage's data socket for the running assignment."""

    def __init__(
        self,
        *,
        socket: zmq.asyncio.Socket,
        lifecycle: StageLifecycle,
        counters: StageCounters,
        name: str,
        max_message_bytes: int,
        allowed: security.PeerAllowList | None = None,
    ) -> None:
        self._socket = socket
        self._lifecycle = lifecycle
        self._counters = counters
        self._name = name
        self._max_bytes = max_message_bytes
        self._allowed = allowed

    async def serve(self, deliver: Deliver, *, upstream: str) -> None:
        """Hand every accepted message to ``deliver`` until cancelled."""

        async def receive() -> list[zmq.Frame]:
            return await recv_frames(
                self._socket, timeout_s=None, peer=upstream, awaited="micro-batch"
            )

        async def handle(frames: list[zmq.Frame]) -> None:
            await self.handle(frames, deliver)

        await serve_messages(receive, handle, self._on_error)

    async def handle(self, frames: list[zmq.Frame], deliver: Deliver) -> None:
        received_at = clock()
        message = self.accept(frames)
        if message is None:
            return
        await deliver(message)
        self._counters.timeline.record(message.mb, "recv", received_at, clock())

    def accept(self, frames: list[zmq.Frame]) -> DataMessage | None:
        """The checked message in ``frames``, or None when it is of an older epoch
        (counted as stale); a :class:`ProtocolError` for one that must be dropped.
        Synchronous, so a receiver on any thread can check what it took."""
        self._counters.bytes_in += frames_nbytes(frames)
        self._check_sender(frames[0])
        # checked once, by the codec: its typed class is built without a second check
        message = decode_typed(frames, max_message_bytes=self._max_bytes)
        src: str | None = None  # another kind: the verdict drops it
        has_tensors = False
        match message:
            case Data() | Grad() | Labels():
                src, has_tensors = message.src, bool(message.tensors)
            case MicroBatchError():
                src = message.src
        decision = self._lifecycle.data_verdict(
            type(message), src, message.epoch, has_tensors=has_tensors
        )
        if decision.verdict is DataVerdict.DROP:
            raise ProtocolError(decision.reason)
        if decision.verdict is DataVerdict.STALE:
            self._counters.stale += 1
            log.debug(
                "stale_message", stage=self._name, epoch=message.epoch, reason=decision.reason
            )
            return None
        assert isinstance(message, DataMessage)  # delivered: a data kind from its sender
        return message

    def _check_sender(self, frame: zmq.Frame) -> None:
        if self._allowed is None:
            return
        key = security.sender_public_key(frame)
        if key is None or key not in self._allowed:
            raise ProtocolError("data from a peer that is not the assigned upstream")

    def _on_error(self, frames: list[zmq.Frame], exc: Exception) -> None:
        self._counters.dropped += 1
        route = self._lifecycle.route
        fields = {
            "stage": self._name,
            "peer": self._sender(frames),
            "epoch": route.epoch if route else None,
        }
        if isinstance(exc, ProtocolError):
            log.warning("dropped_message", **fields, error=str(exc))
        else:  # not a validation failure: a bug or a hostile message; never fatal
            log.error("message_failed", **fields, error=describe_error(exc))

    def _sender(self, frames: list[zmq.Frame]) -> str:
        """A name for whoever sent ``frames``: its allowed key's name, or 'upstream'."""
        if self._allowed is None or not frames:
            return "upstream"
        try:
            key = security.sender_public_key(frames[0])
        except Exception:  # naming the peer must never fail the log line
            return "unknown"
        return self._allowed.describe(key) if key is not None else "unknown"
