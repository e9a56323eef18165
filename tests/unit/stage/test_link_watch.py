"""The control connection's monitor events, fed to the lifecycle (no sockets)."""

from __future__ import annotations

import math
import struct
from dataclasses import replace

import zmq

from zpipe.stage.link_watch import link_lag_s, on_event
from zpipe.transport.sockets import SocketOptions


class Sink:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def link_up(self, now: float) -> None:
        self.seen.append(("up", now))

    def link_down(self, now: float) -> None:
        self.seen.append(("down", now))


def monitor_message(event: int) -> list[bytes]:
    """What libzmq puts on a monitor socket: the event and a value, then the endpoint."""
    return [struct.pack("=hi", event, 0), b"tcp://127.0.0.1:4000"]


def test_handshakes_are_signs_of_life_and_drops_end_them() -> None:
    sink = Sink()
    assert on_event(monitor_message(zmq.EVENT_HANDSHAKE_SUCCEEDED), sink, 1.0)
    assert on_event(monitor_message(zmq.EVENT_DISCONNECTED), sink, 2.0)
    # a TCP connection alone is not the coordinator's process (a stopped one's kernel
    # still accepts): not a sign of life
    assert not on_event(monitor_message(zmq.EVENT_CONNECTED), sink, 3.0)
    assert sink.seen == [("up", 1.0), ("down", 2.0)]


def test_an_up_connection_vouches_for_a_ping_and_its_timeout_and_without_pings_for_nothing() -> (
    None
):
    options = SocketOptions()
    assert (
        link_lag_s(options)
        == (options.zmtp_heartbeat_ms + options.zmtp_heartbeat_timeout_ms) / 1000
    )
    assert link_lag_s(replace(options, zmtp_heartbeat_ms=0)) == math.inf
