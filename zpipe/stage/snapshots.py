"""A training stage's own state on request: weights to the coordinator, backups, fetches.

- ``weights_request``: once round ``step`` is done here (or at once, with
  ``latest``, when the run broke elsewhere), this stage's weights (and optimizer
  state, if asked) go to the coordinator; with ``keep`` (an asynchronous run's
  fast recovery) they stay here as this stage's own snapshot after its update
  count and only their keys go, the new plan's holders fetching them.
- ``backup_request``: once round ``step`` is done, keep a snapshot of this
  stage's state and send a copy to its backup holder (a peer stage's probe
  socket, or the coordinator in the reply).
- an assignment's ``fetch`` list: the units to take from snapshots, here or at
  peers (:meth:`SnapshotService.fetched_state`), or, marked ``initial`` (a fast
  recovery found no copy of a dead stage's units), to build afresh from the spec.
- an asynchronous stage's chain copy made without draining
  (:mod:`zpipe.stage.live_copies`) goes to the next stage as a ``backup`` marked
  ``live`` (:meth:`SnapshotService.send_live_copy`).

The snapshots kept here, and the peers' copies this stage holds and serves, are
:class:`~zpipe.stage.held_copies.CopyHolder` (``SnapshotService.held``).

Each method returns the reply to send; a failure becomes the reply's ``error``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import zmq.asyncio

from zpipe._errors import ConfigError, PipelineError, ProtocolError, UnitsLostError
from zpipe.log import get_logger
from zpipe.models import ModelSpec
from zpipe.protocol import WireMessage
from zpipe.protocol.peer import Backup, FetchUnits
from zpipe.protocol.stage_control import BackedUp, BackupRequest, Weights, WeightsRequest
from zpipe.stage.executors.async_training import AsyncTrainingExecutor
from zpipe.stage.executors.sync_training import TrainingExecutor
from zpipe.stage.held_copies import CopyHolder
from zpipe.stage.live_copies import ChainPeer
from zpipe.stage.metrics import StageCounters
from zpipe.stage.peer_policy import foreign_units
from zpipe.stage.peer_transfer import PeerLink
from zpipe.stage.supervision import describe_error
from zpipe.training.async_fast_state import initial_state, restart_state_at, unit_digests
from zpipe.transport import codec, security
from zpipe.transport.bulk import CHUNK_BYTES
from zpipe.transport.sockets import SocketOptions

log = get_logger("zpipe.stage")


def request_identity(message: WireMessage) -> tuple[object, ...]:
    """What makes two requests the same one sent twice: kind, epoch and body."""
    fields = tuple(sorted((key, repr(value)) for key, value in message.body().items()))
    return (message.KIND, message.epoch, fields)


class SnapshotService:
    def __init__(
        self,
        *,
        name: str,
        context: zmq.asyncio.Context,
        keypair: security.KeyPair | None,
        socket_options: SocketOptions,
        timeout_s: float,
        compute: ThreadPoolExecutor,
        counters: StageCounters,
        held: CopyHolder,
    ) -> None:
        self.name = name
        self._context = context
        self._keypair = keypair
        self._options = socket_options
        self._timeout_s = timeout_s
        self._compute = compute
        self._counters = counters
        # the snapshots kept here (this stage's own among them) and peers' copies: what
        # a snapshot request, a fetch entry naming this stage and a backup read or add to
        self.held = held
        # the last backup made, by request: a request sent again gets the same answer
        self._last_backup: tuple[tuple[object, ...], BackedUp] | None = None
        # state bigger than this crosses between stages in chunks of this size
        self.chunk_bytes = CHUNK_BYTES
        self._transfers = itertools.count()  # the chunked backups and copies sent

    def _moved(self, nbytes: int) -> None:
        self._counters.peer_state_bytes += nbytes

    async def weights_reply(
        self,
        request: WeightsRequest,
        trainer: TrainingExecutor | None,
        stop_run: Callable[[], Awaitable[None]],
    ) -> Weights:
        """Once round ``step`` is done here, this stage's weights for the coordinator."""
        run, step = request.run, request.step
        reply = Weights(run=run, name=self.name, step=step, keys=[], error="", epoch=request.epoch)
        completed: int | None = None
        updates: int | None = None
        try:
            snapshot = request.snapshot
            if snapshot is not None:
                # heavy recovery gathers snapshots kept here, whatever runs now; a
                # fast recovery (``keep``) asks only that they are here: the new
                # holders fetch them from here, peer to peer
                state = self.held.snapshot_units(snapshot)
            elif trainer is None or trainer.setup.run != run:
                raise PipelineError(f"this stage is not training run {run}")
            elif request.latest:
                shard = trainer.shard
                # The run broke elsewhere: stop it here, then read the state in the
                # compute thread, after whatever step it was running.
                await stop_run()
                loop = asyncio.get_running_loop()
                state = await loop.run_in_executor(self._compute, shard.training_state)
                completed = trainer.completed_steps
                if isinstance(trainer, AsyncTrainingExecutor):
                    # a fast recovery keeps this state: its digests, to compare with
                    # what the stage resumes from (zpipe.coordinator.runs.async_fast_recovery)
                    updates = trainer.async_shard.updates
                    digests = await loop.run_in_executor(self._compute, unit_digests, state)
                    log.info("latest_state_sent", stage=self.name, run=run, updates=updates,
                             digests=digests, kept=bool(request.keep))  # fmt: skip
                    if request.keep:
                        # the new plan's holders fetch these units from here, peer to
                        # peer (its own by the assignment's fetch entries): only the
                        # keys go to the coordinator
                        self.held.replicas.put(self.name, run, updates, state)
                elif request.keep:
                    raise PipelineError(
                        "only an asynchronous stage keeps its latest state for a fast recovery"
                    )
            else:
                shard = trainer.shard
                await trainer.wait_for_step(step, self._timeout_s)
                # with the optimizer: a checkpoint to resume from, an asynchronous
                # stage's weight versions included (it has backwarded every batch)
                state = (
                    await asyncio.get_running_loop().run_in_executor(
                        self._compute, _replica_state, trainer
                    )
                    if request.optimizer
                    else shard.state_dict()
                )
            if request.keep and (updates is not None or snapshot is not None):
                return dataclasses.replace(
                    reply,
                    keys=list(state),
                    metrics=self._counters.to_dict(),
                    completed=completed,
                    updates=updates,
                )
            if len(state) > codec.MAX_TENSORS:
                raise ConfigError(
                    f"this stage holds {len(state)} tensors, more than one message "
                    f"carries ({codec.MAX_TENSORS})"
                )
            return dataclasses.replace(
                reply,
                keys=list(state),
                metrics=self._counters.to_dict(),
                completed=completed,
                updates=updates,
                tensors=tuple(state.values()),
            )
        except Exception as exc:  # reported: the coordinator decides what it means
            error = describe_error(exc)
            log.error("weights_not_sent", stage=self.name, error=error)
            return dataclasses.replace(reply, error=error, completed=completed)

    async def backup_reply(
        self,
        request: BackupRequest,
        trainer: TrainingExecutor | None,
        pace: Callable[[int], Awaitable[None]],
    ) -> BackedUp:
        """Once round ``step`` is done: keep a snapshot of this stage's state, and send
        a copy to its backup holder (a peer stage, or the coordinator in the reply)."""
        identity = request_identity(request)
        if self._last_backup is not None and self._last_backup[0] == identity:
            # Asked again (the first answer, or the request, may have been lost while a
            # connection was replaced): the snapshot of that round, not a later state.
            return self._last_backup[1]
        run, step, holder = request.run, request.step, request.holder
        reply = BackedUp(
            run=run,
            name=self.name,
            step=step,
            holder=holder,
            keys=[],
            nbytes=0,
            error="",
            epoch=request.epoch,
        )
        try:
            if trainer is None or trainer.setup.run != run:
                raise PipelineError(f"this stage is not training run {run}")
            await trainer.wait_for_step(step, self._timeout_s)
            loop = asyncio.get_running_loop()
            state = await loop.run_in_executor(
                self._compute,
                lambda: {k: t.clone() for k, t in _replica_state(trainer).items()},
            )
            self.held.replicas.put(self.name, run, step, state)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            reply = dataclasses.replace(reply, nbytes=nbytes, metrics=self._counters.to_dict())
            if holder == "coordinator":
                reply = dataclasses.replace(reply, keys=list(state), tensors=tuple(state.values()))
            elif holder:
                if request.holder_endpoint is None:
                    raise ProtocolError(f"a backup to {holder!r} needs its holder_endpoint")
                link = PeerLink(
                    self._context,
                    peer=holder,
                    endpoint=request.holder_endpoint,
                    server_key=request.holder_key,
                    keypair=self._keypair,
                    options=self._options,
                    timeout_s=self._timeout_s,
                    moved=self._moved,
                )
                backup = Backup(
                    run=run,
                    step=step,
                    owner=self.name,
                    keys=list(state),
                    tensors=tuple(state.values()),
                )
                async with link:
                    answer = await link.send_backup(
                        backup,
                        pace=pace,
                        transfer=next(self._transfers),
                        chunk_bytes=self.chunk_bytes,
                    )
                if answer.error:
                    raise PipelineError(f"{holder} did not keep the backup: {answer.error}")
            self._last_backup = (identity, reply)
        except Exception as exc:  # reported: the coordinator decides what it means
            error = describe_error(exc)
            log.error("backup_failed", stage=self.name, error=error)
            # what was measured stays; no state goes with a failure
            reply = dataclasses.replace(reply, keys=[], tensors=(), error=error)
        return reply

    async def send_live_copy(
        self, peer: ChainPeer, backup: Backup, pace: Callable[[int], Awaitable[None]]
    ) -> None:
        """A chain copy made without draining, to ``peer``'s probe socket in paced
        chunks (one in flight); PipelineError if the peer did not keep it."""
        link = PeerLink(
            self._context,
            peer=peer.name,
            endpoint=peer.endpoint,
            server_key=peer.key,
            keypair=self._keypair,
            options=self._options,
            timeout_s=self._timeout_s,
            moved=self._moved,
        )
        async with link:
            answer = await link.send_backup(
                backup, pace=pace, transfer=next(self._transfers), chunk_bytes=self.chunk_bytes
            )
        if answer.error:
            raise PipelineError(f"{peer.name} did not keep the copy: {answer.error}")

    async def fetched_state(
        self, fetch: list[Any], spec: ModelSpec | None = None
    ) -> dict[str, torch.Tensor]:
        """The units an assignment says to take from snapshots: this stage's own or a
        peer's (its snapshot, or a backup it holds), fetched from that peer; an entry
        marked ``initial`` (no copy of them was left) built here from ``spec``, the
        assignment's model. An entry with ``restart`` (an asynchronous run's fast
        recovery) has its units put at that weight version (:func:`restart_state_at`)."""
        state: dict[str, torch.Tensor] = {}
        for entry in fetch:
            if not isinstance(entry, dict):
                raise ProtocolError("a fetch entry must be a map")
            if entry.get("initial"):
                units = await self._initial_entry(entry, spec)
            else:
                units = await self._fetched_entry(entry)
            state.update(_restarted(units, entry.get("restart")))
        return state

    async def _initial_entry(
        self, entry: dict[str, Any], spec: ModelSpec | None
    ) -> dict[str, torch.Tensor]:
        """The initial weights of an ``initial`` entry's units, built in the compute
        thread (as the shard's own units are)."""
        try:
            start, end = int(entry["start"]), int(entry["end"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed fetch entry: {exc!r}") from None
        if spec is None:
            raise ProtocolError("an initial fetch entry outside an assignment (no model)")
        if entry.get("from", self.name) != self.name:
            raise ProtocolError(f"initial weights are built here, not at {entry['from']!r}")
        loop = asyncio.get_running_loop()
        built = await loop.run_in_executor(self._compute, initial_state, spec, start, end)
        log.info("initial_units_built", stage=self.name, start=start, end=end,
                 owner=str(entry.get("owner", "")))  # fmt: skip
        return built

    async def _fetched_entry(self, entry: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The units of one fetch entry, from a snapshot here or at the peer it names."""
        try:
            owner, source = str(entry["owner"]), str(entry["from"])
            run, step = int(entry["run"]), int(entry["step"])
            start, end = int(entry["start"]), int(entry["end"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"a malformed fetch entry: {exc!r}") from None
        if source == self.name:
            # its own snapshot, a backup, or a chain copy a peer made (loaded in place)
            units = self.held.held_units(owner, run, step, start, end)
            return {k: t.clone() for k, t in units.items()}
        link = PeerLink(
            self._context,
            peer=source,
            endpoint=str(entry["endpoint"]),
            server_key=entry.get("key"),
            keypair=self._keypair,
            options=self._options,
            timeout_s=self._timeout_s,
            moved=self._moved,
        )
        request = FetchUnits(
            owner=owner,
            run=run,
            step=step,
            start=start,
            end=end,
            chunk_bytes=self.chunk_bytes,
        )
        async with link:
            reply = await link.fetch(request)
        if reply.error:
            raise UnitsLostError((start, end), f"{source} could not send them: {reply.error}")
        if len(reply.keys) != len(reply.tensors):
            raise ProtocolError(f"{source} sent mismatched units")
        foreign = foreign_units([str(k) for k in reply.keys], start, end)
        if foreign:
            raise ProtocolError(f"{source} sent state of other units: {foreign[:3]}")
        return {str(k): t.clone() for k, t in zip(reply.keys, reply.tensors, strict=True)}


def _replica_state(trainer: TrainingExecutor) -> dict[str, torch.Tensor]:
    """What a backup of this stage keeps: weights and optimizer state, and an
    asynchronous stage's weight versions (it backs up at a flush). Compute thread."""
    if isinstance(trainer, AsyncTrainingExecutor):
        return trainer.replica_state()
    return trainer.shard.training_state()


def _restarted(units: dict[str, torch.Tensor], restart: object) -> dict[str, torch.Tensor]:
    """``units`` at the weight version a fast recovery's fetch entry names (``restart``:
    ``{"version", "depth"}``), or as they are without one."""
    if restart is None:
        return units
    if not isinstance(restart, dict):
        raise ProtocolError("a fetch entry's restart must be a map")
    try:
        version, depth = int(restart["version"]), int(restart["depth"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"a malformed restart in a fetch entry: {exc!r}") from None
    return restart_state_at(units, version=version, depth=depth)
