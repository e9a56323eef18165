"""The messages of networked federated learning (zpipe.federated.net_server, .net_client).

::

    client -> server   fl_register   my id, label counts (never samples), profiled latency
                       fl_update     a task's trained weights (one float64 tensor)
                       fl_probe_reply  a probe's work is done (the round trip is my latency)
    server -> client   fl_welcome    registered: wait for tasks
                       fl_task       train these weights (one float64 tensor) and send them back
                       fl_error      your message was refused (why)
                       fl_done       the run is over: exit
                       fl_probe      do a small task's work and answer (latency probe)

The weights cross as one flat float64 tensor, a raw frame: nothing is pickled.
These kinds travel on the federated server's own socket, not the coordinator's,
so they have no role in :mod:`zpipe.transport.roles`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    INT,
    LIST,
    NUM,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)


@wire_message
class FlRegister(WireMessage):
    KIND: ClassVar[str] = "fl_register"
    client: int = wire(INT)
    label_counts: list[Any] = wire(LIST)
    latency_s: float = wire(NUM)


@wire_message
class FlWelcome(WireMessage):
    KIND: ClassVar[str] = "fl_welcome"
    client: int = wire(INT)


@wire_message
class FlTask(TensorMessage):
    """``shape``: the MLP's [inputs, hidden, outputs]; FedProx's ``mu`` pulls the local model
    towards the weights received; ``seed`` seeds the client's batch sampling."""

    KIND: ClassVar[str] = "fl_task"
    task: int = wire(INT)
    version: int = wire(INT)
    shape: list[Any] = wire(LIST)
    local_steps: int = wire(INT)
    batch_size: int = wire(INT)
    lr: float = wire(NUM)
    mu: float = wire(NUM)
    seed: int = wire(INT)


@wire_message
class FlUpdate(TensorMessage):
    KIND: ClassVar[str] = "fl_update"
    task: int = wire(INT)
    client: int = wire(INT)
    n_samples: int = wire(INT)
    train_s: float = wire(NUM)


@wire_message
class FlError(WireMessage):
    KIND: ClassVar[str] = "fl_error"
    reason: str = wire(STR)


@wire_message
class FlDone(WireMessage):
    KIND: ClassVar[str] = "fl_done"
    reason: str = wire(STR)


@wire_message
class FlProbe(WireMessage):
    """Do the work of a small task (``--profile-steps`` steps at your current speed) and
    answer with ``fl_probe_reply``: how a dropped client's latency is measured again."""

    KIND: ClassVar[str] = "fl_probe"
    probe: int = wire(INT)


@wire_message
class FlProbeReply(WireMessage):
    """``work_s``: what the probe's work took on the client (informational: the server
    measures the round trip)."""

    KIND: ClassVar[str] = "fl_probe_reply"
    probe: int = wire(INT)
    client: int = wire(INT)
    work_s: float = wire(NUM)


MESSAGES: tuple[type[WireMessage], ...] = (
    FlRegister,
    FlWelcome,
    FlTask,
    FlUpdate,
    FlError,
    FlDone,
    FlProbe,
    FlProbeReply,
)
