"""The messages of EdgePipe's lossy runs on ordinary stages (zpipe.coordinator.runs.lossy,
zpipe.stage.executors.lossy)::

    client -> coordinator  lossy_run_request  run parameters; initial weights, inputs, labels
    coordinator -> stage   lossy_setup        a run: spec, peers' endpoints, names and keys;
                                              weight slices, inputs, labels
                           lossy_go           start the passes (start_in_s after receipt)
                           lossy_dead         a device of the run died: null-fill its partials
                                              (remap: and say how far you got: lossy_hold)
                           lossy_remap        from mini-batch switch_at on, run this
                                              allocation (or, without one, go on null-filling)
                           lossy_probe_request  before mapping: measure your links (then
                                              lossy_ready; lossy_go starts the probes)
    stage -> coordinator   lossy_probe_report probes received from each peer
    stage -> stage         lossy_probe, lossy_probe_end  on the data sockets
    stage -> coordinator   lossy_ready, lossy_result, lossy_hold, lossy_replica (its
                                              slices every replica_every mini-batches)
    stage -> stage         lossy_partial      on the stages' data sockets (r-TX, ACK: one
                                              per copy, numbered by copy)
                           lossy_ack          ACK: receiver -> sender, one per copy received
    coordinator -> client  lossy_run_report   the allocation; every device's result and weights

msgpack map keys must be strings, so device indices appear as strings in maps.
The run spec crosses as plain data; zpipe.lossy.wire.RunSpec reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from zpipe._errors import ProtocolError
from zpipe.protocol._message import Message
from zpipe.protocol._schema import (
    BOOL,
    INT,
    LIST,
    MAP,
    NUM,
    OPT_BOOL,
    OPT_INT,
    OPT_LIST,
    OPT_MAP,
    OPT_NUM,
    OPT_STR,
    STR,
    TensorMessage,
    WireMessage,
    check_body,
    wire,
    wire_message,
)


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
    # on ordinary stages: each device's stage name and CURVE public key, by device index
    names: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    keys: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # send the coordinator a replica of your slices (lossy_replica) after every
    # replica_every-th mini-batch: what a remap gives the survivors of your neurons
    replica_every: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class LossyReplica(TensorMessage):
    """Stage -> coordinator: this device's slices right after its last pass of
    mini-batch ``step`` (its backward pass of its lowest dense layer). Tensors: ``(W, b)``
    of each ``[layer, start, stop]`` of ``slices``."""

    KIND: ClassVar[str] = "lossy_replica"
    run: int = wire(INT)
    device: int = wire(INT)
    step: int = wire(INT)
    slices: list[Any] = wire(LIST)
    # its stage's name (state a stage sends on its bulk connection names its sender)
    name: str | None = wire(OPT_STR, default=None, omit_if_none=True)


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
    # on ordinary stages: start this long after receipt (start_at is then ignored)
    start_in_s: float | None = wire(OPT_NUM, default=None, omit_if_none=True)


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
    # from a stage: its name (state a stage sends on its bulk connection names its sender)
    name: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    # devices the coordinator declared dead during the run: device -> the first
    # mini-batch whose passes here ran without its partials (null if none needed them)
    dead: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # partials of another run or plan epoch this stage dropped since the run's set-up
    stale: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # the test passes under loss after training (when the spec asked for them):
    # {"predictions": [[step, [class, ...]], ...] (output owners), "traffic": {...},
    #  "arrivals": [[step, kind, key_layer, [senders]], ...], "null_filled": n}
    test: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # what really crossed the wire (zpipe.stage.executors.lossy_recovery.WireCounts): copies sent
    # and lost, duplicates discarded, acknowledgements sent, lost, received, dropped
    on_wire: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    # ACK in the emulated wait mode: per receiver ("device" -> counts), the promised
    # acknowledgements this stage awaited, found overdue, did not await (the receiver
    # silent since an overdue one) and the silences ended by hearing from it again
    # (zpipe.lossy.ack_patience); omitted when none was promised
    ack_waits: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class LossyDead(WireMessage):
    """Coordinator -> the run's other stages: ``device`` was declared dead; wait no more
    for its partials (null-fill them) and send it none."""

    KIND: ClassVar[str] = "lossy_dead"
    run: int = wire(INT)
    device: int = wire(INT)
    # the run re-maps the dead device's neurons: answer lossy_hold, and start no
    # mini-batch beyond the one you reached until lossy_remap says where it switches
    remap: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class LossyHold(WireMessage):
    """Stage -> coordinator, answering a ``lossy_dead`` with ``remap``: ``frontier``, the
    last mini-batch whose passes it started (``n_data + 1``: it is past training)."""

    KIND: ClassVar[str] = "lossy_hold"
    run: int = wire(INT)
    device: int = wire(INT)
    frontier: int = wire(INT)


@wire_message
class LossyRemap(TensorMessage):
    """Coordinator -> the survivors, after every ``lossy_hold``: finish the mini-batches
    before ``switch_at`` on the old allocation, then run ``switch_at..n_data`` on
    ``alloc`` (zpipe.lossy.remap). ``switch_at`` null: no remap, go on null-filling.
    Tensors: ``(W, b)`` of each ``pieces`` entry ``[layer, start, stop]`` (the rows this
    stage takes over, at their run-start values); then, if ``inputs``, every mini-batch's
    inputs (and the test inputs, when the run has test passes); then, if ``labels``,
    the labels."""

    KIND: ClassVar[str] = "lossy_remap"
    run: int = wire(INT)
    switch_at: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    alloc: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    pieces: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    inputs: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)
    labels: bool | None = wire(OPT_BOOL, default=None, omit_if_none=True)


@wire_message
class LossyPartial(TensorMessage):
    KIND: ClassVar[str] = "lossy_partial"
    run: int = wire(INT)
    data: int = wire(INT)
    kind: str = wire(STR)
    layer: int = wire(INT)
    src: int = wire(INT)
    # r-TX and ACK: which copy this is (a receiver keeps the first, counts the others);
    # ACK: the copy's drop key (the sending layer and direction), which keys the
    # acknowledgement's own fate on the reverse link
    copy: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    link_layer: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    direction: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class LossyAck(WireMessage):
    """Stage -> stage, on the data port (ACK recovery): device ``src`` received copy
    ``copy`` of the partial ``(data, kind, layer)`` that the addressee sent it."""

    KIND: ClassVar[str] = "lossy_ack"
    run: int = wire(INT)
    data: int = wire(INT)
    kind: str = wire(STR)
    layer: int = wire(INT)
    src: int = wire(INT)
    copy: int = wire(INT)


@wire_message
class LossyProbeRequest(WireMessage):
    """Coordinator -> stage: measure my links before a lossy run is mapped: ``count``
    probes to every peer of ``peers`` (device -> data endpoint), each one's fate the
    seeded decision of ``prr`` (``[src][dst]``), then ``lossy_probe_end``. The stage
    answers ``lossy_ready`` once it takes probes, and probes at ``lossy_go``."""

    KIND: ClassVar[str] = "lossy_probe_request"
    run: int = wire(INT)
    seed: int = wire(INT)
    count: int = wire(INT)
    prr: list[Any] = wire(LIST)
    peers: dict[str, Any] = wire(MAP)
    timeout_s: float = wire(NUM)
    # on ordinary stages: this stage's device index, and its peers' names and keys
    device: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    names: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    keys: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)


@wire_message
class LossyProbe(WireMessage):
    """Stage -> stage, on the data port: one link-measurement probe."""

    KIND: ClassVar[str] = "lossy_probe"
    run: int = wire(INT)
    src: int = wire(INT)
    seq: int = wire(INT)


@wire_message
class LossyProbeEnd(WireMessage):
    """Stage -> stage, after its probes on the same link: how many it tried."""

    KIND: ClassVar[str] = "lossy_probe_end"
    run: int = wire(INT)
    src: int = wire(INT)
    sent: int = wire(INT)


@wire_message
class LossyProbeReport(WireMessage):
    """Stage -> coordinator: probes received from each peer (``src`` -> n), and how
    many each peer tried."""

    KIND: ClassVar[str] = "lossy_probe_report"
    run: int = wire(INT)
    device: int = wire(INT)
    received: dict[str, Any] = wire(MAP)
    sent: dict[str, Any] = wire(MAP)
    error: str = wire(STR)


@wire_message
class LossyRunRequest(TensorMessage):
    """An EdgePipe run on ordinary stages. ``layer_sizes``: the MLP's neuron layers
    (input first); ``allocation``: naive, vertical, hybrid or horizontal (Algorithm 1);
    ``mapping``: genetic, exhaustive, random or identity (Algorithm 2) on
    ``prr_measured`` (by device index; the stages in ``stage_names`` order, or by
    name); ``spec``: the rest of a zpipe.lossy.wire.RunSpec body (no ``alloc``).
    Tensors: ``(W, b)`` of every dense layer in order, then the inputs
    ``(n_data, batch, features)`` (float64) and labels ``(n_data, batch)`` (int64)."""

    KIND: ClassVar[str] = "lossy_run_request"
    layer_sizes: list[Any] = wire(LIST)
    allocation: str = wire(STR)
    mapping: str = wire(STR)
    prr_measured: list[Any] = wire(LIST)
    spec: dict[str, Any] = wire(MAP)
    stages: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    stage_names: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    wait_for_stages_s: float = wire(NUM)
    result_s: float = wire(NUM)
    start_in_s: float | None = wire(OPT_NUM, default=None, omit_if_none=True)
    # have the stages measure their links with this many probes each (EdgePipe: 50)
    # and map on that instead of prr_measured
    probes: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # what a stage's death does to the run: "null-fill" (the default) or "remap"
    on_death: str | None = wire(OPT_STR, default=None, omit_if_none=True)
    # the client's id of this request: one sent again after a reconnection shares the
    # answer being made (a restarted coordinator runs it again from the start)
    request_id: int | None = wire(OPT_INT, default=None, omit_if_none=True)
    # each stage sends a replica of its slices every this many mini-batches (remap)
    replica_every: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class LossyRunReport(TensorMessage):
    """The end of a lossy run on stages: ``alloc`` as mapped, ``stages`` the stage name
    of each device index, ``results`` each device's ``lossy_result`` body (no tensors);
    the final weight slices follow as tensors, device by device in ``results`` order."""

    KIND: ClassVar[str] = "lossy_run_report"
    run: int = wire(INT)
    alloc: dict[str, Any] = wire(MAP)
    stages: list[Any] = wire(LIST)
    results: list[Any] = wire(LIST)
    # devices declared dead during the run: [device, stage, first mini-batch null-filled]
    dead: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    # the reception ratios the stages measured (``[src][dst]``), when the run asked
    measured: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    # re-mapped deaths, in order: [device, stage, switch_at, allocation after, the
    # mini-batch of the dead device's replica its neurons resumed from (null: run start)]
    remaps: list[Any] | None = wire(OPT_LIST, default=None, omit_if_none=True)
    # each stage's counters at the run's end, as a run_report's stages
    metrics: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)

    def device_results(self) -> list[LossyResult]:
        """``results``, typed, each with its final weight slices (two tensors a layer);
        :class:`ProtocolError` if the results and the tensors do not match."""
        out = []
        tensors = list(self.tensors)
        for body in self.results:
            if not isinstance(body, dict):
                raise ProtocolError("lossy_run_report: every result must be a map")
            layers = body.get("layers")
            if not isinstance(layers, list) or len(tensors) < 2 * len(layers):
                raise ProtocolError("lossy_run_report: results and tensors do not match")
            mine, tensors = tensors[: 2 * len(layers)], tensors[2 * len(layers) :]
            result = Message(LossyResult.KIND, body, tensors=tuple(mine))
            out.append(LossyResult.from_message(result))
        if tensors:
            raise ProtocolError("lossy_run_report: more tensors than results")
        return out


# ---------------------------------------------------------------- maps nested in bodies
# Maps that lossy bodies carry inside a field, declared the way bodies are (wire fields,
# checked by the one validator of bodies) so that nothing outside protocol/ reads them by
# key. None is a message of its own: no KIND, never in MESSAGES; ``epoch`` is unused.

_N = TypeVar("_N", bound="NestedMap")


@dataclass(frozen=True, kw_only=True)
class NestedMap(WireMessage):
    """A map nested in a body: :meth:`from_map` checks and types it, :meth:`body` writes it."""

    #: where the map sits, for errors ("lossy_setup: spec")
    WHERE: ClassVar[str] = ""

    @classmethod
    def from_map(cls: type[_N], value: Any) -> _N:
        """The typed form of ``value``; :class:`ProtocolError` if it does not fit."""
        body = check_body(cls.WHERE, cls.schema(), value)
        values: dict[str, Any] = {f.attr: body.get(f.key) for f in cls.wire_fields()}
        return cls(**values)


@wire_message
class LossyRecoveryMap(NestedMap):
    """A run spec's recovery scheme (zpipe.lossy.links.Recovery)."""

    WHERE: ClassVar[str] = "lossy run spec: recovery"
    scheme: str = wire(STR)
    copies: int = wire(INT)
    max_attempts: int = wire(INT)


