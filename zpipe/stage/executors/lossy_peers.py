"""A lossy run's (or link measurement's) connections to its peers' data ports.

At set-up a stage allows its peers' CURVE keys (without keys: their hosts,
:mod:`zpipe.transport.address_auth`) on its own data port before any of
them connects (a refused CURVE handshake is not retried) and only notes where they
are; it connects to them at ``lossy_go``, once every stage of the run allows this
one's key. The run's PUSH sockets close when it ends; under ACK recovery the
acknowledgements go on sockets of their own
(:class:`~zpipe.stage.executors.lossy_recovery.AckSender`).
"""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from zpipe._errors import ProtocolError
from zpipe.stage.assignment import PushConnector
from zpipe.stage.executors.lossy_recovery import AckSender
from zpipe.transport import security
from zpipe.transport.address_auth import AddressAllowList, peer_addresses


class LossyPeers:
    """The peers of the run set up on this stage, by device index."""

    def __init__(
        self,
        connector: PushConnector,
        allow: security.PeerAllowList | None,
        addresses: AddressAllowList | None = None,
    ) -> None:
        self._connect = connector
        self._allow = allow
        self._addresses = addresses  # without keys: the peers' hosts
        #: by device: the connected PUSH socket (from lossy_go until the run ends)
        self.sockets: dict[int, zmq.asyncio.Socket] = {}
        # by device: (data endpoint, CURVE key, name) of the set-up run's peers
        self._pending: dict[int, tuple[str, str | None, str]] = {}

    def allow(self, names: Any, keys: Any, me: int, endpoints: dict[int, str]) -> None:
        """Allow the peers' keys (``names`` and ``keys``: maps by device index, as a
        set-up carries them) and note their ``endpoints``; :class:`ProtocolError` (and
        nothing noted) if the maps do not fit."""
        self._pending = {}
        names, keys = by_index(names, "names"), by_index(keys, "keys")
        if self._allow is not None:
            self._allow.replace({names.get(d, str(d)): k.encode() for d, k in keys.items()})
        if self._addresses is not None:
            others = [e for d, e in endpoints.items() if d != me]
            self._addresses.replace(peer_addresses(others, endpoints.get(me, "")))
        self._pending = {
            d: (endpoint, keys.get(d), names.get(d, f"device {d}"))
            for d, endpoint in endpoints.items()
            if d != me
        }

    def forget(self) -> None:
        """No run is set up: nobody to connect to at the next ``lossy_go``."""
        self._pending = {}

    def connect(self, acks: AckSender | None) -> None:
        """Connect to every peer noted (and, under ACK, its acknowledgements' sockets)."""
        self.close()
        for device, (endpoint, key, peer) in self._pending.items():
            self.sockets[device] = self._connect(endpoint, key, peer)
            if acks is not None:  # kept past the run's end: late copies get theirs
                acks.sockets[device] = self._connect(endpoint, key, peer)

    def close(self, *, linger_s: float = 0.0) -> None:
        for sock in self.sockets.values():
            sock.close(linger=int(linger_s * 1000))
        self.sockets.clear()

    def check_sender(self, frame: zmq.Frame) -> None:
        """:class:`ProtocolError` unless a message came from an allowed peer's key."""
        if self._allow is None:
            return
        key = security.sender_public_key(frame)
        if key is None or key not in self._allow:
            raise ProtocolError("a partial from a peer that is not in this lossy run")


def by_index(body: Any, what: str) -> dict[int, str]:
    """A map keyed by device index as a string (msgpack keys are strings)."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise ProtocolError(f"lossy_setup: {what} must be a map")
    try:
        return {int(k): str(v) for k, v in body.items()}
    except ValueError:
        raise ProtocolError(f"lossy_setup: {what} keys must be device indices") from None
