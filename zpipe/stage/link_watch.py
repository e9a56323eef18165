"""The control connection to the coordinator as libzmq sees it: signs of its process.

A coordinator whose receive queue is flooded (issue 33: 18 M one-byte frames from
three connections) reads a stage's heartbeats late, while libzmq's I/O thread,
apart from its event loop, still completes handshakes and answers the ZMTP pings
of the stage's control DEALER. Those are signs that its process lives, which a
flood of its receive queue does not stop. This watch feeds them to the lifecycle
(:meth:`~zpipe.stage.lifecycle.StageLifecycle.link_up` and ``link_down``), which
then waits on for a coordinator that is silent but there, and still finds one that
is gone (its connection dropped) within ``--coordinator-timeout``.

The monitor is made before the control socket connects
(:class:`~zpipe.stage.ports.StagePorts`), so no event is missed; events wait in
its queue until this reads them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from zpipe.log import get_logger
from zpipe.transport.sockets import SocketOptions

log = get_logger("zpipe.stage")

# A handshake completed: the coordinator's process answered now. A drop: its process
# closed the connection, or the ZMTP pings went unanswered for their timeout.
LINK_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class LinkSink(Protocol):
    def link_up(self, now: float) -> None: ...

    def link_down(self, now: float) -> None: ...


def link_lag_s(options: SocketOptions) -> float:
    """How long ago an up connection last heard its peer at most: a ping interval
    and its timeout. Without ZMTP pings an up connection proves nothing (a peer
    behind a cut link keeps it up until TCP gives up): infinite."""
    if options.zmtp_heartbeat_ms <= 0:
        return math.inf
    return (options.zmtp_heartbeat_ms + options.zmtp_heartbeat_timeout_ms) / 1000


def on_event(frames: list[Any], sink: LinkSink, now: float) -> bool:
    """Feed one monitor message to ``sink``; whether it was a link event."""
    event = parse_monitor_message(frames)["event"]
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        sink.link_up(now)
    elif event == zmq.EVENT_DISCONNECTED:
        sink.link_down(now)
    else:
        return False
    return True


async def watch_link(
    monitor: Any, sink: LinkSink, clock: Callable[[], float] = time.monotonic
) -> None:
    """Read the control socket's monitor for ever (cancelled when the stage closes:
    an inproc socket, filled only by libzmq)."""
    while True:
        frames = await monitor.recv_multipart()
        try:
            on_event(frames, sink, clock())
        except Exception as exc:  # a malformed monitor event must not end the watch
            log.warning("monitor_event_dropped", error=repr(exc))
