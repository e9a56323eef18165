"""r-TX copies and ACK acknowledgements as real messages on a lossy run's wire.

The recovery scheme (:func:`zpipe.lossy.links.deliver_over`) decides, copy by copy,
what a partial costs. On stages every copy that decision hands over goes through
the sender's emulated link (:class:`zpipe.transport.emulation.KeyedLinks`), and
each copy the link lets through is a ``lossy_partial`` of its own on the wire,
numbered by ``copy``:

- the receiver keeps the first copy of a partial and discards (and counts) the
  others (:class:`zpipe.stage.executors.lossy_passes.SharedInbox`);
- under ACK the receiver answers every copy it receives with a ``lossy_ack`` on
  its own emulated link back (:class:`AckSender`, the event loop's), which drops
  it by the same keyed decision the simulation asks; the sender, before its next
  copy, waits for that acknowledgement (:class:`AckBook`) where the seeded
  decision says it arrives, and only in the emulated wait mode, for at most the
  run's ``wait_s``. So the number of copies stays the seeded decision's (a run
  still equals its simulation); a promised acknowledgement that does not come in
  time is counted (``acks_overdue``) and makes its receiver silent: none of its
  acknowledgements is awaited until it is heard from again
  (:mod:`zpipe.lossy.ack_patience`), so a receiver that died unannounced costs its
  sender one ``wait_s``, not one per copy, until the coordinator's verdict. In
  deadline mode, whose timeslots leave no time for a round trip, the sender does
  not wait, and the acknowledgements that come are counted.

What really crossed is counted per stage (:class:`WireCounts`) and reported in
``lossy_result``'s ``on_wire``; what was decided about each receiver's
acknowledgements in ``ack_waits``. Each counter is written by one thread only: the
pass loop's (compute thread) by the sender side, the others by the event loop or
under the inbox's lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import zmq.asyncio

from zpipe._errors import TransportTimeout
from zpipe.log import get_logger
from zpipe.lossy.ack_patience import AckPatience
from zpipe.lossy.links import ack_key
from zpipe.protocol.lossy import LossyAck, LossyPartial
from zpipe.transport.emulation import KeyedLinks, KeyedLoss, LossKey
from zpipe.transport.sockets import send

log = get_logger("zpipe.stage")

#: a copy awaiting its acknowledgement: (data, kind, key_layer, receiver, copy)
AckId = tuple[int, str, int, int, int]

# How often a sender waiting for an acknowledgement looks whether the run stopped.
_STOP_POLL_S = 0.2


@dataclass
class WireCounts:
    """What one stage really put on (and took off) a lossy run's wire."""

    copies_sent: int = 0  # data copies the sender's emulated links let onto the wire
    copies_lost: int = 0  # data copies those links dropped
    duplicates: int = 0  # copies received after the partial's first, discarded
    acks_sent: int = 0  # acknowledgements this receiver's links let onto the wire
    acks_lost: int = 0  # acknowledgements those links dropped
    acks_received: int = 0  # acknowledgements of copies this stage sent
    acks_dropped: int = 0  # acknowledgements of nothing this stage sent (or repeated)
    acks_overdue: int = 0  # promised by the seeded decision, not come within wait_s

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


#: how a sender's wait for one acknowledgement ended (:meth:`AckBook.await_ack`)
AckWait = Literal["heard", "overdue", "unawaited", "cut"]


