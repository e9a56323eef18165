"""Every socket with ZMTP heartbeats has no receive mark: the client's, the fl-client's
and a stage's control DEALERs.

libzmq 4.3.5 aborts the process ("Assertion failed: _input_stopped
(src/stream_engine_base.cpp:396)", upstream issues 3937 and 4767) when a heartbeating
socket's input was stopped at its mark and its heartbeat then timed out: a client
whose loop was starved for a heartbeat timeout while its server queued more than a
mark's worth of messages died. ``tests/cluster/test_stage_abort.py`` shows the abort
on a stage's control link; the rule lives in ``open_socket``, so each of these
sockets must carry it.
"""

from __future__ import annotations

import asyncio

import zmq

from zpipe.client import ClientConnection
from zpipe.config import Timeouts
from zpipe.federated.net_client import FederatedClient, NetClientConfig
from zpipe.lossy.data import load_digits_dataset
from zpipe.transport.ports import free_tcp_port
from zpipe.transport.sockets import SocketOptions, new_context, open_socket

OPTIONS = SocketOptions()  # a mark of 16, heartbeats every second


def _heartbeat_and_mark(sock: zmq.Socket[bytes]) -> tuple[int, int]:
    return sock.getsockopt(zmq.HEARTBEAT_IVL), sock.getsockopt(zmq.RCVHWM)


def test_a_heartbeating_socket_has_no_receive_mark_and_the_others_keep_theirs() -> None:
    context = new_context()
    dealer = open_socket(context, zmq.DEALER, OPTIONS)
    pull = open_socket(context, zmq.PULL, OPTIONS)
    quiet = open_socket(context, zmq.DEALER, OPTIONS, zmtp_heartbeat=False)
    try:
        assert _heartbeat_and_mark(dealer) == (OPTIONS.zmtp_heartbeat_ms, 0)
        assert _heartbeat_and_mark(pull) == (0, OPTIONS.recv_hwm)
        assert _heartbeat_and_mark(quiet) == (0, OPTIONS.recv_hwm)
    finally:
        for sock in (dealer, pull, quiet):
            sock.close(linger=0)
        context.term()


def test_the_client_s_control_dealer_has_heartbeats_and_no_receive_mark() -> None:
    async def scenario() -> tuple[int, int]:
        connection = ClientConnection.open(
            f"tcp://127.0.0.1:{free_tcp_port()}",  # nobody there: nothing is asked
            keys_dir=None,
            key_name="client",
            sink_bind="tcp://127.0.0.1:0",
            advertise_host=None,
            timeouts=Timeouts(),
            options=OPTIONS,
        )
        try:
            return _heartbeat_and_mark(connection.control.sock)
        finally:
            await connection.close()

    heartbeat, mark = asyncio.run(scenario())
    assert heartbeat > 0
    assert mark == 0


def test_the_fl_client_s_dealer_has_heartbeats_and_no_receive_mark() -> None:
    config = NetClientConfig(server=f"tcp://127.0.0.1:{free_tcp_port()}", client=0, samples=10)
    client = FederatedClient(config, load_digits_dataset())
    client.open()
    try:
        assert client._dealer is not None
        heartbeat, mark = _heartbeat_and_mark(client._dealer)
    finally:
        client.close()
    assert heartbeat > 0
    assert mark == 0
