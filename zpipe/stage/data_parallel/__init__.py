"""The run-time side of data parallelism: the devices that share one pipeline stage
reduce their gradients in a ring (:class:`RingAllReduce`, over zpipe's sockets).

The pure arithmetic of the ring (its cost, schedule, segment layout and message
check) is :mod:`zpipe.training.ring`; this package owns the sockets and the awaits.
"""

from __future__ import annotations

from zpipe.stage.data_parallel.ring_allreduce import DEFAULT_SEGMENT_BYTES, RingAllReduce
from zpipe.stage.data_parallel.ring_links import RingPort

__all__ = ["DEFAULT_SEGMENT_BYTES", "RingAllReduce", "RingPort"]
