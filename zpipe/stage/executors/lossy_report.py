"""What a stage's lossy run tells the coordinator, built from the run's state (pure):
its ``lossy_result`` at the end (counters, arrivals, waits, test passes, what crossed
the wire, the dead it null-filled and its final weight slices) and, every
``replica_every`` mini-batches, a ``lossy_replica`` of its slices. The executor
(:mod:`zpipe.stage.executors.lossy`) sends them."""

from __future__ import annotations

from typing import Any

from zpipe.lossy.device_run import DeviceRun
from zpipe.lossy.partial import FloatArray
from zpipe.lossy.partition import NeuronSlice
from zpipe.lossy.wire import to_tensor
from zpipe.protocol.lossy import LossyReplica, LossyResult, LossyTestSummary
from zpipe.stage.executors.lossy_passes import SharedInbox

#: by layer: the slice a device owns, its W and its b
Slices = dict[int, tuple[NeuronSlice, FloatArray, FloatArray]]


def run_result(
    st: DeviceRun,
    inbox: SharedInbox | None,
    *,
    device: int,
    error: str,
    protocol_errors: int,
    stale: int,
    wall_s: float,
    name: str,
    epoch: int,
) -> LossyResult:
    """Device ``device``'s ``lossy_result`` of run ``st`` (``inbox``: its passes' shared
    state, None if the run was never set up to receive)."""
    weights = st.shard.weights
    layers = sorted(weights)
    tensors = []
    for layer in layers:
        w, b = weights[layer]
        tensors += [to_tensor(w), to_tensor(b)]
    prop = st.propagation
    return LossyResult(
        run=st.run,
        device=device,
        error=error,
        layers=layers,
        losses=st.losses,
        propagation={
            "expected": dict(prop.expected),
            "received": dict(prop.received),
            "assemblies": dict(prop.assemblies),
            "complete": dict(prop.complete),
        },
        traffic={k: v.as_dict() for k, v in st.channel.traffic.items() if k != "test"},
        arrivals=[
            [data, kind, layer, list(senders)]
            for (data, kind, layer, _), senders in sorted(st.arrivals.items())
        ],
        waits=st.waits,
        late=st.late,
        protocol_errors=protocol_errors,
        stale=stale,
        test=evaluation_summary(st),
        on_wire=None if inbox is None else inbox.wire.as_dict(),
        ack_waits=(inbox.acks.waits_body() or None) if inbox is not None else None,
        wall_s=wall_s,
        name=name,
        dead={str(d): first for d, first in inbox.dead.items()}
        if inbox is not None and inbox.dead
        else None,
        tensors=tuple(tensors),
        epoch=epoch,
    )


def evaluation_summary(st: DeviceRun) -> dict[str, Any] | None:
    """What this device's test passes did (None: the run had none)."""
    if not st.tests:
        return None
    test = st.channel.traffic.get("test")
    return LossyTestSummary(
        predictions=[[step, classes] for step, classes in st.predictions.items()],
        traffic=test.as_dict() if test is not None else {},
        arrivals=[
            [step, kind, layer, list(senders)]
            for (step, kind, layer, _), senders in sorted(st.test_arrivals.items())
        ],
        null_filled=st.test_null_filled,
    ).body()


def replica(
    st: DeviceRun, slices: Slices, *, device: int, step: int, name: str, epoch: int
) -> LossyReplica:
    """Device ``device``'s slices right after its last pass of mini-batch ``step``."""
    layers = sorted(slices)
    return LossyReplica(
        run=st.run,
        device=device,
        step=step,
        slices=[[n, slices[n][0].start, slices[n][0].stop] for n in layers],
        name=name,
        tensors=tuple(to_tensor(a) for n in layers for a in slices[n][1:]),
        epoch=epoch,
    )
