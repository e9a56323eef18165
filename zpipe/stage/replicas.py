"""Snapshots a stage keeps for chain replication, and the stage-to-stage requests.

With chain replication (FTPipeHD) or Asteroid's topology-driven replication a
replica never travels whole to the coordinator: after a replicated round each
stage keeps a snapshot of its own units (weights and optimizer state) and
sends a copy to its backup holder, the next stage (the last stage's goes to
the coordinator, or to the first stage). After a failure a stage rebuilds its
new units from those snapshots: its own, a surviving peer's, or the backup a
peer holds for a dead one, fetched directly from that peer, so the weights
move between neighbours and only what changed hands moves at all.

Peers reach each other on their probe sockets (which already accept the
cluster's keys): :func:`peer_request` opens a DEALER there for one request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch
import zmq.asyncio

from zpipe._errors import ConfigError
from zpipe.models.weights import split_unit_key
from zpipe.protocol import WireMessage
from zpipe.stage.peer_transfer import PeerLink
from zpipe.transport import security
from zpipe.transport.sockets import SocketOptions

# Snapshots kept per owner: the newest and the one before (a replica being taken
# must not drop the one a recovery may still need).
KEEP_PER_OWNER = 2

SnapshotKey = tuple[str, int, int]  # (owner, run, step)


class ReplicaStore:
    """Snapshots by (owner, run, step): this stage's own and those peers backed up here."""

    def __init__(self, keep_per_owner: int = KEEP_PER_OWNER) -> None:
        self.keep_per_owner = keep_per_owner
        self._snapshots: OrderedDict[SnapshotKey, dict[str, torch.Tensor]] = OrderedDict()

    def put(self, owner: str, run: int, step: int, state: Mapping[str, torch.Tensor]) -> None:
        key = (owner, run, step)
        self._snapshots.pop(key, None)
        self._snapshots[key] = dict(state)
        mine = [k for k in self._snapshots if k[0] == owner]
        for old in mine[: max(0, len(mine) - self.keep_per_owner)]:
            del self._snapshots[old]

    def peer_bytes_if_put(self, owner: str, run: int, step: int, nbytes: int, *, me: str) -> int:
        """Bytes held for owners other than ``me`` once ``owner``'s snapshot of
        ``nbytes`` is put (with the snapshots :meth:`put` would drop, dropped)."""
        key = (owner, run, step)
        mine = [k for k in self._snapshots if k[0] == owner and k != key] + [key]
        dropped = set(mine[: max(0, len(mine) - self.keep_per_owner)])
        held = sum(
            _nbytes(state)
            for k, state in self._snapshots.items()
            if k[0] != me and k != key and k not in dropped
        )
        return held + (nbytes if owner != me else 0)

    def peer_bytes(self, *, me: str) -> int:
        """Bytes held here for owners other than ``me``."""
        return sum(_nbytes(state) for k, state in self._snapshots.items() if k[0] != me)

    def newest_run(self) -> int | None:
        """The newest run of any snapshot held here."""
        return max((k[1] for k in self._snapshots), default=None)

    def __contains__(self, key: SnapshotKey) -> bool:
        return key in self._snapshots

    def units(
        self, owner: str, run: int, step: int, start: int, end: int
    ) -> dict[str, torch.Tensor]:
        """The tensors of units ``[start, end)`` in ``owner``'s snapshot after ``step``."""
        snapshot = self._snapshots.get((owner, run, step))
        if snapshot is None:
            held = sorted(self._snapshots)
            raise ConfigError(
                f"no snapshot of {owner!r} after mini-batch {step} of run {run} here (held: {held})"
            )
        # units without parameters (an activation, say) hold nothing: an empty answer
        return units_of(snapshot, start, end)


def _nbytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def units_of(state: Mapping[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    """The entries of ``state`` (``units.<i>.<name>``, optimizer state included) of
    units ``[start, end)``."""
    picked = {}
    for key, tensor in state.items():
        unit = split_unit_key(key)  # "units.3.weight#opt.exp_avg" is unit 3's too
        if unit is not None and start <= unit[0] < end:
            picked[key] = tensor
    return picked


async def peer_request(
    context: zmq.asyncio.Context,
    *,
    peer: str,
    endpoint: str,
    server_key: str | None,
    keypair: security.KeyPair | None,
    message: WireMessage,
    expect: type[WireMessage],
    options: SocketOptions,
    timeout_s: float,
) -> WireMessage:
    """Send ``message`` to ``peer``'s probe socket and return its ``expect`` reply."""
    link = PeerLink(
        context,
        peer=peer,
        endpoint=endpoint,
        server_key=server_key,
        keypair=keypair,
        options=options,
        timeout_s=timeout_s,
    )
    async with link:
        return await link.request(message, expect)