class AckBook:
    """The copies a sender waits to hear acknowledged, and the acknowledgements heard.

    The pass loop registers a copy before sending it (:meth:`expect`), so an
    acknowledgement that comes for anything else is dropped and counted, never an
    error; the event loop files what comes (:meth:`arrived`) and notes every peer it
    hears from (:meth:`heard_from`). Whether to wait at all is
    :class:`zpipe.lossy.ack_patience.AckPatience`'s decision: after one overdue
    acknowledgement a receiver's are not awaited until it is heard from again.

    Lock order: :meth:`await_ack` calls its ``stopped`` (which takes the inbox's lock)
    with this book's lock held, so nobody may call into the book holding the inbox's.
    """

    def __init__(self, counts: WireCounts) -> None:
        self._counts = counts
        self._cond = threading.Condition()
        self._expected: set[AckId] = set()
        self._heard: set[AckId] = set()
        self._patience = AckPatience()

    def expect(self, ack: AckId) -> None:
        with self._cond:
            self._expected.add(ack)

    def arrived(self, ack: AckId) -> bool:
        """An acknowledgement came (event loop): False if it acknowledges nothing this
        stage sent, or was heard already (counted as dropped)."""
        with self._cond:
            if ack not in self._expected or ack in self._heard:
                self._counts.acks_dropped += 1
                return False
            self._heard.add(ack)
            self._counts.acks_received += 1
            self._patience.heard(ack[3])
            self._cond.notify_all()
            return True

    def heard_from(self, device: int) -> None:
        """A partial of ``device``'s came (event loop): it is alive, wait for its
        acknowledgements again."""
        with self._cond:
            self._patience.heard(device)

    def wait(self, ack: AckId, timeout_s: float, stopped: Callable[[], bool]) -> bool:
        """Wait (pass loop) until ``ack`` is heard, at most ``timeout_s``, or the run stops."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            return self._wait_locked(ack, deadline, stopped) == "heard"

    def await_ack(self, ack: AckId, timeout_s: float, stopped: Callable[[], bool]) -> AckWait:
        """A promised acknowledgement is due (pass loop): ``"unawaited"`` if its receiver
        is silent since an overdue one, else wait as :meth:`wait` does; ``"overdue"``
        (counted; the receiver is silent from now on) if it did not come in time,
        ``"cut"`` if ``stopped`` said so first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if not self._patience.should_wait(ack[3]):
                return "unawaited"
            outcome = self._wait_locked(ack, deadline, stopped)
            if outcome == "overdue":
                self._patience.overdue(ack[3])
                self._counts.acks_overdue += 1
            return outcome

    def _wait_locked(self, ack: AckId, deadline: float, stopped: Callable[[], bool]) -> AckWait:
        while ack not in self._heard:
            if stopped():
                return "cut"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "overdue"
            self._cond.wait(min(remaining, _STOP_POLL_S))
        return "heard"

    def waits_body(self) -> dict[str, dict[str, int]]:
        """What was decided about each receiver's acknowledgements (``ack_waits``)."""
        with self._cond:
            return self._patience.as_body()


class AckSender:
    """A receiver's acknowledgements (ACK recovery), sent from the event loop on its own
    sockets to the run's peers: the pass loop's sockets belong to the compute thread."""

    def __init__(
        self,
        *,
        run: int,
        index: int,
        epoch: int,
        keyed_loss: KeyedLoss,
        counts: WireCounts,
        timeout_s: float,
    ) -> None:
        self._run, self._index, self._epoch = run, index, epoch
        self._links = KeyedLinks(keyed_loss)  # the event loop's: one instance per thread
        self._counts = counts
        self._timeout_s = timeout_s
        self.sockets: dict[int, zmq.asyncio.Socket] = {}

    async def acknowledge(self, partial: LossyPartial) -> None:
        """Answer one received copy on the reverse emulated link (which may drop it)."""
        if partial.copy is None or partial.link_layer is None or partial.direction is None:
            return  # a copy that asks no acknowledgement (r-TX, or an older peer)
        data = LossKey(
            partial.src, self._index, partial.link_layer, partial.data, partial.direction,
            partial.copy,
        )  # fmt: skip
        if not self._links.transmit(ack_key(data)):
            self._counts.acks_lost += 1
            return
        sock = self.sockets.get(partial.src)
        if sock is None:
            return  # its sockets are gone: the run ended here
        ack = LossyAck(
            run=self._run, data=partial.data, kind=partial.kind, layer=partial.layer,
            src=self._index, copy=partial.copy, epoch=self._epoch,
        )  # fmt: skip
        try:
            await send(sock, ack.to_message(), timeout_s=self._timeout_s,
                       peer=f"device {partial.src}")  # fmt: skip
        except TransportTimeout as exc:  # its sender counts it overdue
            log.warning("lossy_ack_not_sent", error=str(exc))
            return
        self._counts.acks_sent += 1

    def close(self, *, linger_s: float = 0.0) -> None:
        for sock in self.sockets.values():
            sock.close(linger=int(linger_s * 1000))
        self.sockets.clear()
