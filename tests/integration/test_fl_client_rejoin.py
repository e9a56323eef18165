"""fl-client against a raw server socket that goes away (issue 33).

The client (:class:`FederatedClient`, its real socket) runs in this process; the
"server" is a ROUTER of the test. When the ROUTER is closed and bound again on the
same port (a restarted server), the client notices through its socket monitor and
registers again, under the routing id it registered with the first time; when it
does not come back, the client gives up after ``--reconnect-timeout`` with an error
that says so. Before the fix the client neither registered again nor gave up before
its idle timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import zmq

pytest.importorskip("sklearn")

from tests._support.fl_raw import receive_fl, send_fl
from zpipe._errors import TransportTimeout
from zpipe.federated.net_client import FederatedClient, NetClientConfig
from zpipe.lossy.data import load_digits_dataset
from zpipe.protocol.federated import FlDone, FlRegister, FlWelcome

DEADLINE_S = 60.0  # generous: the machine is shared and loaded


def _router(context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> zmq.Socket[bytes]:
    """A ROUTER bound to ``endpoint``; a port just closed is retried until libzmq has
    let it go (its close is asynchronous)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            router.bind(endpoint)
            return router
        except zmq.ZMQError:
            router.close(linger=0)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _welcome(router: zmq.Socket[bytes]) -> bytes:
    """Receive one registration, welcome it; the sender's routing id."""
    assert router.poll(int(DEADLINE_S * 1000)), "no registration came"
    routing_id, *frames = router.recv_multipart()
    from zpipe.protocol import REGISTRY
    from zpipe.transport.codec import decode

    message = REGISTRY.parse(decode(frames))
    assert isinstance(message, FlRegister) and message.client == 4
    router.send_multipart([routing_id, *_encoded(FlWelcome(client=4))])
    return routing_id


def _encoded(message: FlWelcome | FlDone) -> list[bytes]:
    from zpipe.transport.codec import encode

    return [bytes(frame) for frame in encode(message.to_message())]


def _serve_in_thread(client: FederatedClient, result: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            client.open()
            result["reason"] = asyncio.run(client.serve())
        except BaseException as exc:  # the test reports it
            result["error"] = exc
        finally:
            client.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _config(endpoint: str, **changes: object) -> NetClientConfig:
    base = NetClientConfig(
        server=endpoint, client=4, samples=10, profile_steps=1, connect_timeout_s=DEADLINE_S
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_a_restarted_server_gets_the_client_back_under_its_routing_id() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = _router(context, "tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    client = FederatedClient(
        _config(endpoint, reconnect_timeout_s=DEADLINE_S), load_digits_dataset()
    )
    result: dict[str, object] = {}
    thread = _serve_in_thread(client, result)
    try:
        first = _welcome(router)
        time.sleep(0.5)  # let the client reach its loop (correct either way)
        router.close(linger=0)  # the server goes away ...
        router = _router(context, endpoint)  # ... and comes back on the same port
        again = _welcome(router)
        assert again == first  # the same route: a server that kept it would find it
        router.send_multipart([again, *_encoded(FlDone(reason="updates"))])
        thread.join(DEADLINE_S)
    finally:
        router.close(linger=0)
        context.term()
    assert result.get("reason") == "updates", result


def test_a_server_that_does_not_come_back_ends_the_client_with_a_clear_error() -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = _router(context, "tcp://127.0.0.1:*")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    client = FederatedClient(
        _config(endpoint, reconnect_timeout_s=1.0, idle_timeout_s=DEADLINE_S),
        load_digits_dataset(),
    )
    result: dict[str, object] = {}
    thread = _serve_in_thread(client, result)
    try:
        _welcome(router)
        router.close(linger=0)
        started = time.monotonic()
        thread.join(DEADLINE_S)
        waited = time.monotonic() - started
    finally:
        context.term()
    error = result.get("error")
    assert isinstance(error, TransportTimeout), result
    assert "--reconnect-timeout" in str(error) and "dropped" in str(error)
    assert waited < DEADLINE_S / 2  # not the idle timeout's 60 s


def test_the_raw_helpers_still_speak_to_a_dealer() -> None:
    """The helpers above build frames by hand; a sanity check that they match the
    shared ones (send_fl / receive_fl) the other fl tests use."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = _router(context, "tcp://127.0.0.1:*")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        send_fl(dealer, FlRegister(client=4, label_counts=[1] * 10, latency_s=0.1))
        _welcome(router)
        assert isinstance(receive_fl(dealer, DEADLINE_S), FlWelcome)
    finally:
        dealer.close()
        router.close()
        context.term()
