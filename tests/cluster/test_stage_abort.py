"""A stage's data port survives an admitted peer that filled it and went (issue 33).

libzmq 4.3.5 aborts the whole process ("Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)") when a connection's input was stopped at the
receive high-water mark with a ZMTP PING still undecoded in its buffer, the
connection then broke (the epoll error is taken while the input is stopped), and
the application later reads the queue: restarting the input decodes the PING and
answers it on the broken connection. The coordinator's ROUTER has no mark for this
reason (``tests/cluster/test_coordinator_abort.py``); a stage's data port had one.
zpipe's own PUSH peers send no PINGs, but any peer at an admitted address may.

The order is driven in a child process holding a stage's data port as
:class:`zpipe.stage.ports.StagePorts` opens it and an assignment reopens it (the
plan's limits, the upstream's host admitted, the guard running), which reads
nothing: a stage whose inbox is full while it computes. A PUSH with ZMTP
heartbeats fills the port while the child is stopped (a stage starved or paused),
gives up on it (heartbeat timeout: its connection closes) and does not come back.
When the child continues, its I/O thread reads a buffer of messages and PINGs,
stops at the mark, answers the PINGs before the stop on the closed connection (the
peer resets it), and the child then drains its queue. With the old mark (16) the
drain aborts; with the port's mark now (none) the child serves on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from tests._support import REPO_ROOT

CHILD = """
import asyncio, sys, time
import zmq
import zpipe.stage.ports as ports
from zpipe.stage.config import StageConfig
from zpipe.transport.sockets import ReceiveLimits, new_context

OLD = sys.argv[1] == "old"
if OLD and hasattr(ports, "DATA_PORT_RECV_HWM"):
    ports.DATA_PORT_RECV_HWM = None  # the plan's mark, as before


