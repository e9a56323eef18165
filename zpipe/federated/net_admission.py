"""Who may take part in a networked federated run, and what a registration must hold.

- :func:`profile_from_register`: an ``fl_register`` checked into a
  :class:`ClientProfile` (label counts over the run's classes, a finite
  latency, an id in range), or a :class:`ProtocolError` that says why not.
- :class:`SenderRoles`: with ``--keys DIR``, the roles of ``DIR/roles.txt``
  (:mod:`zpipe.transport.roles`) on the federated socket. A key may act as
  an fl client (send ``fl_register``, ``fl_update``, ``fl_probe_reply``) only
  with the ``client`` role; a key listed only as a stage, say, is refused, and
  so is a key that ``roles.txt`` does not list (deny by default). In a
  directory without ``roles.txt``, every key but fl-server's (and a
  coordinator's) is a client: that is the layout of an fl-server's keys.
"""

from __future__ import annotations

import math
from pathlib import Path

import zmq

from zpipe._errors import ProtocolError
from zpipe.federated.grouping import ClientProfile
from zpipe.log import get_logger
from zpipe.protocol.federated import FlRegister
from zpipe.transport import security
from zpipe.transport.roles import KeyRoles, Role

log = get_logger("zpipe.federated.server")

MAX_CLIENT_ID = 1_000_000
# Bounds on what a registration may claim (issue 33 finding 4: label counts of
# 2^31 and latencies of 1e308, 5e-324 and 0 were accepted, and skew eq. 4's
# grouping and the mixing weights): 16 M samples of one class on one client,
# and a round trip between a microsecond and an hour.
MAX_LABEL_COUNT = 1 << 24
MIN_LATENCY_S = 1e-6
MAX_LATENCY_S = 3600.0


def profile_from_register(message: FlRegister, n_classes: int) -> ClientProfile:
    """The profile a registration gives; ProtocolError when a field does not fit."""
    client = message.client
    if not 0 <= client <= MAX_CLIENT_ID:
        raise ProtocolError(f"client id {client} is not in 0..{MAX_CLIENT_ID}")
    counts = message.label_counts
    if len(counts) != n_classes or not all(
        isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= MAX_LABEL_COUNT for c in counts
    ):
        raise ProtocolError(f"label_counts must be {n_classes} non-negative integers")
    if sum(counts) <= 0:
        raise ProtocolError("a client without samples cannot train")
    latency = float(message.latency_s)
    if not (math.isfinite(latency) and MIN_LATENCY_S <= latency <= MAX_LATENCY_S):
        raise ProtocolError(
            f"latency_s must be between {MIN_LATENCY_S:g} and {MAX_LATENCY_S:g} s, got {latency!r}"
        )
    return ClientProfile(client, latency, tuple(int(c) for c in counts))


class KeyIdentities:
    """One client id per key (with ``--keys``): a key that registered client 3 may
    register client 3 again (a reconnection), never another id. Without it, one
    client key registered 300 silent ids in a second and starved the real client
    (issue 33 finding 4)."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._keys: dict[int, bytes] = {}  # and back: an id a key registered stays its own

    def check(self, key: bytes, client: int) -> None:
        """ProtocolError when ``key`` already stands for another client id, or another
        key for this one (a released id may come back only with its own key)."""
        known = self._ids.get(key, client)
        if known != client:
            raise ProtocolError(
                f"this key registered client {known}; a key registers one client id "
                f"(give client {client} a key of its own: python -m zpipe keys --role client)"
            )
        if self._keys.get(client, key) != key:
            raise ProtocolError(f"client {client} was registered with another key")
        self._ids[key] = client
        self._keys[client] = key


class SenderRoles:
    """The roles of one key directory, checked per received message."""

    def __init__(self, keys_dir: Path) -> None:
        self._roles = KeyRoles.from_dir(keys_dir, implied=fl_implied_role)
        if self._roles.without_role():
            log.warning(
                "keys_without_role",
                keys=self._roles.without_role(),
                detail="roles.txt does not list these keys: they may not act as fl clients",
                fix="give fl client keys the client role (python -m zpipe keys --role client)",
            )

    def check(self, kind: str, frame: zmq.Frame) -> None:
        """RoleError when the key that sent ``frame`` may not send ``kind``."""
        key = security.sender_public_key(frame)
        if key is None:
            return  # not a CURVE connection: the allow-list already had its say
        self._roles.check(kind, key)


def fl_implied_role(name: str) -> Role:
    """A key's role in an fl-server's key directory without ``roles.txt``: the
    server's own key (and a coordinator's) is not a client; every other is."""
    return "coordinator" if name in ("fl-server", "coordinator") else "client"
