"""A stage's copies made without draining (FTPipeHD III-E), sent beside the training.

The executor snapshots its units in the compute thread once its update count
reaches a period (:func:`zpipe.recovery.live_copies.copies_due`) and hands the
snapshot here (:meth:`LiveCopySender.offer`, which never blocks); the compute
thread goes on with the next action at once. :meth:`LiveCopySender.run`, a task of
the event loop beside the data tasks, sends each copy to where it belongs:

- a chain copy to the next stage's probe socket as a ``backup`` marked ``live``,
  chunked (:meth:`zpipe.stage.peer_transfer.PeerLink.send_backup`); the last
  stage's chain copy goes to the coordinator as an ``async_copy``;
- a global copy to the coordinator as an ``async_copy`` on the stage's bulk
  connection, chunked (:class:`zpipe.stage.bulk.StageBulk`), never on the control
  connection that carries heartbeats; a chain copy a peer kept is announced to
  the coordinator by an ``async_copy`` without tensors, so its ledger knows where
  every copy is; the holder announces it too once it kept the whole copy
  (:func:`held_copy_notice`), so a death of the owner between the holder's last
  acknowledgement and its own notice does not leave the copy out of the ledger.

How the data plane keeps its share of the link: a copy is cut into chunks of at
most :data:`~zpipe.transport.bulk.CHUNK_BYTES`; each chunk to a peer waits for
the device's emulated radio (``pace``, the same pacer activations and gradients
go through) and for the peer's acknowledgement of the one before (one chunk in
flight), and the sender yields to the event loop between chunks, so an
activation queued meanwhile leaves before the copy's next chunk. Copies are sent
one at a time, and an older copy of the same kind still waiting is replaced by a
newer one (the newest is what a recovery wants), so copies never pile up behind
a slow link. Copy spans go to the stage's timeline as ``copy`` (the send, beside
the data) and ``snapshot`` (the compute thread's clone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from zpipe.log import get_logger
from zpipe.models.weights import split_unit_key
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup
from zpipe.protocol.stage_control import AsyncCopy
from zpipe.recovery.live_copies import state_digest
from zpipe.stage.metrics import StageCounters
from zpipe.stage.supervision import describe_error
from zpipe.stage.timeline import clock

log = get_logger("zpipe.stage")


@dataclass(frozen=True)
class ChainPeer:
    """The next stage, which holds this stage's chain copies (its probe socket)."""

    name: str
    endpoint: str
    key: str | None = None


@dataclass(frozen=True)
class PendingCopy:
    """A snapshot of this stage's units after ``step`` mini-batches, to send as ``kinds``."""

    run: int
    step: int
    start: int
    end: int
    kinds: tuple[str, ...]
    state: dict[str, torch.Tensor]


# the routes a copy takes, from the stage's runtime: a backup to a peer (chunked,
# paced), and a message to the coordinator (on the bulk connection)
ToPeer = Callable[[ChainPeer, Backup], Awaitable[None]]
# a copy's notice (AsyncCopy), or a speed verdict (SpeedChanged): small, to the coordinator
ToCoordinator = Callable[[WireMessage], Awaitable[None]]


@dataclass(frozen=True)
class CopyRoutes:
    to_peer: ToPeer
    to_coordinator: ToCoordinator


def held_copy_notice(
    *, holder: str, owner: str, run: int, step: int, keys: list[str], digest: str
) -> AsyncCopy | None:
    """What the holder of ``owner``'s chain copy tells the coordinator once it kept the
    whole copy (:func:`zpipe.coordinator.runs.async_copies.holder_notice`): the copy's
    owner, run, mini-batch and digest, no tensors. Its range is the units of the keys
    (the holder knows no other; the coordinator takes the owner's span from its
    plan). None when the copy holds no unit's state (nothing a recovery would need)."""
    units = [u[0] for u in (split_unit_key(k) for k in keys) if u is not None]
    if not units:
        return None
    return AsyncCopy(run=run, name=owner, kind="chain", step=step, start=min(units),
                     end=max(units) + 1, keys=[], digest=digest, holder=holder)  # fmt: skip