async def main():
    context = new_context()
    config = StageConfig(name="s0", coordinator="tcp://127.0.0.1:9", data_bind="tcp://127.0.0.1:0",
                         probe_bind="tcp://127.0.0.1:0")
    keys = ports.StageKeys.load(context, config)
    keys.data_addresses.replace(["127.0.0.1"])  # the assignment's upstream host
    stage_ports = ports.StagePorts.open(context, config, keys)
    # an assignment of a model whose activations are small: the plan's limits (mark 16)
    await stage_ports.reopen_data_in(ReceiveLimits.for_largest_message(4096))
    data = zmq.Socket.shadow(stage_ports.data_in.underlying)
    print(stage_ports.data_endpoint, data.getsockopt(zmq.RCVHWM), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # once stopped and continued
    await asyncio.sleep(1.0)  # the I/O thread reads what queued meanwhile, the peer resets
    drained = 0
    while data.poll(2000, zmq.POLLIN):
        data.recv_multipart()
        drained += 1
    print("alive", drained, len(stage_ports.data_guard.cuts), flush=True)
    stage_ports.close()
    keys.stop()


asyncio.run(main())
"""


def _fill_while_stopped_then_leave(config: str) -> tuple[int, str, str, int | None]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, config],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    recv_hwm = None
    try:
        assert child.stdout is not None and child.stdin is not None
        first = child.stdout.readline().split()
        assert first and first[0].startswith("tcp://"), child.communicate(timeout=60)
        endpoint, recv_hwm = first[0], int(first[1])
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.SNDHWM, 100_000)
        push.setsockopt(zmq.HEARTBEAT_IVL, 50)  # PINGs: what zpipe's own peers never send
        push.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
        push.setsockopt(zmq.RECONNECT_IVL, -1)  # gone for good, as a vanished device
        handshake = push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        push.connect(endpoint)
        assert handshake.poll(60_000), "the data port never admitted the peer"
        handshake.close(linger=0)
        time.sleep(0.2)  # a few PINGs answered (not a deadline: the stop waits for nothing)
        os.kill(child.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < 1.5:  # far more than 16 messages, and PINGs
                try:
                    push.send(b"d" * 120, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                time.sleep(0.004)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("continued\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        push.close(linger=0)
        context.term()
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err, recv_hwm


def test_a_heartbeating_peer_that_filled_the_data_port_and_went_does_not_abort_the_stage() -> None:
    code, out, err, recv_hwm = _fill_while_stopped_then_leave("new")
    assert code == 0, err[-3000:]
    assert recv_hwm == 0  # the input is never stopped
    alive, drained, cuts = out.split()[:3]
    assert alive == "alive" and int(drained) > 16  # nothing was held back at a mark
    assert int(cuts) == 0  # a few kilobytes: within the connection's budget


def test_the_old_data_port_mark_aborts_in_the_same_order() -> None:
    """The order above is the one that aborted: with the plan's mark, it still does."""
    code, _, err, recv_hwm = _fill_while_stopped_then_leave("old")
    assert recv_hwm == 16
    if code == 0:
        pytest.skip(f"the libzmq abort did not reproduce here: {zmq.zmq_version()}")
    assert code == -signal.SIGABRT, (code, err[-3000:])
    assert "stream_engine_base.cpp" in err


# ------------------------------------------------ the control DEALER (libzmq issue 3937)

CONTROL_CHILD = """
import asyncio, sys, time
import zmq
import zpipe.stage.ports as ports
from zpipe.stage.config import StageConfig
from zpipe.transport.sockets import SocketOptions, new_context

if sys.argv[1] == "old":
    import zpipe.transport.sockets as sockets
    sockets.HEARTBEAT_RECV_HWM = None  # the socket options' mark (16), as before


async def main():
    context = new_context()
    # heartbeats at a faster pace than the defaults (1 s, 5 s timeout): the same order
    options = SocketOptions(zmtp_heartbeat_ms=100, zmtp_heartbeat_timeout_ms=500)
    config = StageConfig(name="s0", coordinator=sys.argv[2], data_bind="tcp://127.0.0.1:0",
                         probe_bind="tcp://127.0.0.1:0", socket_options=options)
    keys = ports.StageKeys.load(context, config)
    stage_ports = ports.StagePorts.open(context, config, keys)
    control = zmq.Socket.shadow(stage_ports.control.underlying)
    print(control.getsockopt(zmq.ROUTING_ID).decode(), control.getsockopt(zmq.RCVHWM), flush=True)
    # a starved loop: nothing read for several heartbeat timeouts while the coordinator sends
    await asyncio.sleep(3.0)
    drained = 0
    while control.poll(1000, zmq.POLLIN):
        control.recv_multipart()
        drained += 1
    print("alive", drained, flush=True)
    stage_ports.close()
    keys.stop()


asyncio.run(main())
"""


def _starve_the_control_link(config: str) -> tuple[int, str, str, int]:
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 100_000)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CONTROL_CHILD, config, f"tcp://127.0.0.1:{port}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        first = child.stdout.readline().split()
        assert len(first) == 2, child.communicate(timeout=60)
        routing_id, recv_hwm = first[0].encode(), int(first[1])
        deadline = time.monotonic() + 60
        while True:  # until the stage's control link is connected
            try:
                router.send_multipart([routing_id, b"ack"], flags=zmq.NOBLOCK)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline, "the stage never connected"
                time.sleep(0.01)
        for _ in range(200):  # acks and commands, far more than a mark of 16
            router.send_multipart([routing_id, b"c" * 1000])
        out, err = child.communicate(timeout=120)
    finally:
        router.close(linger=0)
        context.term()
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err, recv_hwm


def test_a_starved_control_link_with_heartbeats_does_not_abort_the_stage() -> None:
    code, out, err, recv_hwm = _starve_the_control_link("new")
    assert code == 0, err[-3000:]
    assert recv_hwm == 0
    assert out.split()[0] == "alive"


def test_the_old_control_mark_aborts_when_the_link_is_starved() -> None:
    code, _, err, recv_hwm = _starve_the_control_link("old")
    assert recv_hwm == 16
    if code == 0:
        pytest.skip(f"the libzmq abort did not reproduce here: {zmq.zmq_version()}")
    assert code == -signal.SIGABRT, (code, err[-3000:])
    assert "_input_stopped" in err
