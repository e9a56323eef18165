"""A stage's coordinator that reads nothing for longer than the silence limit, but
lives, is not given up on; once its socket closes, it is (issue 33: a flood at the
coordinator kept an idle stage's heartbeats unread for 60.6 s and the stage exited).

Real sockets in one process: the "coordinator" is a ROUTER that never reads, with a
small receive queue the stage's heartbeats fill (then libzmq stops reading that
connection, ZMTP pings included, and the stage's side drops and reconnects); the
stage's lifecycle hears only the control DEALER's monitor. Nothing depends on prompt
scheduling: a sign of life is either an up connection or a fresh handshake, and
the waits end on events with generous deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import replace

import zmq
import zmq.asyncio

from zpipe.protocol.stage_control import Register, Registered
from zpipe.stage.commands import Exit
from zpipe.stage.lifecycle import StageLifecycle
from zpipe.stage.link_watch import LINK_EVENTS, link_lag_s, watch_link
from zpipe.transport.sockets import SocketOptions, bind_endpoint, new_context, open_socket

LIMIT_S = 3.0  # the stage's --coordinator-timeout here
WAIT_S = 60.0  # generous: a loaded machine


async def test_a_coordinator_reading_nothing_is_waited_for_while_it_lives_not_once_closed() -> None:
    context = new_context()
    # pings every 0.2 s, a drop after 1 s unanswered: a sign of life at most 1.2 s old
    options = replace(SocketOptions(), zmtp_heartbeat_ms=200, zmtp_heartbeat_timeout_ms=1000)
    router = open_socket(context, zmq.ROUTER, options)
    router.setsockopt(zmq.RCVHWM, 4)
    endpoint = bind_endpoint(router, "tcp://127.0.0.1:0")
    dealer = open_socket(context, zmq.DEALER, options)
    dealer.setsockopt(zmq.SNDHWM, 4)
    monitor = dealer.get_monitor_socket(LINK_EVENTS)
    dealer.connect(endpoint)
    start = time.monotonic()
    stage = StageLifecycle(
        name="s0",
        coordinator=endpoint,
        registration=Register(name="s0", data_endpoint="tcp://127.0.0.1:1", info={}),
        connect_s=WAIT_S,
        silence_limit_s=LIMIT_S,
        now=start,
        link_lag_s=link_lag_s(options),
    )
    stage.registration_reply(Registered(name="s0", heartbeat_interval=0.1), start)
    watch = asyncio.create_task(watch_link(monitor, stage))
    try:
        # heartbeats the coordinator never reads, past the limit of silence
        while time.monotonic() - start < 2 * LIMIT_S:
            with contextlib.suppress(zmq.Again):
                await dealer.send(b"heartbeat", zmq.NOBLOCK)
            exits = [c for c in stage.heartbeat_due(time.monotonic()) if isinstance(c, Exit)]
            assert exits == [], f"given up on a live coordinator: {exits}"
            await asyncio.sleep(0.1)
        router.close(linger=0)  # the coordinator's process gone: its connection drops
        deadline = time.monotonic() + WAIT_S
        while stage._link_up and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert not stage._link_up, "the drop was never seen"
        gone = time.monotonic()
        # not before the limit after the last sign, by then at the latest
        assert not [c for c in stage.heartbeat_due(gone) if isinstance(c, Exit)]
        exits = [c for c in stage.heartbeat_due(gone + LIMIT_S + 0.01) if isinstance(c, Exit)]
        assert len(exits) == 1 and "no sign of its process" in exits[0].reason
    finally:
        watch.cancel()
        dealer.disable_monitor()
        monitor.close(linger=0)
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()
