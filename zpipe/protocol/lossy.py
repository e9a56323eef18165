"""The messages of EdgePipe's lossy device processes (zpipe.lossy.multiprocess, .device).

::

    launcher -> device   lossy_setup          a run: spec, peers; weight slices, inputs, labels
                         lossy_go             start the passes (deadline mode: at start_at)
                         lossy_probe_request  measure my links: send probes to every peer
                         shutdown             exit (stage_control.Shutdown)
    device -> launcher   lossy_hello          my index, data endpoint and pid
                         lossy_ready          set up and connected to my peers
                         lossy_result         losses, counters, arrivals; final weight slices
                         lossy_probe_report   probes received from each peer
    device -> device     lossy_partial        one partial (a float64 tensor)
                         lossy_probe          one link-measurement probe
                         lossy_probe_end      how many probes the sender tried

msgpack map keys must be strings, so device indices appear as strings in maps.
The run spec crosses as plain data; zpipe.lossy.wire.RunSpec reads it.
"""

from __future__ import annotations

from typing import Any, ClassVar

from zpipe.protocol._schema import (
    BOOL,
    INT,
    LIST,
    MAP,
    NUM,
    STR,
    TensorMessage,
    WireMessage,
    wire,
    wire_message,
)


@wire_message
class LossyHello(WireMessage):
    KIND: ClassVar[str] = "lossy_hello"
    device: int = wire(INT)
    endpoint: str = wire(STR)
    pid: int = wire(INT)


@wire_message
class LossySetup(TensorMessage):
    """The (W, b) slices of the dense ``layers`` follow as tensors, in order; then the
    inputs of every mini-batch (``inputs``: input owners); then the labels (``labels``:
    output owners)."""

    KIND: ClassVar[str] = "lossy_setup"
    run: int = wire(INT)
    device: int = wire(INT)
    spec: dict[str, Any] = wire(MAP)
    peers: dict[str, Any] = wire(MAP)
    layers: list[Any] = wire(LIST)
    inputs: bool = wire(BOOL)
    labels: bool = wire(BOOL)


@wire_message
class LossyReady(WireMessage):
    KIND: ClassVar[str] = "lossy_ready"
    run: int = wire(INT)
    device: int = wire(INT)
    error: str = wire(STR)


@wire_message
class LossyGo(WireMessage):
    KIND: ClassVar[str] = "lossy_go"
    run: int = wire(INT)
    start_at: float = wire(NUM)


@wire_message
class LossyResult(TensorMessage):
    """``losses``: [data, loss] of this output owner's view; ``arrivals``: [data, kind,
    key_layer, [senders]]; ``waits``: [data, kind, key_layer, missing, deadline,
    proceeded]; the final weight slices of ``layers`` follow as tensors."""

    KIND: ClassVar[str] = "lossy_result"
    run: int = wire(INT)
    device: int = wire(INT)
    error: str = wire(STR)
    layers: list[Any] = wire(LIST)
    losses: list[Any] = wire(LIST)
    propagation: dict[str, Any] = wire(MAP)
    traffic: dict[str, Any] = wire(MAP)
    arrivals: list[Any] = wire(LIST)
    waits: list[Any] = wire(LIST)
    late: int = wire(INT)
    protocol_errors: int = wire(INT)
    wall_s: float = wire(NUM)


@wire_message
class LossyPartial(TensorMessage):
    KIND: ClassVar[str] = "lossy_partial"
    run: int = wire(INT)
    data: int = wire(INT)
    kind: str = wire(STR)
    layer: int = wire(INT)
    src: int = wire(INT)


@wire_message
class LossyProbeRequest(WireMessage):
    KIND: ClassVar[str] = "lossy_probe_request"
    run: int = wire(INT)
    seed: int = wire(INT)
    count: int = wire(INT)
    prr: list[Any] = wire(LIST)
    peers: dict[str, Any] = wire(MAP)
    timeout_s: float = wire(NUM)


@wire_message
class LossyProbe(WireMessage):
    KIND: ClassVar[str] = "lossy_probe"
    run: int = wire(INT)
    src: int = wire(INT)
    seq: int = wire(INT)


@wire_message
class LossyProbeEnd(WireMessage):
    KIND: ClassVar[str] = "lossy_probe_end"
    run: int = wire(INT)
    src: int = wire(INT)
    sent: int = wire(INT)


@wire_message
class LossyProbeReport(WireMessage):
    KIND: ClassVar[str] = "lossy_probe_report"
    run: int = wire(INT)
    device: int = wire(INT)
    received: dict[str, Any] = wire(MAP)
    sent: dict[str, Any] = wire(MAP)
    error: str = wire(STR)


MESSAGES: tuple[type[WireMessage], ...] = (
    LossyHello,
    LossySetup,
    LossyReady,
    LossyGo,
    LossyResult,
    LossyPartial,
    LossyProbeRequest,
    LossyProbe,
    LossyProbeEnd,
    LossyProbeReport,
)