async def announce_held(to_coordinator: ToCoordinator, notice: AsyncCopy, timeout_s: float) -> None:
    """Send a holder's notice; a failure is logged (the owner's own notice may still
    come), never raised."""
    try:
        await asyncio.wait_for(to_coordinator(notice), timeout_s)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("live_copy_notice_failed", owner=notice.name, step=notice.step,
                    error=describe_error(exc))  # fmt: skip


class LiveCopySender:
    """The copies of one assignment, sent one at a time (see the module notes)."""

    def __init__(
        self,
        *,
        name: str,
        chain_to: ChainPeer | None,
        routes: CopyRoutes,
        counters: StageCounters,
    ) -> None:
        self.name = name
        self.chain_to = chain_to  # None: the last stage, whose chain copy goes up
        self._routes = routes
        self._counters = counters
        self._waiting: dict[str, PendingCopy] = {}  # kind -> the newest copy not yet sent
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing waits and nothing is on its way
        self._idle.set()
        self.sent: list[tuple[str, int]] = []  # (kind, step) of every copy sent, in order

    def offer(self, copy: PendingCopy) -> None:
        """Queue ``copy`` for each of its kinds, replacing an older one still waiting."""
        for kind in copy.kinds:
            replaced = self._waiting.get(kind)
            if replaced is not None:
                log.warning("live_copy_replaced", stage=self.name, kind=kind,
                            step=replaced.step, by=copy.step)  # fmt: skip
            self._waiting[kind] = copy
        self._idle.clear()
        self._wake.set()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every copy offered has left (or failed), at most ``timeout_s``:
        the run's last period's copy is offered just before the training ends, and
        stopping the sender then would lose the copy of the trained weights. False (and
        a warning naming what is left) when the deadline passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            left = sorted((kind, copy.step) for kind, copy in self._waiting.items())
            log.warning("live_copy_unsent", stage=self.name, waiting=left, timeout_s=timeout_s)
            return False
        return True

    async def run(self) -> None:
        """Send copies as they come, until cancelled; a failed send is logged (the next
        period's copy replaces it) and the training never waits for a copy."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                # chain first: it is the copy a single failure is restored from
                kind = "chain" if "chain" in self._waiting else next(iter(self._waiting))
                copy = self._waiting.pop(kind)
                started = clock()
                try:
                    await self._send(kind, copy)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # logged: the coordinator's ledger lacks this copy
                    log.warning("live_copy_failed", stage=self.name, kind=kind, step=copy.step,
                                error=describe_error(exc))  # fmt: skip
                    continue
                self._counters.timeline.record(copy.step, "copy", started, clock())
                self.sent.append((kind, copy.step))
            if not self._waiting:
                self._idle.set()

    async def _send(self, kind: str, copy: PendingCopy) -> None:
        keys = list(copy.state)
        tensors = tuple(copy.state.values())
        # off the event loop: hashing megabytes would hold up the activations it sends
        hashing = asyncio.ensure_future(asyncio.to_thread(state_digest, copy.state))
        if kind == "chain" and self.chain_to is not None:
            backup = Backup(run=copy.run, step=copy.step, owner=self.name, keys=keys,
                            live=True, tensors=tensors)  # fmt: skip
            # the holder needs the tensors, not the digest (it hashes what it kept): the
            # transfer starts at once, beside the hashing, so a death right after the
            # snapshot finds the copy at its holder sooner (issue 30)
            try:
                await self._routes.to_peer(self.chain_to, backup)
            except BaseException:
                hashing.cancel()  # no notice follows: the thread's digest is not read
                raise
            digest = await hashing
            holder = self.chain_to.name
            # the coordinator's ledger learns where the copy is (no tensors: small)
            notice = AsyncCopy(run=copy.run, name=self.name, kind=kind, step=copy.step,
                               start=copy.start, end=copy.end, keys=[], digest=digest,
                               holder=holder)  # fmt: skip
            await self._routes.to_coordinator(notice)
        else:
            digest = await hashing  # the coordinator checks the tensors against it
            message = AsyncCopy(run=copy.run, name=self.name, kind=kind, step=copy.step,
                                start=copy.start, end=copy.end, keys=keys, digest=digest,
                                tensors=tensors)  # fmt: skip
            await self._routes.to_coordinator(message)
            holder = "coordinator"
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        log.info("live_copy_sent", stage=self.name, kind=kind, run=copy.run, step=copy.step,
                 holder=holder, bytes=nbytes, digest=digest)  # fmt: skip