@wire_message
class LossyEvalMap(NestedMap):
    """A run spec's test passes under loss after training (zpipe.lossy.evaluation.EvalSpec)."""

    WHERE: ClassVar[str] = "lossy run spec: test"
    n_test: int = wire(INT)
    batch: int = wire(INT)
    repeats: int = wire(INT)
    eval_index: int = wire(INT)


@wire_message
class LossyCnnMap(NestedMap):
    """A run spec's CNN (zpipe.lossy.cnn.CnnSpec)."""

    WHERE: ClassVar[str] = "lossy run spec: cnn"
    image: list[Any] = wire(LIST)
    channels: list[Any] = wire(LIST)
    hidden: list[Any] = wire(LIST)
    n_classes: int = wire(INT)


@wire_message
class LossyRunSpecMap(NestedMap):
    """``lossy_setup``'s ``spec`` (zpipe.lossy.wire.RunSpec): what every device of a run
    agrees on. ``lossy_run_request``'s spec is the same less ``alloc`` (the coordinator
    maps it), plus ``conv_devices`` for a CNN's partition (never sent to a stage)."""

    WHERE: ClassVar[str] = "lossy run spec"
    alloc: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    prr: list[Any] = wire(LIST)
    seed: int = wire(INT)
    recovery: dict[str, Any] = wire(MAP)
    lossless: bool = wire(BOOL)
    lr: float = wire(NUM)
    n_data: int = wire(INT)
    batch: int = wire(INT)
    mode: str = wire(STR)
    slot_s: float = wire(NUM)
    wait_s: float = wire(NUM)
    test: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    cnn: dict[str, Any] | None = wire(OPT_MAP, default=None, omit_if_none=True)
    conv_devices: int | None = wire(OPT_INT, default=None, omit_if_none=True)


@wire_message
class LossyTestSummary(NestedMap):
    """``lossy_result``'s ``test``: what a device's test passes did (output owners: its
    predicted classes by test step), their traffic and arrivals, and how many ran with
    partials null-filled."""

    WHERE: ClassVar[str] = "lossy_result: test"
    predictions: list[Any] = wire(LIST)
    traffic: dict[str, Any] = wire(MAP)
    arrivals: list[Any] = wire(LIST)
    null_filled: int = wire(INT)


MESSAGES: tuple[type[WireMessage], ...] = (
    LossySetup,
    LossyReady,
    LossyGo,
    LossyResult,
    LossyDead,
    LossyHold,
    LossyRemap,
    LossyReplica,
    LossyPartial,
    LossyAck,
    LossyProbeRequest,
    LossyProbe,
    LossyProbeEnd,
    LossyProbeReport,
    LossyRunRequest,
    LossyRunReport,
)
