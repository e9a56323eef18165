"""How big a message the client's sink takes in a run: sized from the model.

The sink (a PULL every run's last stage sends to) used the socket's 2 GiB per
frame, 16 queued per connection: an assigned last stage, or anyone who reached
the port, could park gigabytes in the client. A run of a model whose tensors can
be sized from its config alone gets, as a stage's data port does
(:func:`zpipe.stage.ports.data_port_limits`), the largest tensor any cut of the
model sends per sample (its outputs among them) times the most rows one
micro-batch has; anything else keeps the socket's limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zpipe.models import ModelSpec, load_layer_sequence
from zpipe.models.registry import USER_CODE_FAMILIES
from zpipe.models.size import largest_tensor_bytes_per_sample
from zpipe.transport.sockets import CURVE_FRAME_OVERHEAD, ReceiveLimits


def most_rows(batches: object, microbatch_size: int | None) -> int | None:
    """The most rows one micro-batch of ``batches`` has: ``microbatch_size`` when it
    is set, else the largest batch of a sequence (each batch is one micro-batch);
    None when that cannot be known before the stream (an iterator, a generator)."""
    if microbatch_size is not None:
        return microbatch_size
    if not isinstance(batches, Sequence) or not batches:
        return None
    rows = 0
    for batch in batches:
        tensors: Iterable[object] = (batch,) if hasattr(batch, "shape") else batch
        for t in tensors:
            shape = getattr(t, "shape", None)
            if not shape:
                return None  # the stream's own check refuses it with a clear error
            rows = max(rows, int(shape[0]))
    return rows or None


def sink_limits(spec: ModelSpec, rows: int | None, fallback: ReceiveLimits) -> ReceiveLimits:
    """The sink's limits for a run of ``spec`` whose micro-batches have at most
    ``rows`` rows (None: unknown, ``fallback``)."""
    if rows is None or spec.family in USER_CODE_FAMILIES:
        return fallback  # sized only by building user code: the socket's limits
    try:
        per_sample = largest_tensor_bytes_per_sample(load_layer_sequence(spec))
    except Exception:  # a spec the run itself will refuse, with its own clear error
        return fallback
    if per_sample is None:
        return fallback
    # never above the socket's own limit, CURVE's framing included
    largest = min(per_sample * rows, fallback.max_message_bytes - CURVE_FRAME_OVERHEAD)
    return ReceiveLimits.for_largest_message(largest)
