"""zpipe's typed protocol: one frozen dataclass per message kind, grouped by conversation.

    stage_control    stage <-> coordinator (membership, assignment, weights, links)
    bulk             stage <-> coordinator bulk state, chunked, on its own connection
    client_control   client <-> coordinator (runs, replicas, the cluster)
    data_plane       micro-batches, gradients, labels, losses, all-reduce
    peer             stage <-> stage on the probe socket (link probes, backups, fetches)
    storage          the coordinator's files (codec messages on disk)
    lossy            EdgePipe's lossy runs on ordinary stages
    federated        the federated server and its clients (fl-server, fl-client)
    repartition      a live re-partition of an asynchronous run (client, coordinator, stages)
    generation       a pipelined generation run (client, coordinator, stages, the ring)

Each class has ``to_message()`` and ``from_message(message)`` (which raises
:class:`~zpipe._errors.ProtocolError` on a body that does not fit). The schema
a kind is validated against is derived from its fields (``_schema.wire``);
:data:`REGISTRY` collects every kind, explicitly, and the codec
(:mod:`zpipe.transport.codec`) validates against it. The codec keeps framing.
"""

from __future__ import annotations

from zpipe.protocol import (
    bulk,
    client_control,
    data_plane,
    federated,
    generation,
    lossy,
    peer,
    repartition,
    stage_control,
    storage,
)
from zpipe.protocol._message import Message
from zpipe.protocol._schema import FieldSchema, TensorMessage, WireMessage
from zpipe.protocol.registry import Registry

CONVERSATIONS = (
    stage_control,
    bulk,
    client_control,
    data_plane,
    peer,
    storage,
    lossy,
    federated,
    repartition,
    generation,
)

REGISTRY = Registry(cls for module in CONVERSATIONS for cls in module.MESSAGES)

__all__ = [
    "CONVERSATIONS",
    "REGISTRY",
    "FieldSchema",
    "Message",
    "Registry",
    "TensorMessage",
    "WireMessage",
    "bulk",
    "client_control",
    "data_plane",
    "federated",
    "generation",
    "lossy",
    "peer",
    "stage_control",
    "storage",
]
