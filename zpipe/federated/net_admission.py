"""Who may take part in a networked federated run, and what a registration must hold.

- :func:`profile_from_register`: an ``fl_register`` checked into a
  :class:`ClientProfile` (label counts over the run's classes, a finite
  latency, an id in range), or a :class:`ProtocolError` that says why not.
- :class:`SenderRoles`: with ``--keys DIR``, the roles of ``DIR/roles.txt``
  (:mod:`zpipe.transport.roles`) on the federated socket. A key may act as
  an fl client (send ``fl_register``, ``fl_update``, ``fl_probe_reply``) only
  with the ``client`` role; a key listed only as a stage, say, is refused. A
  key without a recorded role (or a directory without ``roles.txt``) keeps
  every kind, as before roles existed, and the server says so once per key.
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
from zpipe.transport.keys import key_prefix
from zpipe.transport.roles import KeyRoles

log = get_logger("zpipe.federated.server")

MAX_CLIENT_ID = 1_000_000
MAX_LABEL_COUNT = 1 << 31


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
    if not (latency >= 0 and math.isfinite(latency)):
        raise ProtocolError(f"latency_s must be finite and >= 0, got {latency!r}")
    return ClientProfile(client, latency, tuple(int(c) for c in counts))


class SenderRoles:
    """The roles of one key directory, checked per received message."""

    def __init__(self, keys_dir: Path) -> None:
        self._roles = KeyRoles.from_dir(keys_dir)
        self._unchecked: set[bytes] = set()

    def check(self, kind: str, frame: zmq.Frame) -> None:
        """RoleError when the key that sent ``frame`` may not send ``kind``."""
        key = security.sender_public_key(frame)
        if key is None:
            return  # not a CURVE connection: the allow-list already had its say
        if not self._roles.check(kind, key) and key not in self._unchecked:
            self._unchecked.add(key)
            log.warning(
                "role_unchecked",
                key=key_prefix(key),
                detail="this key has no role in roles.txt; it may act as an fl client",
                fix="give fl client keys the client role (python -m zpipe keys --role client)",
            )
