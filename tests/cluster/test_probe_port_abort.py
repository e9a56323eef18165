"""A stage's probe port survives a heartbeating peer that filled it and went.

The probe port is a ROUTER every cluster member reaches (without ``--keys``, anyone
who reaches its port). It had a receive mark (the socket options' 16), and the order
that aborted the data port (``tests/cluster/test_stage_abort.py``) aborts it the same
way: libzmq 4.3.5 stops a connection's input at the mark with a ZMTP PING of the
peer's still undecoded, the peer's heartbeat times out and it goes (the connection
breaks while the input is stopped), and when the stage reads the queue, restarting
the input answers the PING on the broken connection: "Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)", SIGABRT. zpipe's own probers and peer transfers
send no PINGs (``zmtp_heartbeat=False``), but any member may: a stage that was paused
(SIGSTOP here; a starved or swapped-out one alike) while such a peer sent probes was
enough. With no mark the input is never stopped; the port's guard bounds what a
connection queues instead.
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

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, TCP_INFO")

WAIT_S = 60.0  # generous: a loaded machine; nothing below waits for a deadline to pass

CHILD = """
import asyncio, sys
import zmq
import zpipe.stage.ports as ports
from zpipe.stage.config import StageConfig
from zpipe.transport.sockets import new_context

if sys.argv[1] == "old":
    ports.PROBE_PORT_RECV_HWM = None  # the socket options' mark, as before


async def main():
    context = new_context()
    config = StageConfig(name="s0", coordinator="tcp://127.0.0.1:9", data_bind="tcp://127.0.0.1:0",
                         probe_bind="tcp://127.0.0.1:0")
    keys = ports.StageKeys.load(context, config)
    stage_ports = ports.StagePorts.open(context, config, keys)
    probe = zmq.Socket.shadow(stage_ports.probe_in.underlying)
    print(stage_ports.probe_endpoint, probe.getsockopt(zmq.RCVHWM), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # once stopped and continued
    await asyncio.sleep(1.0)  # the I/O thread reads what queued meanwhile, the peer resets
    drained = 0
    while probe.poll(2000, zmq.POLLIN):
        probe.recv_multipart()
        drained += 1
    guard = getattr(stage_ports, "probe_guard", None)
    print("alive", drained, len(guard.cuts) if guard is not None else -1, flush=True)
    stage_ports.close()
    keys.stop()


asyncio.run(main())
"""


def _fill_while_stopped_then_leave(config: str) -> tuple[int, str, str, int | None]:
    """A DEALER with ZMTP heartbeats (a cluster member's probe socket, set up as zpipe's
    own are not) connects to a stage's probe port, sends small messages while the stage
    is stopped, and goes for good when its heartbeat times out; then the stage goes on
    and reads its probe port. The stage's exit code, output and mark."""
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
    dealer = context.socket(zmq.DEALER)
    recv_hwm = None
    try:
        assert child.stdout is not None and child.stdin is not None
        first = child.stdout.readline().split()
        assert first and first[0].startswith("tcp://"), child.communicate(timeout=WAIT_S)
        endpoint, recv_hwm = first[0], int(first[1])
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 100_000)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, 50)  # PINGs: what zpipe's own probers never send
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
        dealer.setsockopt(zmq.RECONNECT_IVL, -1)  # gone for good, as a vanished device
        handshake = dealer.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        dealer.connect(endpoint)
        assert handshake.poll(int(WAIT_S * 1000)), "the probe port never admitted the peer"
        handshake.close(linger=0)
        time.sleep(0.2)  # a few PINGs answered (not a deadline: the stop waits for nothing)
        os.kill(child.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < 1.5:  # far more than 16 messages, and PINGs
                try:
                    dealer.send(b"p" * 120, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                time.sleep(0.004)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        child.stdin.write("continued\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=2 * WAIT_S)
    finally:
        dealer.close(linger=0)
        context.term()
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err, recv_hwm


def test_a_heartbeating_peer_that_filled_the_probe_port_does_not_abort_the_stage() -> None:
    code, out, err, recv_hwm = _fill_while_stopped_then_leave("new")
    assert code == 0, err[-3000:]
    assert recv_hwm == 0  # the input is never stopped
    alive, drained, cuts = out.split()[:3]
    assert alive == "alive" and int(drained) > 16  # nothing was held back at a mark
    assert int(cuts) == 0  # a few kilobytes: within the connection's budget


def test_the_old_probe_port_mark_aborts_in_the_same_order() -> None:
    """The order above is the one that aborts: with the options' mark, it still does."""
    code, _, err, recv_hwm = _fill_while_stopped_then_leave("old")
    assert recv_hwm == 16
    if code == 0:
        pytest.skip(f"the libzmq abort did not reproduce here: {zmq.zmq_version()}")
    assert code == -signal.SIGABRT, (code, err[-3000:])
    assert "stream_engine_base.cpp" in err
