"""Fake peers (zpipe.testing.fake_peers) started before their coordinator listens."""

from __future__ import annotations

import asyncio

from zpipe.cluster.coordinator_process import PortHold
from zpipe.coordinator.server import Coordinator, CoordinatorConfig
from zpipe.testing.fake_peers import FakePeers
from zpipe.transport.sockets import SocketOptions


async def _start_peers_then_coordinator() -> tuple[bool, list[float], int]:
    # The port is held (bound, not listening) until the coordinator listens: the peers'
    # connections are refused as with nobody there, and no socket bound to port 0
    # meanwhile can be given it, as a port picked and left free for 4 s could be.
    hold = PortHold("tcp://127.0.0.1:0")
    endpoint = hold.endpoint
    # Each peer sends its registration again every second while nobody listens; they
    # queue until the send buffer is full (16 messages by default, 1 here), and a send
    # that found it full used to fail after reply_s, far shorter than the wait below
    # (a coordinator importing torch under load took 16 s to listen).
    peers = FakePeers(
        endpoint, 3, reply_s=0.2, register_timeout_s=60.0, options=SocketOptions(send_hwm=1)
    )
    starting = asyncio.create_task(peers.start())
    await asyncio.sleep(4.0)
    failed_early = starting.done()
    coordinator = Coordinator(CoordinatorConfig(bind=endpoint))
    ready = asyncio.Event()
    serving = asyncio.create_task(coordinator.serve(ready=ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        hold.close()
        await asyncio.wait_for(starting, 60)
        return (
            failed_early,
            [p.heartbeat_interval_s for p in peers.peers],
            len(coordinator.membership.alive()),
        )
    finally:
        hold.close()
        await peers.close()
        coordinator.stop()
        await asyncio.wait_for(serving, 30)


def test_fake_peers_started_first_register_once_the_coordinator_listens() -> None:
    failed_early, intervals, members = asyncio.run(_start_peers_then_coordinator())
    assert not failed_early
    assert all(interval > 0 for interval in intervals) and len(intervals) == 3
    assert members == 3
