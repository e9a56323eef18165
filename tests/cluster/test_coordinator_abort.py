"""The coordinator's ROUTER survives a peer that filled its queue and went (issue 33).

libzmq 4.3.5 stops reading a connection whose queue reached the receive high-water
mark; if that connection then breaks, and the application later reads the queue,
the engine decodes what was left of its last read, answers a ZMTP PING found there
on the broken connection and aborts the process ("Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)"). Stages and clients send PINGs (their DEALERs'
ZMTP heartbeats), and a coordinator paused or starved for a few seconds left 16 of
their heartbeats unread: a coordinator died of SIGABRT under load.

The order is driven here, in a child process holding the coordinator's ROUTER as
:meth:`ControlPort.open` makes it: a heartbeating DEALER queues messages while
the child is stopped, gives up on it (heartbeat timeout) and does not come back;
the child answers it on the broken connection (its peer resets it) and drains the
queue. With the old high-water mark (16) it aborts; with none it serves on.
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
import sys, time
import zmq
import zpipe.coordinator.control_port as control_port
import zpipe.coordinator.server as server

if sys.argv[1] == "old":
    control_port.COORDINATOR_RECV_HWM = 16
coordinator = server.Coordinator(server.CoordinatorConfig(bind="tcp://127.0.0.1:0"))
coordinator._setup()
router = zmq.Socket.shadow(coordinator.port.router.underlying)
print(coordinator.endpoint, flush=True)
peer = sys.stdin.readline().strip().encode()  # once stopped and continued
time.sleep(0.3)  # the I/O thread reads what queued meanwhile
for _ in range(5):  # answers on the broken connection: its peer resets it
    try:
        router.send_multipart([peer, b"ack"], flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        pass
    time.sleep(0.1)
drained = 0
while router.poll(2000, zmq.POLLIN):
    router.recv_multipart()
    drained += 1
print("alive", drained, flush=True)
"""


def _fill_while_stopped_then_leave(config: str) -> tuple[int, str, str]:
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
    try:
        assert child.stdout is not None and child.stdin is not None
        endpoint = child.stdout.readline().strip()
        assert endpoint.startswith("tcp://"), child.communicate(timeout=60)
        peer = f"stage-{config}".encode()
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.ROUTING_ID, peer)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, 50)  # a stage's DEALER, at a faster pace
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, 300)
        dealer.setsockopt(zmq.RECONNECT_IVL, -1)  # gone for good, as a killed stage
        dealer.connect(endpoint)
        dealer.send(b"hello")
        time.sleep(0.5)  # connected (not a deadline: the stop below waits for nothing)
        os.kill(child.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while time.monotonic() - stopped < 1.5:  # far more than 16 heartbeats, and PINGs
                try:
                    dealer.send(b"h" * 120, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                time.sleep(0.004)
        finally:
            os.kill(child.pid, signal.SIGCONT)
        child.stdin.write(peer.decode() + "\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        dealer.close(linger=0)
        context.term()
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err


def test_a_peer_that_filled_the_queue_and_went_does_not_abort_the_coordinator() -> None:
    code, out, err = _fill_while_stopped_then_leave("new")
    assert code == 0, err[-3000:]
    assert out.split()[0] == "alive" and int(out.split()[1]) > 16  # nothing was held back


def test_the_old_high_water_mark_aborts_in_the_same_order() -> None:
    """The order above is the one that aborted: with the old mark, it still does."""
    code, _, err = _fill_while_stopped_then_leave("old")
    if code == 0:
        pytest.skip(f"the libzmq abort did not reproduce here: {zmq.zmq_version()}")
    assert code == -signal.SIGABRT, (code, err[-3000:])
    assert "stream_engine_base.cpp" in err
